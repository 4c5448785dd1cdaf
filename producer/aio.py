"""The asyncio producer client, twin of :mod:`tokenq.producer.client`.

What differs from the sync client is how it waits. ``infer`` and
``infer_many`` do not block a connection per caller: every request of one
``AsyncClient`` names the same reply key (``keys.reply(q, <client id>)``),
one background task BLPOPs that key on its own connection and resolves each
caller's future by request id. So a thousand concurrent ``infer`` calls use
at most ``max_connections`` pooled connections for enqueueing plus one for
listening. The listener runs only while someone waits, and replies for ids
nobody waits for any more (a caller that timed out) are dropped.

The config hash is re-read as by the sync client, under one lock so that
concurrent callers share a single read; a tokenizer it names is loaded in a
worker thread, so the event loop never parses a tokenizer.json.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.retry import Retry

from tokenq.producer._config import DEFAULT_CONFIG_TTL_S
from tokenq.producer._core import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    ENQUEUE_SCRIPT,
    REDIS_DOWN,
    ClientCore,
    EstimatorChoice,
    Outcome,
    Prepared,
    Result,
    TextItem,
    make_settings,
)
from tokenq.producer.tokenizer import load_estimator
from tokenq.shared.errors import BrokerUnavailable, TokenqError
from tokenq.shared.settings import ClientSettings

log = logging.getLogger("tokenq.producer")



DEFAULT_MAX_CONNECTIONS = 16
"""Pooled connections per AsyncClient; callers beyond it wait for a free one."""

_LISTEN_FOREVER_S = float("inf")

_CANCEL_GRACE_S = 0.02
_WAKE = b"tokenq:wake"
"""Pushed on the client's own reply key by aclose; never a msgpack reply."""
_WAKE_TTL_MS = 1000


def _now_ms() -> int:
    return int(time.time() * 1000)


def _backoff(failures: int) -> float:
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**failures)


class AsyncClient:
    """An asyncio producer for one queue; see :class:`tokenq.producer.Client` for the API.

    Use it from one event loop. ``max_connections`` bounds the command pool
    (the listener has one more connection of its own). ``estimator``,
    ``config_ttl_s`` and ``refuse_early`` work as for the sync client.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        queue: str | None = None,
        *,
        prefix: str | None = None,
        max_queue_length: int | None = None,
        timeout_s: float | None = None,
        estimator: EstimatorChoice = "auto",
        settings: ClientSettings | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        config_ttl_s: float = DEFAULT_CONFIG_TTL_S,
        refuse_early: bool = True,
    ) -> None:
        self.settings = make_settings(
            settings,
            redis_url=redis_url,
            queue=queue,
            prefix=prefix,
            max_queue_length=max_queue_length,
            timeout_s=timeout_s,
        )
        self._core = ClientCore(self.settings, estimator, config_ttl_s, refuse_early)
        self._config_lock = asyncio.Lock()
        self.client_id = self._core.new_id()
        self._reply_key = self._core.reply_key(self.client_id)
        s = self.settings
        connection_kwargs = self._core.connection_options(Retry, self.client_id)
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            s.redis_url, max_connections=max_connections, timeout=s.timeout_s, **connection_kwargs
        )
        self._redis = redis.asyncio.Redis.from_pool(pool)
        self._listen_redis = redis.asyncio.Redis.from_url(
            s.redis_url, single_connection_client=True, **connection_kwargs
        )
        self._enqueue_script = self._redis.register_script(ENQUEUE_SCRIPT)
        self._waiters: dict[str, asyncio.Future[Outcome]] = {}
        self._listener: asyncio.Task[None] | None = None
        self._unreachable: BaseException | None = None
        self._closing = False

    # ------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        """Stop the listener, fail whoever still waits, close every connection."""
        self._closing = True
        listener = self._listener
        if listener is not None and not listener.done():
            listener.cancel()
            done, _ = await asyncio.wait({listener}, timeout=_CANCEL_GRACE_S)
            if not done:
                # redis-py can swallow a cancel that lands while a command is
                # being sent; the BLPOP then runs its course. Wake it instead.
                await self._wake_listener()
                await asyncio.wait({listener}, timeout=self.settings.socket_timeout_s)
        self._listener = None
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(TokenqError("the AsyncClient was closed while waiting"))
        await self._listen_redis.aclose()
        await self._redis.aclose()

    async def _wake_listener(self) -> None:
        """Push a marker the listener's BLPOP returns at once (it expires unread if unneeded)."""
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.rpush(self._reply_key, _WAKE)
                pipe.pexpire(self._reply_key, _WAKE_TTL_MS)
                await pipe.execute()
        except redis.RedisError as exc:  # down, or an ACL without RPUSH: closing must not fail
            log.debug("could not wake the reply listener (%s); it stops after its wait", exc)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncClient({self._core.url!r}, queue={self._core.queue.name!r})"

    @property
    def queue(self) -> str:
        """The queue's name."""
        return self._core.queue.name

    @contextmanager
    def _broker(self) -> Iterator[None]:
        try:
            yield
        except REDIS_DOWN as exc:
            raise BrokerUnavailable(f"Redis at {self._core.url} is unreachable: {exc}") from exc

    # --------------------------------------------------------------- submit

    async def submit(
        self,
        text: str,
        *,
        text_pair: str | None = None,
        deadline_s: float | None = None,
        deadline_ms: int | None = None,
        reply_to: str | None = None,
        opts: Mapping[str, Any] | None = None,
    ) -> str:
        """Enqueue one text; its reply goes to its own key, for :meth:`result`."""
        await self._ensure_config()
        prepared = self._core.prepare(
            text,
            now_ms=_now_ms(),
            text_pair=text_pair,
            deadline_s=deadline_s,
            deadline_ms=deadline_ms,
            reply_to=reply_to,
            opts=opts,
        )
        await self._enqueue([prepared])
        return prepared.id

    async def submit_many(
        self,
        texts: Iterable[TextItem],
        *,
        deadline_s: float | None = None,
        deadline_ms: int | None = None,
        reply_to: str | None = None,
        opts: Mapping[str, Any] | None = None,
    ) -> list[str]:
        """Enqueue a batch all or nothing; ids in input order."""
        await self._ensure_config()
        batch = self._core.prepare_many(
            texts,
            now_ms=_now_ms(),
            deadline_s=deadline_s,
            deadline_ms=deadline_ms,
            reply_to=reply_to,
            opts=opts,
        )
        await self._enqueue(batch)
        return [p.id for p in batch]

    async def _ensure_config(self) -> None:
        """Re-read the queue's config hash if the cached copy is older than ``config_ttl_s``."""
        async with self._config_lock:
            if self._core.config_cache.due(time.monotonic()):
                await self._read_config(strict=False)

    async def _read_config(self, *, strict: bool) -> dict[str, str]:
        """HGETALL the config hash into the cache (see :meth:`Client._read_config`)."""
        with self._broker():
            try:
                raw = await self._redis.hgetall(self._core.config_key)
            except redis.ResponseError as exc:
                if strict:
                    raise
                self._core.config_unreadable(exc, time.monotonic())
                return {}
        path = self._core.take_config(raw, time.monotonic())
        if path is not None:
            loaded = await asyncio.to_thread(load_estimator, path)
            self._core.config_cache.take_tokenizer(path, loaded)
        return self._core.decode_config(raw)

    async def _enqueue(self, batch: Sequence[Prepared]) -> None:
        if not batch:
            return
        args = self._core.script_args(batch)
        with self._broker():
            try:
                await self._enqueue_script(keys=self._core.script_keys(batch), args=args)
            except redis.OutOfMemoryError:
                raise self._core.broker_full(len(batch)) from None
            except redis.ResponseError as exc:
                full = self._core.queue_full(str(exc), len(batch))
                if full is not None:
                    raise full from None
                raise

    # -------------------------------------------------------------- results

    async def result(self, request_id: str, timeout_s: float | None = None) -> Result:
        """Wait for the reply to a request :meth:`submit` made (here or elsewhere)."""
        results: list[Result] = await self.results([request_id], timeout_s)
        return results[0]

    async def results(
        self,
        request_ids: Sequence[str],
        timeout_s: float | None = None,
        *,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Wait for several submitted requests' replies (one pooled connection while waiting)."""
        timeout = self._core.timeout(timeout_s)
        started = time.monotonic()
        wanted = self._core.reply_keys(request_ids)
        outcomes: dict[str, Outcome | Exception] = {}
        unreachable: BaseException | None = None
        failures = 0
        while wanted:
            remaining = started + timeout - time.monotonic()
            if remaining <= 0:
                break
            try:
                popped = await self._redis.blpop(
                    list(wanted), timeout=self._core.block_s(remaining)
                )
            except REDIS_DOWN as exc:
                unreachable, failures = exc, failures + 1
                await asyncio.sleep(max(0.0, min(_backoff(failures), remaining)))
                continue
            unreachable, failures = None, 0
            if popped is None:
                continue
            self._core.own_key_reply(wanted, *popped, outcomes)
        self._core.missing(list(wanted.values()), outcomes, time.monotonic() - started, unreachable)
        return self._core.settle(request_ids, outcomes, return_exceptions)

    # ---------------------------------------------------------------- infer

    async def infer(
        self,
        text: str,
        *,
        text_pair: str | None = None,
        timeout_s: float | None = None,
        deadline_s: float | None = None,
        deadline_ms: int | None = None,
        opts: Mapping[str, Any] | None = None,
    ) -> Result:
        """Enqueue one text and wait for its result on the client's shared reply key.

        Unless a deadline is given, the request carries the caller's timeout
        as its deadline (see :meth:`tokenq.producer.Client.infer`).
        """
        started = time.monotonic()
        timeout = self._core.timeout(timeout_s)
        common = self._infer_fields(timeout, deadline_s, deadline_ms, opts)
        await self._ensure_config()
        prepared = self._core.prepare(text, text_pair=text_pair, **common)
        results: list[Result] = await self._run([prepared], started + timeout, started, False)
        return results[0]

    async def infer_many(
        self,
        texts: Iterable[TextItem],
        *,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
        deadline_s: float | None = None,
        deadline_ms: int | None = None,
        opts: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Enqueue a batch all or nothing and wait for every result, in input order."""
        started = time.monotonic()
        timeout = self._core.timeout(timeout_s)
        common = self._infer_fields(timeout, deadline_s, deadline_ms, opts)
        await self._ensure_config()
        batch = self._core.prepare_many(texts, **common)
        return await self._run(batch, started + timeout, started, return_exceptions)

    def _infer_fields(
        self,
        timeout: float,
        deadline_s: float | None,
        deadline_ms: int | None,
        opts: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """What every request of an infer call shares: the client's reply key and deadline."""
        if self._closing:
            raise TokenqError("the AsyncClient is closed")
        deadline_s, deadline_ms = self._core.infer_deadline(timeout, deadline_s, deadline_ms)
        return {
            "now_ms": _now_ms(),
            "deadline_s": deadline_s,
            "deadline_ms": deadline_ms,
            "reply_to": self._reply_key,
            "opts": opts,
        }

    async def _run(
        self, batch: list[Prepared], deadline: float, started: float, return_exceptions: bool
    ) -> list[Any]:
        """Enqueue ``batch`` and wait until the listener resolved every future, or the deadline."""
        ids = [p.id for p in batch]
        loop = asyncio.get_running_loop()
        futures = {i: loop.create_future() for i in ids}
        self._waiters.update(futures)  # before enqueueing: a reply may beat the XADD's answer
        try:
            self._ensure_listener()
            await self._enqueue(batch)
            remaining = deadline - time.monotonic()
            if futures and remaining > 0:
                await asyncio.wait(futures.values(), timeout=remaining)
            outcomes: dict[str, Outcome | Exception] = {}
            for request_id, future in futures.items():
                if future.done():
                    outcomes[request_id] = future.exception() or future.result()
            missing = [i for i in ids if i not in outcomes]
            self._core.missing(missing, outcomes, time.monotonic() - started, self._unreachable)
            return self._core.settle(ids, outcomes, return_exceptions)
        finally:
            for request_id in ids:
                self._waiters.pop(request_id, None)

    # ------------------------------------------------------------- listener

    def _ensure_listener(self) -> None:
        """Start the listener unless it is running (it stops when nobody waits)."""
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(
                self._listen(), name=f"tokenq-listener-{self.client_id[:12]}"
            )

    async def _listen(self) -> None:
        """BLPOP the client's reply key while anyone waits; resolve futures by id."""
        failures = 0
        while self._waiters and not self._closing:
            try:
                popped = await self._listen_redis.blpop(
                    [self._reply_key], timeout=self._core.block_s(_LISTEN_FOREVER_S)
                )
                raws = [] if popped is None else [popped[1]]
                if popped is not None:
                    count = max(1, len(self._waiters))
                    raws += await self._listen_redis.lpop(self._reply_key, count) or []
            except REDIS_DOWN as exc:
                self._unreachable, failures = exc, failures + 1
                await asyncio.sleep(_backoff(failures))
                continue
            except Exception:  # never let one odd error strand every waiter
                log.exception("tokenq reply listener failed; retrying")
                failures += 1
                await asyncio.sleep(_backoff(failures))
                continue
            self._unreachable, failures = None, 0
            for raw in raws:
                if raw != _WAKE:
                    self._deliver(raw)

    def _deliver(self, raw: bytes) -> None:
        reply = self._core.decode(raw)
        if reply is None:
            return
        future = self._waiters.get(reply.id)
        if future is None or future.done():
            log.debug("dropping a reply for request %s: nobody waits for it", reply.id)
            return
        future.set_result(self._core.outcome(reply))

    # ---------------------------------------------------------------- admin

    async def queue_length(self) -> int:
        """How many requests the queue's stream holds (pending and in flight)."""
        with self._broker():
            return int(await self._redis.xlen(self._core.stream_key))

    async def config(self) -> dict[str, str]:
        """The queue's config hash; refreshes the cached copy (see ``Client.config``)."""
        async with self._config_lock:
            return await self._read_config(strict=True)
