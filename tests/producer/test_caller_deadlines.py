"""A caller's timeout is a promise: Client and AsyncClient answer by it, whatever Redis does.

Each test starts a redis-server of its own (so it can freeze or kill it
without disturbing the session's) and runs ten concurrent callers with the
default client settings (socket_timeout_s=5, retries=5) against a Redis
that is

* frozen: SIGSTOPped, so TCP connects still succeed (the kernel accepts)
  but nothing is ever answered;
* killed: connections are refused;
* slow: busy in a script from another connection for longer than the
  callers' timeouts;
* busy: the same, past ``busy-reply-threshold``, so that every command is
  refused at once with a BUSY error reply.

Every caller must raise BrokerUnavailable or ReplyTimeout no later than
``timeout + SLACK_S`` (``submit``: ``settings.timeout_s + SLACK_S``) and
not before its timeout, except a ``submit`` that Redis refuses outright
(connection refused, BUSY), which gives up after redis-py's retries. Both
with the config hash already cached (the client was used while Redis was
up) and with the fault in place before the client's first call. After the fault is lifted the
same client works again, with the right answers (no connection cut off
mid-reply is reused), and re-reads a config that a failed read left stale.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.producer.test_producer_fakes import FakeWorker
from tests.redis_server import RedisServer, freezable_server, frozen
from tokenq.producer import (
    AsyncClient,
    BrokerUnavailable,
    Client,
    InputTooLong,
    ReplyTimeout,
)
from tokenq.shared import keys

pytestmark = pytest.mark.fault

TIMEOUT_S = 2.0
SLACK_S = 0.5
"""The promise: an error (or a result) by the caller's timeout plus this."""
EARLY_S = 0.05
"""Clock and scheduling noise allowed below the timeout."""
CALLERS = 10
SLOW_SCRIPT_S = TIMEOUT_S + 0.8
"""Longer than any caller may take (timeout plus the grace), not much longer."""

BUSY_SCRIPT = """
local start = redis.call('TIME')
local t0 = start[1] * 1000000 + start[2]
while true do
  local now = redis.call('TIME')
  if now[1] * 1000000 + now[2] - t0 > tonumber(ARGV[1]) then return 1 end
end
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with freezable_server(tmp_path / "redis") as own:
        yield own


@contextmanager
def fault(server: RedisServer, kind: str) -> Iterator[None]:
    """Break Redis the way ``kind`` says for the duration of the block, then mend it."""
    if kind == "frozen":
        with frozen(server):
            yield
    elif kind == "killed":
        server.stop(kill=True)
        try:
            yield
        finally:
            server.start()
    elif kind in ("slow", "busy"):
        with redis.Redis.from_url(server.url) as admin:  # BUSY replies after 100 ms or 5 s
            admin.config_set("lua-time-limit", 100 if kind == "busy" else 5000)
        busy = threading.Thread(target=_run_busy_script, args=(server.url,), daemon=True)
        busy.start()
        _wait_until_busy(server.url)
        try:
            yield
        finally:
            busy.join(timeout=SLOW_SCRIPT_S + 5)
    else:  # pragma: no cover
        raise ValueError(kind)


def _run_busy_script(url: str) -> None:
    with redis.Redis.from_url(url, socket_timeout=SLOW_SCRIPT_S + 10) as admin:
        admin.eval(BUSY_SCRIPT, 0, int(SLOW_SCRIPT_S * 1_000_000))


def _wait_until_busy(url: str) -> None:
    """Return once a PING no longer comes back (the script has the server): BUSY or silence."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with redis.Redis.from_url(url, socket_timeout=0.3) as probe:
                probe.ping()
        except (redis.TimeoutError, redis.ResponseError):
            return
        time.sleep(0.02)
    raise AssertionError("the busy script never took the server")


def queue() -> str:
    return f"dl{uuid.uuid4().hex[:10]}"


def _lower_bound_holds(kind: str, call: str) -> bool:
    """A submit that Redis refuses (connection refused, BUSY) gives up before its timeout."""
    return not (kind in ("killed", "busy") and call == "submit")


def check(outcomes: list[tuple[str, float, BaseException | None]], kind: str,
          timeout: float = TIMEOUT_S) -> None:
    assert len(outcomes) == CALLERS
    for call, elapsed, error in outcomes:
        assert isinstance(error, (BrokerUnavailable, ReplyTimeout)), (call, elapsed, error)
        assert elapsed <= timeout + SLACK_S, (call, elapsed, error)
        if _lower_bound_holds(kind, call):
            assert elapsed >= timeout - EARLY_S, (call, elapsed, error)


LONG_TEXT = "a rather long text " * 40


def publish_reject_config(url: str, q: str) -> None:
    """A config hash under which LONG_TEXT is refused before it is written."""
    with redis.Redis.from_url(url) as admin:
        admin.hset(keys.config(keys.QueueRef(q)), mapping={
            "max_input_tokens": "8", "policy": "reject", "pairs": "0",
        })


# ------------------------------------------------------------------ sync


def sync_calls(client: Client) -> list[tuple[str, Callable[[], Any]]]:
    kinds: list[tuple[str, Callable[[], Any]]] = [
        ("infer", lambda: client.infer("hello", timeout_s=TIMEOUT_S)),
        ("infer_many", lambda: client.infer_many(["a", "b", "c"], timeout_s=TIMEOUT_S)),
        ("result", lambda: client.result(uuid.uuid4().hex, timeout_s=TIMEOUT_S)),
        ("submit", lambda: client.submit("fire and forget")),  # settings.timeout_s
    ]
    return [kinds[i % len(kinds)] for i in range(CALLERS)]


def run_threads(calls: list[tuple[str, Callable[[], Any]]],
                stagger_s: float = 0.0) -> list[tuple[str, float, BaseException | None]]:
    """Run every call in a thread of its own, all at once; (name, seconds, error) each."""
    outcomes: list[tuple[str, float, BaseException | None]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(calls))

    def one(index: int, name: str, call: Callable[[], Any]) -> None:
        barrier.wait()
        time.sleep(index * stagger_s)
        started = time.monotonic()
        error: BaseException | None = None
        try:
            call()
        except BaseException as exc:  # recorded, checked by the test
            error = exc
        with lock:
            outcomes.append((name, time.monotonic() - started, error))

    threads = [threading.Thread(target=one, args=(i, *c), daemon=True)
               for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    give_up = time.monotonic() + TIMEOUT_S * 3 + 20
    for thread in threads:
        thread.join(timeout=max(0.0, give_up - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"callers still waiting: {outcomes}"
    return outcomes


def _answers_correctly(client: Client, url: str, q: str) -> None:
    worker = FakeWorker(url, q).start()
    try:
        texts = ["after", "the fault", "is over"]
        results = client.infer_many(texts, timeout_s=10)
        assert [r.embedding[0] for r in results] == [float(len(t)) for t in texts]
        assert client.infer("one more", timeout_s=10).embedding[0] == 8.0
    finally:
        worker.stop()


@pytest.mark.parametrize("kind", ["frozen", "killed", "slow", "busy"])
@pytest.mark.parametrize("warm", [True, False], ids=["config-cached", "first-call"])
def test_sync_callers_keep_their_timeout(server: RedisServer, kind: str, warm: bool) -> None:
    q = queue()
    with Client(server.url, q, timeout_s=TIMEOUT_S) as client:
        if warm:
            client.submit("while Redis is up")  # reads (and caches) the config, pools a socket
        with fault(server, kind):
            outcomes = run_threads(sync_calls(client))
        check(outcomes, kind)
        _answers_correctly(client, server.url, q)


def test_sync_callers_wait_for_a_shared_config_read_only_until_their_own_deadline(
    server: RedisServer,
) -> None:
    """One slow config read holds nobody past their timeout, and leaves no stale cache."""
    q = queue()
    publish_reject_config(server.url, q)
    short, long = 1.0, 2.5
    with Client(server.url, q) as client:
        reads = 0
        real = client._redis.hgetall

        def counting(key: str) -> Any:
            nonlocal reads
            reads += 1
            return real(key)

        client._redis.hgetall = counting  # type: ignore[method-assign]
        with fault(server, "frozen"):
            # The first caller (the longest timeout) starts the read; the rest join it.
            calls = [("leader", lambda: client.infer("x", timeout_s=long))]
            calls += [("follower", lambda: client.infer("x", timeout_s=short))] * (CALLERS - 1)
            outcomes = run_threads(calls, stagger_s=0.02)
        assert reads == 1, "the followers started reads of their own"
        for name, elapsed, error in outcomes:
            timeout = long if name == "leader" else short
            assert isinstance(error, (BrokerUnavailable, ReplyTimeout)), (name, error)
            assert timeout - EARLY_S <= elapsed <= timeout + SLACK_S, (name, elapsed, error)
        # The failed read did not stick: the next call reads the config and refuses.
        with pytest.raises(InputTooLong):
            client.submit(LONG_TEXT)
        assert reads == 2


def test_sync_callers_beyond_the_pool_wait_only_until_their_deadline(
    server: RedisServer,
) -> None:
    """With max_connections=2, eight of the ten wait for a connection: no longer than allowed."""
    q = queue()
    with Client(server.url, q, timeout_s=TIMEOUT_S, max_connections=2) as client:
        client.submit("while Redis is up")
        with fault(server, "frozen"):
            outcomes = run_threads(sync_calls(client))
        check(outcomes, "frozen")
        _answers_correctly(client, server.url, q)


# ------------------------------------------------------------------ async


def async_calls(client: AsyncClient) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
    kinds: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("infer", lambda: client.infer("hello", timeout_s=TIMEOUT_S)),
        ("infer_many", lambda: client.infer_many(["a", "b", "c"], timeout_s=TIMEOUT_S)),
        ("result", lambda: client.result(uuid.uuid4().hex, timeout_s=TIMEOUT_S)),
        ("submit", lambda: client.submit("fire and forget")),
    ]
    return [kinds[i % len(kinds)] for i in range(CALLERS)]


async def gather_timed(
    calls: list[tuple[str, Callable[[], Awaitable[Any]]]], stagger_s: float = 0.0
) -> list[tuple[str, float, BaseException | None]]:
    async def one(index: int, name: str, call: Callable[[], Awaitable[Any]]) -> Any:
        await asyncio.sleep(index * stagger_s)
        started = time.monotonic()
        error: BaseException | None = None
        try:
            await call()
        except Exception as exc:  # recorded, checked by the test
            error = exc
        return name, time.monotonic() - started, error

    return await asyncio.wait_for(
        asyncio.gather(*(one(i, *c) for i, c in enumerate(calls))), TIMEOUT_S * 3 + 30
    )


async def _async_answers_correctly(client: AsyncClient, url: str, q: str) -> None:
    worker = FakeWorker(url, q).start()
    try:
        texts = ["after", "the fault", "is over"]
        results = await client.infer_many(texts, timeout_s=10)
        assert [r.embedding[0] for r in results] == [float(len(t)) for t in texts]
        assert (await client.infer("one more", timeout_s=10)).embedding[0] == 8.0
        request_id = await client.submit("fetched")
        assert (await client.result(request_id, timeout_s=10)).embedding[0] == 7.0
    finally:
        worker.stop()


@pytest.mark.parametrize("kind", ["frozen", "killed", "slow", "busy"])
@pytest.mark.parametrize("warm", [True, False], ids=["config-cached", "first-call"])
def test_async_callers_keep_their_timeout(server: RedisServer, kind: str, warm: bool) -> None:
    q = queue()

    async def main() -> None:
        client = AsyncClient(server.url, q, timeout_s=TIMEOUT_S)
        try:
            if warm:
                await client.submit("while Redis is up")
            with fault(server, kind):
                outcomes = await gather_timed(async_calls(client))
            check(outcomes, kind)
            await _async_answers_correctly(client, server.url, q)
        finally:
            started = time.monotonic()
            await client.aclose()
            assert time.monotonic() - started < 2

    asyncio.run(main())


def test_async_callers_beyond_the_pool_wait_only_until_their_deadline(
    server: RedisServer,
) -> None:
    q = queue()

    async def main() -> None:
        async with AsyncClient(server.url, q, timeout_s=TIMEOUT_S, max_connections=2) as client:
            await client.submit("while Redis is up")
            with fault(server, "frozen"):
                outcomes = await gather_timed(async_calls(client))
            check(outcomes, "frozen")
            await _async_answers_correctly(client, server.url, q)

    asyncio.run(main())


def test_async_callers_wait_for_a_shared_config_read_only_until_their_own_deadline(
    server: RedisServer,
) -> None:
    q = queue()
    publish_reject_config(server.url, q)
    short, long = 1.0, 2.5

    async def main() -> None:
        async with AsyncClient(server.url, q) as client:
            reads = 0
            real = client._redis.hgetall

            async def counting(key: str) -> Any:
                nonlocal reads
                reads += 1
                return await real(key)

            client._redis.hgetall = counting  # type: ignore[method-assign]
            with fault(server, "frozen"):
                calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                    ("leader", lambda: client.infer("x", timeout_s=long))
                ]
                calls += [("follower", lambda: client.infer("x", timeout_s=short))] * (
                    CALLERS - 1
                )
                outcomes = await gather_timed(calls, stagger_s=0.02)
            assert reads == 1, "the followers started reads of their own"
            for name, elapsed, error in outcomes:
                timeout = long if name == "leader" else short
                assert isinstance(error, (BrokerUnavailable, ReplyTimeout)), (name, error)
                assert timeout - EARLY_S <= elapsed <= timeout + SLACK_S, (name, elapsed, error)
            with pytest.raises(InputTooLong):
                await client.submit(LONG_TEXT)
            assert reads == 2

    asyncio.run(main())


def test_cancelling_the_reader_does_not_cancel_the_shared_config_read(
    server: RedisServer,
) -> None:
    """The read is its own task: the caller that started it may go away, the others get it."""
    q = queue()
    publish_reject_config(server.url, q)

    async def main() -> None:
        async with AsyncClient(server.url, q) as client:
            with fault(server, "frozen"):
                first = asyncio.ensure_future(client.submit(LONG_TEXT))
                await asyncio.sleep(0.2)
                others = [asyncio.ensure_future(client.submit(LONG_TEXT)) for _ in range(3)]
                await asyncio.sleep(0.2)
                first.cancel()
                await asyncio.sleep(0.3)
            for other in others:
                with pytest.raises(InputTooLong):
                    await asyncio.wait_for(other, 10)
            with pytest.raises(asyncio.CancelledError):
                await first

    asyncio.run(main())


# ------------------------------------------------------------------ tokenizer loads


def _slow_loader(calls: list[str], seconds: float) -> Callable[[str], str]:
    def load(path: str) -> str:
        calls.append(path)
        time.sleep(seconds)
        return "too slow to be useful"

    return load


def test_a_slow_tokenizer_load_holds_no_caller_past_its_deadline(
    redis_url: str, queue_name: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load goes on in the background; callers carry on with the heuristic meanwhile."""
    import tokenq.producer.core

    r.hset(keys.config(keys.QueueRef(queue_name)), mapping={"tokenizer": "/nowhere/t.json"})
    calls: list[str] = []
    monkeypatch.setattr(tokenq.producer.core, "load_estimator", _slow_loader(calls, 1.5))
    timeout = 0.5
    with Client(redis_url, queue_name, timeout_s=timeout) as client:
        for _ in range(2):
            started = time.monotonic()
            client.submit("hello")  # enqueued with the heuristic estimate
            assert time.monotonic() - started <= timeout + SLACK_S
    assert calls == ["/nowhere/t.json"], "a load in progress was started again"

    async def main() -> None:
        async with AsyncClient(redis_url, queue_name, timeout_s=timeout) as client:
            started = time.monotonic()
            await asyncio.gather(*(client.submit("hello") for _ in range(CALLERS)))
            assert time.monotonic() - started <= timeout + SLACK_S
            await client.submit("again")

    asyncio.run(main())
    assert calls == ["/nowhere/t.json"] * 2  # one per client
    assert r.xlen(keys.requests(keys.QueueRef(queue_name))) == 2 + CALLERS + 1
