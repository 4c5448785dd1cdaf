"""Durable enqueue (``durable_replicas``): an enqueue returns only once replicas have it.

A real primary and a real replica (``--replicaof``) on loopback. The replica
is frozen with SIGSTOP to make it miss the deadline, which is the state a
failover would lose: the request is on the primary alone, and the caller is
told so (``NotReplicated``, with the ids) instead of an accepted request
that a promotion would drop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from tests.redis_server import RedisServer, freezable_server
from tokenq.producer import AsyncClient, Client, NotReplicated
from tokenq.shared import keys, wire
from tokenq.shared.settings import ClientSettings

QUEUE = "durable"
STREAM = keys.requests(keys.QueueRef(QUEUE))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[SimpleNamespace]:
    """A primary and one replica that has caught up with it."""
    with freezable_server(tmp_path / "primary") as primary:
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


def settings(url: str, replicas: int, timeout_ms: int = 300) -> ClientSettings:
    return ClientSettings(redis_url=url, queue=QUEUE, timeout_s=5,
                          durable_replicas=replicas, durable_timeout_ms=timeout_ms)


def stream_ids(r: redis.Redis) -> list[str]:
    return [wire.decode_request(fields).id for _, fields in r.xrange(STREAM)]


def test_a_durable_enqueue_returns_once_the_replica_has_it(pair: SimpleNamespace) -> None:
    with Client(settings=settings(pair.primary.url, 1)) as client:
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
    with Client(settings=settings(pair.primary.url, 2)) as asks_for_two, \
            pytest.raises(NotReplicated, match="1 of 2 replicas"):
        asks_for_two.submit("only one replica exists")
    with Client(settings=settings(pair.primary.url, 0)) as plain:
        plain.submit("not durable: returns once the primary has it")


def test_the_async_client_waits_for_its_replicas_too(pair: SimpleNamespace) -> None:
    async def main() -> tuple[str, BaseException | None]:
        async with AsyncClient(settings=settings(pair.primary.url, 1)) as client:
            kept = await client.submit("async and durable")
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
