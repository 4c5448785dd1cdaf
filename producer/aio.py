"""The asyncio producer client, twin of :mod:`tokenq.producer.client`.

What differs from the sync client is how it waits. ``infer`` and
``infer_many`` do not block a connection per caller: every request of one
``AsyncClient`` names the same reply key (``keys.reply(q, <client id>)``),
one background task BLPOPs that key on its own connection and resolves each
caller's future by request id. So a thousand concurrent ``infer`` calls use
at most ``max_connections`` pooled connections for enqueueing plus one for
listening. The listener runs only while someone waits, and replies for ids
nobody waits for any more (a caller that timed out) are dropped.

A caller's timeout is a promise here too. Each Redis command made for a
caller runs as a task of its own that the caller stops waiting for at its
deadline plus ``DEADLINE_GRACE_S`` (the task is then cancelled, which
disconnects its connection: a reply that arrives later can never be read as
another command's). Inside that task the caller's deadline also bounds
redis-py's socket and pool waits and its retries (see
:mod:`tokenq.producer.core`), so an abandoned command does not linger.

The config hash is re-read as by the sync client: the first caller that
finds the cached copy stale starts one read as a task of its own (shielded:
cancelling that caller does not cancel it), and every caller that needs the
copy meanwhile waits for that task, each only until its own deadline. A
tokenizer it names is loaded in a worker thread, once, so the event loop
never parses a tokenizer.json.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.asyncio.retry import Retry

from tokenq.producer.config import DEFAULT_CONFIG_TTL_S
from tokenq.producer.core import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    CALLER_DEADLINE,
    DEADLINE_GRACE_S,
    ENQUEUE_SCRIPT,
    REDIS_DOWN,
    ClientCore,
    Deadline,
    DeadlinePoolWait,
    EstimatorChoice,
    Outcome,
    Prepared,
    Result,
    TextItem,
    busy_as_down,
    deadline_bound,
    make_settings,
    retry_pause,
)
from tokenq.producer.tokenizer import TokenizerEstimator, load_estimator
from tokenq.shared.errors import BrokerUnavailable, TokenqError
from tokenq.shared.settings import ClientSettings

log = logging.getLogger("tokenq.producer")

T = TypeVar("T")

DEFAULT_MAX_CONNECTIONS = 16
"""Pooled connections per AsyncClient; callers beyond it wait for a free one."""

_LISTEN_FOREVER_S = float("inf")

_CANCEL_GRACE_S = 0.02
_WAKE = b"tokenq:wake"
"""Pushed on the client's own reply key by aclose; never a msgpack reply."""
_WAKE_TTL_MS = 1000
_WAKE_WAIT_S = 1.0
"""How long aclose tries to push the wake marker (Redis may be frozen)."""

_BACKSTOP_S = 0.05
"""A command's own (deadline-bound) socket timeout normally ends it; this much later
the caller stops waiting for it regardless."""


def _now_ms() -> int:
    return int(time.time() * 1000)


def _backoff(failures: int) -> float:
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**failures)


def _forget(task: asyncio.Future[Any]) -> None:
    """Cancel a task nobody waits for any more; its outcome is retrieved, never logged."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


class DeadlineRetry(Retry):
    """redis-py's asyncio ``Retry``, which never retries or backs off past the caller's deadline."""

    async def call_with_retry(  # type: ignore[override]
        self,
        do: Callable[[], Awaitable[T]],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        self._backoff.reset()
        failures = 0
        while True:
            try:
                return await do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    await fail(error, failures)
                else:
                    await fail(error)
                if 0 <= self._retries < failures:
                    raise error
                pause = retry_pause(self._backoff.compute(failures))
                if pause is None:
                    raise error
                if pause > 0:
                    await asyncio.sleep(pause)


class _Pool(DeadlinePoolWait, redis.asyncio.BlockingConnectionPool):
    """The command pool: connections and waits for one bounded by the caller's deadline."""

    def __init__(
        self, connection_class: type = redis.asyncio.Connection, **kwargs: Any
    ) -> None:
        super().__init__(connection_class=deadline_bound(connection_class), **kwargs)


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
        self.client_id = self._core.new_id()
        self._reply_key = self._core.reply_key(self.client_id)
        s = self.settings
        connection_kwargs = self._core.connection_options(DeadlineRetry, self.client_id)
        pool = _Pool.from_url(
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
        self._config_task: asyncio.Task[dict[str, str]] | None = None
        self._loading: dict[str, asyncio.Future[TokenizerEstimator | str]] = {}

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
            await self._attempt(Deadline.after(_WAKE_WAIT_S), self._push_wake)
        except redis.RedisError as exc:  # down, or an ACL without RPUSH: closing must not fail
            log.debug("could not wake the reply listener (%s); it stops after its wait", exc)

    async def _push_wake(self) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.rpush(self._reply_key, _WAKE)
            pipe.pexpire(self._reply_key, _WAKE_TTL_MS)
            await pipe.execute()

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

    def _deadline(self, timeout_s: float | None = None, *, persist: bool = False) -> Deadline:
        """The deadline of a call that has no ``timeout_s`` of its own: ``settings.timeout_s``."""
        return Deadline.after(self._core.timeout(timeout_s), persist=persist)

    async def _attempt(
        self, deadline: Deadline, command: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any
    ) -> T:
        """One Redis command (with redis-py's retries) for a caller, bounded by its deadline.

        The command runs as a task that carries the deadline in its context
        (for the socket, pool and retry bounds); the caller waits for it
        until the deadline plus the grace, and past that cancels it and
        raises redis-py's TimeoutError, whether or not the cancel lands.
        """
        token = CALLER_DEADLINE.set(deadline.at)
        try:
            task = asyncio.ensure_future(command(*args, **kwargs))
        finally:
            CALLER_DEADLINE.reset(token)
        wait = max(0.0, deadline.remaining()) + DEADLINE_GRACE_S + _BACKSTOP_S
        try:
            done, _ = await asyncio.wait({task}, timeout=wait)
        except BaseException:  # the caller was cancelled: so is its command
            _forget(task)
            raise
        if not done:
            _forget(task)
            raise redis.TimeoutError("Redis did not answer before the caller's deadline")
        try:
            return task.result()
        except redis.ResponseError as exc:
            down = busy_as_down(exc)
            if down is None:
                raise
            raise down from exc

    async def _command(
        self, deadline: Deadline, command: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any
    ) -> T:
        """:meth:`_attempt`, tried again until the deadline when ``deadline.persist``."""
        failures = 0
        while True:
            try:
                return await self._attempt(deadline, command, *args, **kwargs)
            except REDIS_DOWN:
                failures += 1
                if not deadline.persist:
                    raise
                await asyncio.sleep(max(0.0, min(_backoff(failures), deadline.remaining())))
                if deadline.remaining() <= 0:
                    raise

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
        """Enqueue one text; its reply goes to its own key, for :meth:`result`.

        Returns or raises within ``settings.timeout_s`` (plus a fraction of a second).
        """
        deadline = self._deadline()
        await self._ensure_config(deadline)
        prepared = self._core.prepare(
            text,
            now_ms=_now_ms(),
            text_pair=text_pair,
            deadline_s=deadline_s,
            deadline_ms=deadline_ms,
            reply_to=reply_to,
            opts=opts,
        )
        await self._enqueue([prepared], deadline)
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
        deadline = self._deadline()
        await self._ensure_config(deadline)
        batch = self._core.prepare_many(
            texts,
            now_ms=_now_ms(),
            deadline_s=deadline_s,
            deadline_ms=deadline_ms,
            reply_to=reply_to,
            opts=opts,
        )
        await self._enqueue(batch, deadline)
        return [p.id for p in batch]

    async def _ensure_config(self, deadline: Deadline) -> None:
        """Re-read the queue's config hash if the cached copy is older than ``config_ttl_s``.

        The read is one shared task; each caller waits for it until its own
        deadline, then carries on with what the cache holds. Only the caller
        that started the read sees its failure (BrokerUnavailable); the
        cache stays stale, so the next call reads again.
        """
        if not self._core.config_cache.due(time.monotonic()):
            return
        loop = asyncio.get_running_loop()
        task = self._config_task
        leading = task is None or task.get_loop() is not loop
        if leading:
            task = loop.create_task(self._read_config(deadline, strict=False))
            task.add_done_callback(self._config_read_done)
            self._config_task = task
        assert task is not None
        done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline.remaining()))
        if leading and done and not task.cancelled():
            error = task.exception()
            if error is not None:
                raise error

    def _config_read_done(self, task: asyncio.Task[dict[str, str]]) -> None:
        if self._config_task is task:
            self._config_task = None
        if not task.cancelled():
            task.exception()  # retrieved: only its leader raises it

    async def _read_config(self, deadline: Deadline, *, strict: bool) -> dict[str, str]:
        """HGETALL the config hash into the cache (see :meth:`Client._read_config`)."""
        key = self._core.config_key
        with self._broker():
            try:
                raw = await self._command(deadline, self._redis.hgetall, key)
            except redis.ResponseError as exc:
                if strict:
                    raise
                self._core.config_unreadable(exc, time.monotonic())
                return {}
        path = self._core.take_config(raw, time.monotonic())
        if path is not None:
            await self._load_tokenizer(path, deadline)
        return self._core.decode_config(raw)

    async def _load_tokenizer(self, path: str, deadline: Deadline) -> None:
        """Load ``path`` in a worker thread, once; wait for it until the deadline."""
        loading = self._loading.get(path)
        if loading is None or loading.get_loop() is not asyncio.get_running_loop():
            loading = asyncio.ensure_future(asyncio.to_thread(load_estimator, path))
            loading.add_done_callback(functools.partial(self._tokenizer_loaded, path))
            self._loading[path] = loading
        await asyncio.wait({loading}, timeout=max(0.0, deadline.remaining()))

    def _tokenizer_loaded(self, path: str, loading: asyncio.Future[Any]) -> None:
        if self._loading.get(path) is loading:
            del self._loading[path]
        if loading.cancelled():
            return
        error = loading.exception()
        loaded = loading.result() if error is None else f"cannot load {path}: {error}"
        self._core.config_cache.take_tokenizer(path, loaded)

    async def _enqueue(self, batch: Sequence[Prepared], deadline: Deadline) -> None:
        if not batch:
            return
        keys = self._core.script_keys(batch)
        args = self._core.script_args(batch)
        with self._broker():
            try:
                # With ``persist`` a lost reply is retried with the same ids and
                # seen keys, which the script answers without adding anything.
                await self._command(deadline, self._enqueue_script, keys=keys, args=args)
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
        started = time.monotonic()
        deadline = Deadline(started + self._core.timeout(timeout_s))
        wanted = self._core.reply_keys(request_ids)
        outcomes: dict[str, Outcome | Exception] = {}
        unreachable: BaseException | None = None
        failures = 0
        while wanted:
            remaining = deadline.remaining()
            if remaining <= 0:
                break
            block = self._core.block_s(remaining)
            try:
                popped = await self._attempt(
                    deadline, self._redis.blpop, list(wanted), timeout=block
                )
            except REDIS_DOWN as exc:
                unreachable, failures = exc, failures + 1
                await asyncio.sleep(max(0.0, min(_backoff(failures), deadline.remaining())))
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

        Bounded by ``timeout_s`` and, unless a deadline is given, carrying
        what is left of it as the request's deadline (see
        :meth:`tokenq.producer.Client.infer`).
        """
        started = time.monotonic()
        deadline = self._infer_deadline(started, timeout_s)
        await self._ensure_config(deadline)
        common = self._infer_fields(deadline, deadline_s, deadline_ms, opts)
        prepared = self._core.prepare(text, text_pair=text_pair, **common)
        results: list[Result] = await self._run([prepared], deadline, started, False)
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
        deadline = self._infer_deadline(started, timeout_s)
        await self._ensure_config(deadline)
        common = self._infer_fields(deadline, deadline_s, deadline_ms, opts)
        batch = self._core.prepare_many(texts, **common)
        return await self._run(batch, deadline, started, return_exceptions)

    def _infer_deadline(self, started: float, timeout_s: float | None) -> Deadline:
        if self._closing:
            raise TokenqError("the AsyncClient is closed")
        return Deadline(started + self._core.timeout(timeout_s), persist=True)

    def _infer_fields(
        self,
        deadline: Deadline,
        deadline_s: float | None,
        deadline_ms: int | None,
        opts: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """What every request of an infer call shares: the client's reply key and deadline."""
        deadline_s, deadline_ms = self._core.infer_deadline(
            deadline.remaining(), deadline_s, deadline_ms
        )
        return {
            "now_ms": _now_ms(),
            "deadline_s": deadline_s,
            "deadline_ms": deadline_ms,
            "reply_to": self._reply_key,
            "opts": opts,
        }

    async def _run(
        self, batch: list[Prepared], deadline: Deadline, started: float, return_exceptions: bool
    ) -> list[Any]:
        """Enqueue ``batch`` and wait until the listener resolved every future, or the deadline."""
        ids = [p.id for p in batch]
        loop = asyncio.get_running_loop()
        futures = {i: loop.create_future() for i in ids}
        self._waiters.update(futures)  # before enqueueing: a reply may beat the XADD's answer
        try:
            self._ensure_listener()
            await self._enqueue(batch, deadline)
            remaining = deadline.remaining()
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
            raws: list[bytes] = []  # what was popped is delivered even if the LPOP fails
            failed = True
            try:
                popped = await self._listen_redis.blpop(
                    [self._reply_key], timeout=self._core.block_s(_LISTEN_FOREVER_S)
                )
                if popped is not None:
                    raws.append(popped[1])
                    count = max(1, len(self._waiters))
                    raws += await self._listen_redis.lpop(self._reply_key, count) or []
                failed = False
            except REDIS_DOWN as exc:
                self._unreachable = exc
            except redis.ResponseError as exc:
                down = busy_as_down(exc)
                if down is None:
                    log.exception("tokenq reply listener failed; retrying")
                else:
                    self._unreachable = down
            except Exception:  # never let one odd error strand every waiter
                log.exception("tokenq reply listener failed; retrying")
            for raw in raws:
                if raw != _WAKE:
                    self._deliver(raw)
            if failed:
                failures += 1
                await asyncio.sleep(_backoff(failures))
            else:
                self._unreachable, failures = None, 0

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
            return int(await self._command(self._deadline(), self._redis.xlen,
                                           self._core.stream_key))

    async def config(self) -> dict[str, str]:
        """The queue's config hash; refreshes the cached copy (see ``Client.config``)."""
        return await self._read_config(self._deadline(), strict=True)
