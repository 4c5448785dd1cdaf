"""Durable enqueue (``durable_replicas``): an enqueue returns only once replicas have it.

A real primary and a real replica (``--replicaof``) on loopback. The replica
is frozen with SIGSTOP to make it miss the deadline, which is the state a
failover would lose: the request is on the primary alone, and the caller is
told so (``NotReplicated``, with the ids) instead of an accepted request
that a promotion would drop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from tests.redis_server import RedisServer, freezable_server, frozen
from tokenq.producer import AsyncClient, Client, NotReplicated
from tokenq.shared import keys, wire
from tokenq.shared.settings import ClientSettings

QUEUE = "durable"
STREAM = keys.requests(keys.QueueRef(QUEUE))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[SimpleNamespace]:
    """A primary and one replica that has caught up with it."""
    with freezable_server(tmp_path / "primary") as primary:
        # Redis 7 waits 5 s for more replicas before a diskless full sync; one is all.
        redis.Redis(port=primary.port).config_set("repl-diskless-sync-delay", 0)
        replica = RedisServer(tmp_path / "replica",
                              args=("--replicaof", "127.0.0.1", str(primary.port)))
        replica.start()
        try:
            view = redis.Redis(port=replica.port)
            deadline = time.monotonic() + 10
            while view.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline, "the replica never linked"
                time.sleep(0.05)
            yield SimpleNamespace(primary=primary, replica=replica, view=view)
        finally:
            if replica.process is not None:
                os.kill(replica.process.pid, signal.SIGCONT)
            replica.stop(kill=True)


CONFIRMED_MS = 5000
"""The durable timeout of a call whose replica is healthy: WAIT returns as soon as the
replica acknowledges, so a long one costs nothing, and a loaded machine (CI: a replica's
acknowledgement later than 300 ms) does not read as a missed confirmation."""


def settings(url: str, replicas: int, timeout_ms: int = 300) -> ClientSettings:
    return ClientSettings(redis_url=url, queue=QUEUE, timeout_s=5,
                          durable_replicas=replicas, durable_timeout_ms=timeout_ms)


def stream_ids(r: redis.Redis) -> list[str]:
    return [wire.decode_request(fields).id for _, fields in r.xrange(STREAM)]


def test_a_durable_enqueue_returns_once_the_replica_has_it(pair: SimpleNamespace) -> None:
    with Client(settings=settings(pair.primary.url, 1, CONFIRMED_MS)) as client:
        first = client.submit("kept on two machines")
        many = client.submit_many(["a", "b", "c"])
    # WAIT returned 1, so the replica already holds every entry: nothing to poll for.
    assert stream_ids(pair.view) == [first, *many]


def test_too_few_replicas_in_time_is_not_replicated_and_names_the_requests(
    pair: SimpleNamespace,
) -> None:
    primary = redis.Redis(port=pair.primary.port)
    with Client(settings=settings(pair.primary.url, 1, timeout_ms=300)) as client:
        assert pair.replica.process is not None
        os.kill(pair.replica.process.pid, signal.SIGSTOP)  # it stops acknowledging
        started = time.monotonic()
        with pytest.raises(NotReplicated, match=r"0 of 1 replicas confirmed within 300 ms") as info:
            client.submit_many(["on the primary only", "and this"])
        assert time.monotonic() - started < 3
        # Written, as the message says: the ids are on the primary's stream.
        assert list(info.value.request_ids) == stream_ids(primary)
        os.kill(pair.replica.process.pid, signal.SIGCONT)
    # The resumed replica answers again (caught up) before it is counted on below.
    assert primary.execute_command("WAIT", 1, CONFIRMED_MS) == 1
    with Client(settings=settings(pair.primary.url, 2, 1000)) as asks_for_two, \
            pytest.raises(NotReplicated, match="1 of 2 replicas"):
        asks_for_two.submit("only one replica exists")
    with Client(settings=settings(pair.primary.url, 0)) as plain:
        plain.submit("not durable: returns once the primary has it")


def test_the_async_client_waits_for_its_replicas_too(pair: SimpleNamespace) -> None:
    async def main() -> tuple[str, BaseException | None]:
        async with AsyncClient(settings=settings(pair.primary.url, 1, CONFIRMED_MS)) as client:
            kept = await client.submit("async and durable")
        async with AsyncClient(settings=settings(pair.primary.url, 1)) as client:
            assert pair.replica.process is not None
            os.kill(pair.replica.process.pid, signal.SIGSTOP)
            try:
                await client.submit("missed")
            except NotReplicated as exc:
                return kept, exc
            finally:
                os.kill(pair.replica.process.pid, signal.SIGCONT)
            return kept, None

    kept, missed = asyncio.run(main())
    assert isinstance(missed, NotReplicated)
    assert kept in stream_ids(pair.view)


# ------------------------------------------- what an unconfirmed enqueue tells its caller


class FakeWorker:
    """Answers every request on the primary's stream once, in a thread (a vector of 2 floats).

    A stand-in for a worker that lets a test count what was computed: each
    stream entry is answered exactly once, so a retried enqueue would show as
    a second entry with the same id.
    """

    def __init__(self, url: str) -> None:
        self.redis = redis.Redis.from_url(url)
        self.answered: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeWorker:
        # Named in the workers hash with its liveness key set, as a worker's heartbeat
        # leaves them: the gateway queues only for a queue with a live worker.
        ref = keys.QueueRef(QUEUE)
        self.redis.hset(keys.workers(ref), "fake", "{}")
        self.redis.set(keys.worker_alive(ref, "fake"), "1", ex=60)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.redis.close()

    def _run(self) -> None:
        last = "-"
        while not self._stop.is_set():
            entries = self.redis.xrange(STREAM, min=last if last == "-" else f"({last}")
            for entry_id, fields in entries:
                request = wire.decode_request(fields)
                vector = struct.pack("<2f", 0.6, 0.8)
                self.redis.rpush(request.reply_to,
                                 wire.encode_reply(wire.embedding_reply(request.id, vector, 2)))
                self.answered.append(request.id)
                last = entry_id.decode()
            time.sleep(0.01)


def test_ids_of_an_unconfirmed_submit_are_waited_for_with_results(pair: SimpleNamespace) -> None:
    """NotReplicated's ids are exactly what results() takes, from both clients' submits."""
    with FakeWorker(pair.primary.url) as worker:
        with Client(settings=settings(pair.primary.url, 1)) as client, frozen(pair.replica):
            with pytest.raises(NotReplicated) as one:
                client.submit("one")
            with pytest.raises(NotReplicated) as many:
                client.submit_many(["a", "b"])
            ids = [*one.value.request_ids, *many.value.request_ids]
            got = client.results(ids, timeout_s=5)
            assert [result.id for result in got] == ids
            assert client.unreplicated == 3

        async def main() -> list[str]:
            async with AsyncClient(settings=settings(pair.primary.url, 1)) as aclient:
                with frozen(pair.replica), pytest.raises(NotReplicated) as missed:
                    await aclient.submit_many(["c", "d"])
                got = await aclient.results(missed.value.request_ids, timeout_s=5)
                assert aclient.unreplicated == 2
                return [result.id for result in got]

        assert asyncio.run(main()) == stream_ids(redis.Redis(port=pair.primary.port))[3:]
        assert sorted(worker.answered) == sorted(stream_ids(redis.Redis(port=pair.primary.port)))


def test_infer_calls_wait_for_their_results_when_replicas_do_not_confirm(
    pair: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    """The requests are queued and will be answered: infer and infer_many (sync and async)
    return the results, each computed once, with one warning line and the miss counted."""
    caplog.set_level(logging.DEBUG, "tokenq.producer")
    primary = redis.Redis(port=pair.primary.port)
    with FakeWorker(pair.primary.url) as worker, frozen(pair.replica):
        with Client(settings=settings(pair.primary.url, 1)) as client:
            assert client.infer("one", timeout_s=5).dim == 2
            assert [r.dim for r in client.infer_many(["a", "b"], timeout_s=5)] == [2, 2]
            assert client.unreplicated == 3

        async def main() -> int:
            async with AsyncClient(settings=settings(pair.primary.url, 1)) as aclient:
                assert (await aclient.infer("two", timeout_s=5)).dim == 2
                assert len(await aclient.infer_many(["c", "d", "e"], timeout_s=5)) == 3
                return aclient.unreplicated

        assert asyncio.run(main()) == 4
    ids = stream_ids(primary)
    assert len(ids) == len(set(ids)) == 7  # nothing enqueued twice
    assert sorted(worker.answered) == sorted(ids)  # each computed once
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]  # one per client a minute
    assert "replicas confirmed" in warnings[0].getMessage()


def test_a_durable_timeout_longer_than_the_socket_timeout_is_waited_for(
    pair: SimpleNamespace,
) -> None:
    """WAIT's own time is not cut by socket_timeout_s: NotReplicated, never BrokerUnavailable."""
    slow = ClientSettings(redis_url=pair.primary.url, queue=QUEUE, timeout_s=5,
                          socket_timeout_s=0.3, durable_replicas=1, durable_timeout_ms=1200)
    with Client(settings=slow) as client:
        assert client.submit("confirmed at once")
        with frozen(pair.replica):
            started = time.monotonic()
            with pytest.raises(NotReplicated, match="within 1200 ms"):
                client.submit("waits the whole durable timeout")
            assert 1.1 < time.monotonic() - started < 3

    async def main() -> None:
        async with AsyncClient(settings=slow) as aclient:
            with frozen(pair.replica), pytest.raises(NotReplicated, match="within 1200 ms"):
                await aclient.submit("async, the same")

    asyncio.run(main())
    assert len(stream_ids(redis.Redis(port=pair.primary.port))) == 3  # each written once


def test_the_gateway_answers_200_when_replicas_do_not_confirm(pair: SimpleNamespace) -> None:
    """The gateway's requests are queued and computed: it answers their results (not a 500
    that a retrying client would double), and counts them in /metrics."""
    testclient = pytest.importorskip("fastapi.testclient")
    from tokenq.producer.serve.app import create_app
    from tokenq.shared.settings import ServeSettings

    serve = ServeSettings(redis_url=pair.primary.url, queue=QUEUE, timeout_s=5,
                          durable_replicas=1, durable_timeout_ms=300)
    with FakeWorker(pair.primary.url) as worker, \
            testclient.TestClient(create_app(serve)) as http, frozen(pair.replica):
        answer = http.post("/v1/embeddings", json={"model": "m", "input": ["x", "y"]})
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["data"]) == 2
        metrics = http.get("/metrics").text
        assert f'tokenq_serve_unreplicated_requests_total{{queue="{QUEUE}"}} 2.0' in metrics
    assert len(worker.answered) == len(set(worker.answered)) == 2
