"""The AsyncClient against a real redis-server and the fake worker.

No pytest-asyncio: each test is a plain function that runs one coroutine
with ``asyncio.run``, which also proves nothing leaks between event loops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from tests.producer.test_producer_fakes import FakeWorker
from tests.redis_server import RedisServer, free_port
from tokenq.producer import (
    AsyncClient,
    BadRequest,
    BrokerUnavailable,
    Client,
    DeadlineExceeded,
    QueueFull,
    RemoteError,
    ReplyTimeout,
    Result,
    TokenqError,
)
from tokenq.shared import keys, wire
from tokenq.shared.settings import ClientSettings

T = TypeVar("T")


def run(make: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await make()

    return asyncio.run(main())


@pytest.fixture
def worker(redis_url: str, queue_name: str) -> Iterator[FakeWorker]:
    fake = FakeWorker(redis_url, queue_name).start()
    yield fake
    fake.stop()


def stream(queue_name: str) -> str:
    return keys.requests(keys.QueueRef(queue_name))


def test_thousand_concurrent_infers_use_few_connections(
    redis_url: str, queue_name: str, r: redis.Redis, worker: FakeWorker
) -> None:
    async def main() -> tuple[list[tuple[str, Result]], int]:
        async with AsyncClient(redis_url, queue_name, timeout_s=20, max_connections=8) as client:
            texts = ["w" * (1 + i % 97) for i in range(1000)]
            results = await asyncio.gather(*(client.infer(t) for t in texts))
            name = f"tokenq-producer-{client.client_id[:12]}"
            opened = sum(1 for c in r.client_list() if c.get("name") == name)
            return [(t, res) for t, res in zip(texts, results, strict=True)], opened

    pairs, opened = run(main)
    assert all(res.embedding[0] == len(t) for t, res in pairs)
    assert len({res.id for _, res in pairs}) == 1000
    assert 1 <= opened <= 8 + 1  # the pool plus the listener's own connection
    assert len({request.reply_to for request in worker.seen}) == 1  # one key per client


def test_infer_many_keeps_order_and_reports_errors(
    redis_url: str, queue_name: str, worker: FakeWorker
) -> None:
    async def main() -> tuple[list, list]:
        async with AsyncClient(redis_url, queue_name, timeout_s=5) as client:
            ordered = await client.infer_many(["x" * n for n in range(1, 101)])
            mixed = await client.infer_many(
                ["ok", "ERR:deadline_exceeded", ("q", "pp")], return_exceptions=True
            )
            return ordered, mixed

    ordered, mixed = run(main)
    assert [res.embedding[0] for res in ordered] == [float(n) for n in range(1, 101)]
    assert isinstance(mixed[0], Result)
    assert isinstance(mixed[1], DeadlineExceeded) and mixed[1].code == "deadline_exceeded"
    assert mixed[2].embedding[2] == 2.0


def test_infer_raises_remote_error(redis_url: str, queue_name: str, worker: FakeWorker) -> None:
    async def main() -> None:
        async with AsyncClient(redis_url, queue_name, timeout_s=5) as client:
            with pytest.raises(RemoteError) as caught:
                await client.infer("ERR:too_long")
            assert caught.value.code == "too_long"
            with pytest.raises(RemoteError):
                await client.infer_many(["fine", "ERR:inference_failed"])
            assert (await client.infer("SCORE")).scores == (0.25, 0.75)

    run(main)


def test_submit_async_fetch_sync_and_back(
    redis_url: str, queue_name: str, worker: FakeWorker
) -> None:
    async def submit() -> list[str]:
        async with AsyncClient(redis_url, queue_name) as client:
            return await client.submit_many(["abc", "de"])

    ids = run(submit)
    with Client(redis_url, queue_name) as sync_client:
        assert sync_client.result(ids[0], timeout_s=5).embedding[0] == 3.0
        other = sync_client.submit("fghi")

    async def fetch() -> list[Result]:
        async with AsyncClient(redis_url, queue_name) as client:
            return [await client.result(other, timeout_s=5), *await client.results(ids[1:])]

    fetched = run(fetch)
    assert [res.embedding[0] for res in fetched] == [4.0, 2.0]


def test_queue_full_writes_nothing(redis_url: str, queue_name: str, r: redis.Redis) -> None:
    async def main() -> None:
        async with AsyncClient(redis_url, queue_name, max_queue_length=2) as client:
            await client.submit("a")
            with pytest.raises(QueueFull):
                await client.submit_many(["b", "c"])
            with pytest.raises(QueueFull):
                await client.infer_many(["b", "c"], timeout_s=1)
            assert await client.queue_length() == 1
            assert client._waiters == {}  # refused requests leave no waiter behind

    run(main)
    assert r.xlen(stream(queue_name)) == 1


def test_bad_input_writes_nothing(redis_url: str, queue_name: str, r: redis.Redis) -> None:
    async def main() -> None:
        async with AsyncClient(redis_url, queue_name) as client:
            with pytest.raises(BadRequest, match="text is empty"):
                await client.infer("  ")
            with pytest.raises(BadRequest, match=r"texts\[1\] must be a string"):
                await client.infer_many(["a", None])
            with pytest.raises(BadRequest, match="deadline_s"):
                await client.submit("a", deadline_s=-3)

    run(main)
    assert r.exists(stream(queue_name)) == 0


def test_timeout_without_worker_is_prompt(redis_url: str, queue_name: str) -> None:
    async def main() -> None:
        async with AsyncClient(redis_url, queue_name) as client:
            started = time.monotonic()
            with pytest.raises(ReplyTimeout) as caught:
                await client.infer("nobody", timeout_s=0.5)
            assert 0.5 <= time.monotonic() - started < 1.5
            assert isinstance(caught.value, TimeoutError)
            started = time.monotonic()
            outcomes = await client.infer_many(["a", "b"], timeout_s=0.3, return_exceptions=True)
            assert all(isinstance(o, ReplyTimeout) for o in outcomes)
            with pytest.raises(TimeoutError):
                await client.result("0" * 32, timeout_s=0.3)
            assert time.monotonic() - started < 2.0

    run(main)


def test_deadlines_travel_as_timeout_ms(redis_url: str, queue_name: str, r: redis.Redis) -> None:
    async def main() -> None:
        async with AsyncClient(redis_url, queue_name) as client:
            with pytest.raises(ReplyTimeout):
                await client.infer("nobody answers", timeout_s=0.3)
            await client.submit("later", deadline_s=7)
            await client.submit("whenever")

    run(main)
    entries = [wire.decode_request(f) for _, f in r.xrange(stream(queue_name))]
    inferred, later, whenever = entries
    assert inferred.timeout_ms is not None and 200 < inferred.timeout_ms <= 300
    assert later.timeout_ms == 7000
    assert whenever.timeout_ms is None
    assert all(e.deadline_ms is None for e in entries)


def test_broker_unavailable_on_closed_port(queue_name: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    settings = ClientSettings(redis_url=url, queue=queue_name, retries=1, timeout_s=0.5)

    async def main() -> None:
        async with AsyncClient(settings=settings) as client:
            for call in (
                lambda: client.submit("a"),
                lambda: client.infer("a"),
                lambda: client.result("abc"),
                client.queue_length,
            ):
                started = time.monotonic()
                with pytest.raises(BrokerUnavailable):
                    await call()
                assert time.monotonic() - started < 1.5

    run(main)


def test_redis_dying_mid_wait_is_broker_unavailable(tmp_path: Path, queue_name: str) -> None:
    server = RedisServer(tmp_path / "dies")
    server.start()
    settings = ClientSettings(redis_url=server.url, queue=queue_name, retries=1)

    async def main() -> None:
        async with AsyncClient(settings=settings) as client:
            waiting = asyncio.ensure_future(client.infer("a", timeout_s=1))
            while not client._waiters:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            server.stop(kill=True)
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable):
                await waiting
            assert time.monotonic() - started < 2

    run(main)


def test_listener_reports_outage_as_broker_unavailable(redis_url: str, queue_name: str) -> None:
    """A listener that cannot reach Redis turns a waiter's timeout into BrokerUnavailable."""

    async def main() -> None:
        async with AsyncClient(redis_url, queue_name, timeout_s=0.5) as client:
            client._unreachable = redis.ConnectionError("simulated outage")
            client._listen = _sleep_forever  # type: ignore[method-assign]
            with pytest.raises(BrokerUnavailable, match="simulated outage"):
                await client.infer("a")

    run(main)


async def _sleep_forever(key: str) -> None:
    await asyncio.sleep(3600)


def test_unknown_replies_are_dropped(redis_url: str, queue_name: str) -> None:
    async def main() -> None:
        async with AsyncClient(redis_url, queue_name, timeout_s=5) as client:
            raw = redis.asyncio.Redis.from_url(redis_url)
            key = keys.reply(keys.QueueRef(queue_name), client.client_id)
            waiting = asyncio.ensure_future(client.infer("a"))
            while not client._waiters:
                await asyncio.sleep(0.01)
            (request_id,) = client._waiters
            stranger = wire.scores_reply("someone-else", [0.0])
            mine = wire.scores_reply(request_id, [1.0])
            await raw.rpush(key, b"not msgpack", wire.encode_reply(stranger))
            await raw.rpush(key, wire.encode_reply(mine), wire.encode_reply(mine))
            assert (await waiting).scores == (1.0,)
            await raw.aclose()

    run(main)


def test_aclose_fails_pending_waiters(redis_url: str, queue_name: str, r: redis.Redis) -> None:
    """And a listener blocked on an empty key is cancelled (BLMOVE removes nothing): no
    marker or anything else is left on the key."""

    async def main() -> None:
        client = AsyncClient(redis_url, queue_name, timeout_s=10)
        waiting = asyncio.ensure_future(client.infer("a"))
        while not client._waiters:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await client.aclose()
        with pytest.raises(TokenqError, match="closed"):
            await waiting
        assert time.monotonic() - started < 1

    run(main)
    assert not r.keys(keys.reply(keys.QueueRef(queue_name), "*"))


def test_a_closed_client_refuses_to_infer_and_writes_nothing(
    redis_url: str, queue_name: str, r: redis.Redis
) -> None:
    async def main() -> None:
        client = AsyncClient(redis_url, queue_name, timeout_s=10)
        await client.aclose()
        started = time.monotonic()
        with pytest.raises(TokenqError, match="is closed"):
            await client.infer("a")
        with pytest.raises(TokenqError, match="is closed"):
            await client.infer_many(["a", "b"])
        assert time.monotonic() - started < 1

    run(main)
    assert not r.exists(keys.requests(keys.QueueRef(queue_name)))


def test_listener_stops_when_nobody_waits(
    redis_url: str, queue_name: str, worker: FakeWorker
) -> None:
    settings = ClientSettings(redis_url=redis_url, queue=queue_name, socket_timeout_s=0.2)

    async def main() -> None:
        async with AsyncClient(settings=settings) as client:
            await client.infer("a")
            listener = client._listeners[client._reply_key]
            await asyncio.wait_for(listener, timeout=2)
            assert (await client.infer("b")).embedding[0] == 1.0  # and restarts on demand

    run(main)


def test_aclose_right_after_the_answers_leaves_no_reply_behind(
    redis_url: str, queue_name: str, r: redis.Redis, worker: FakeWorker
) -> None:
    """Closing while the listener removes replies it delivered lets that removal finish.

    The callers are answered the moment their replies are read; the
    listener's ``LTRIM`` comes after. Slowed down here (a loaded machine or a
    distant Redis), it is still in flight when ``async with`` ends, and a
    close that cancelled it left answered replies on Redis until their TTL.
    """

    async def main() -> None:
        async with AsyncClient(redis_url, queue_name, timeout_s=10) as client:
            listening = client._listen_clients[client._reply_key]
            trim = listening.ltrim

            async def slow_trim(*args: object) -> object:
                await asyncio.sleep(0.3)
                return await trim(*args)

            listening.ltrim = slow_trim
            results = await asyncio.gather(*(client.infer(t) for t in ("a", "bb", "ccc")))
            assert [res.embedding[0] for res in results] == [1.0, 2.0, 3.0]

    run(main)
    assert not r.keys(keys.reply(keys.QueueRef(queue_name), "*")), "answered replies were left"
