"""The asyncio producer client, driver of :mod:`tokenq.producer.calls`: one listener task per
reply key resolves every caller's future, so waiting callers hold no connection each."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import redis

from tokenq.producer import calls, nodes, redis_deadlines
from tokenq.producer.core import ClientCore, ProducerBase
from tokenq.producer.deadline import DEADLINE_GRACE_S, Deadline, backoff_s, block_s
from tokenq.producer.lanes import Lane
from tokenq.producer.replies import Outcome, decode, outcome
from tokenq.shared import functions
from tokenq.shared.errors import TokenqError
from tokenq.shared.failures import error_text

log = logging.getLogger("tokenq.producer")

T = TypeVar("T")
P = ParamSpec("P")

DEFAULT_MAX_CONNECTIONS = 16
"""Pooled connections per AsyncClient; callers beyond it wait for a free one."""

_CANCEL_GRACE_S = 0.02
_WAKE = b"tokenq:wake"
"""Pushed on a reply key by aclose to end its listener's wait; never a msgpack reply."""
_WAKE_TTL_MS = 1000
_WAKE_WAIT_S = 1.0
"""How long aclose tries to push the wake marker (Redis may be frozen)."""
_BACKSTOP_S = 0.05
"""How long after its deadline-bound socket timeout the caller stops waiting for a command."""


def awaiting(
    call: Callable[Concatenate[ClientCore, P], calls.Call[T]],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """The method of :class:`AsyncClient` that performs ``call`` on the event loop."""

    async def method(self: AsyncClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(call(self._core, *args, **kwargs))

    functools.update_wrapper(method, call)
    return method


def _forget(task: asyncio.Future[Any]) -> None:
    """Cancel a task nobody waits for any more; its outcome is retrieved, never logged."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


class AsyncClient(ProducerBase):
    """An asyncio producer for one queue, used from one event loop; the arguments and calls of
    :class:`tokenq.producer.Client`. ``max_connections`` bounds the command pool (default
    :data:`DEFAULT_MAX_CONNECTIONS`; each listener has a connection of its own)."""

    def _connect(self, max_connections: int | None) -> None:
        self._closing = False
        self._reply_key = self._listen_key(self._core.lanes.home)
        self._core.listener = self._listen_key
        pool = DEFAULT_MAX_CONNECTIONS if max_connections is None else max_connections
        self._redis, listen = redis_deadlines.async_redis(self.settings, self.client_id, pool)
        # One listener per reply key: each shard's replies land in its own slot.
        self._listen_clients: dict[str, Any] = {self._reply_key: listen}
        self._listeners: dict[str, asyncio.Task[None]] = {}
        self._trimming: set[str] = set()  # keys whose listener trims what it delivered
        self._node_clients: dict[str, Any] = {}  # Cluster nodes' plain clients (durable)
        self._scripts = {name: functions.AsyncFunction(self._redis, name) for name in calls.SCRIPTS}
        self._waiters: dict[str, asyncio.Future[Outcome]] = {}
        self._unreachable: BaseException | None = None
        self._config_task: asyncio.Task[dict[str, str]] | None = None

    async def aclose(self) -> None:
        """Stop the listener, fail whoever still waits, close every connection."""
        self._closing = True
        listeners, self._listeners = self._listeners, {}
        for key, listener in listeners.items():
            await self._stop_listener(key, listener)
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(TokenqError("the AsyncClient was closed while waiting"))
        for client in (*self._listen_clients.values(), *self._node_clients.values()):
            await client.aclose()
        await self._redis.aclose()

    async def _stop_listener(self, key: str, listener: asyncio.Task[None]) -> None:
        """End a listener, letting one between delivering replies and their ``LTRIM`` finish."""
        if listener.done():
            return
        if key in self._trimming:
            done, _ = await asyncio.wait({listener}, timeout=self.settings.socket_timeout_s)
            if done:
                return
        listener.cancel()
        done, _ = await asyncio.wait({listener}, timeout=_CANCEL_GRACE_S)
        if done:
            return
        # redis-py can swallow a cancel while sending: the BLMOVE runs on. A marker pushed on
        # the key ends it at once (and expires unread if unneeded).
        try:
            await self._attempt(time.monotonic() + _WAKE_WAIT_S, self._push_wake, key)
        except redis.RedisError as exc:  # down, or an ACL without RPUSH: closing must not fail
            log.debug("reply listener not woken (%s); it stops after its wait", error_text(exc))
        await asyncio.wait({listener}, timeout=self.settings.socket_timeout_s)

    async def _push_wake(self, key: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.rpush(key, _WAKE)
            pipe.pexpire(key, _WAKE_TTL_MS)
            await pipe.execute()

    def _listen_key(self, lane: Lane) -> str:
        """The reply key this client listens to for requests written to ``lane``."""
        if self._closing:
            raise TokenqError("the AsyncClient is closed")
        return lane.reply_key(self.client_id)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    submit = awaiting(calls.submit)
    submit_many = awaiting(calls.submit_many)
    result = awaiting(calls.result)
    results = awaiting(calls.results)
    forget = awaiting(calls.forget)
    command = awaiting(calls.command)
    infer = awaiting(calls.infer)
    infer_many = awaiting(calls.infer_many)
    workers_alive = awaiting(calls.workers_alive)
    queue_length = awaiting(calls.queue_length)
    pending_tokens = awaiting(calls.pending_tokens)
    config = awaiting(calls.config)

    async def _run(self, call: calls.Call[T]) -> T:
        """Await ``call``'s steps until it returns; then forget the ids it listened for."""
        listening: list[str] = []
        try:
            step = calls.resume(call)
            while not isinstance(step, calls.Done):
                if isinstance(step, calls.Listen):
                    listening += step.ids
                step = calls.resume(call, await self._perform(step))
            return step.value
        finally:
            call.close()
            for request_id in listening:
                self._waiters.pop(request_id, None)

    async def _durable_enqueue(
        self, *, keys: list[str], args: list[Any], replicas: int, timeout_ms: int
    ) -> tuple[Any, int]:
        async def enqueue_and_wait(node: Any) -> tuple[Any, int]:
            async with node.pipeline(transaction=False) as pipe:
                await self._scripts[calls.ENQUEUE](keys=keys, args=args, client=pipe)
                pipe.execute_command("WAIT", replicas, timeout_ms)
                with redis_deadlines.slow_reply(timeout_ms / 1000):  # WAIT's own time
                    written, confirmed = await pipe.execute()
            return written, int(confirmed)

        enqueue = self._scripts[calls.ENQUEUE]  # on a node without tokenq's functions: load, again
        return await nodes.async_run_pinned(
            self._redis, keys[0],
            lambda node: enqueue.guarded(node, lambda: enqueue_and_wait(node)), self._node_clients)

    async def _perform(self, step: calls.Step) -> Any:
        """The step's answer, or its failure (thrown into the call)."""
        try:
            match step:
                case calls.Send(command, args, kwargs, deadline):
                    return await self._attempt(deadline, self._command(command), *args, **kwargs)
                case calls.Sleep(seconds):
                    await asyncio.sleep(seconds)
                case calls.ShareConfigRead(deadline):
                    await self._share_config_read(deadline)
                case calls.LoadTokenizer(path, deadline):
                    loading = asyncio.wrap_future(self._tokenizer_load(path))
                    await asyncio.wait({loading}, timeout=deadline.left())
                case calls.Listen(ids, key):
                    self._listen_for(ids, key)
                case calls.Collect(ids, deadline):
                    return await self._collect(ids, deadline)
        except Exception as exc:
            return redis_deadlines.failure(exc)
        return None

    async def _attempt(
        self, deadline: float, command: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any
    ) -> T:
        """One Redis command, as a task carrying the caller's deadline (for the socket, pool and
        retry bounds); cancelled past the deadline plus the grace: TimeoutError."""
        with redis_deadlines.for_caller(deadline):
            task = asyncio.ensure_future(command(*args, **kwargs))
        wait = max(0.0, deadline - time.monotonic()) + DEADLINE_GRACE_S + _BACKSTOP_S
        try:
            done, _ = await asyncio.wait({task}, timeout=wait)
        except BaseException:  # the caller was cancelled: so is its command
            _forget(task)
            raise
        if not done:
            _forget(task)
            raise redis.TimeoutError("Redis did not answer before the caller's deadline")
        return task.result()

    async def _share_config_read(self, deadline: Deadline) -> None:
        """Start the one config read as a task (cancelling its caller does not cancel it), or
        join it; wait until the deadline. Only the caller that started it sees its failure."""
        loop = asyncio.get_running_loop()
        task = self._config_task
        leading = task is None or task.get_loop() is not loop
        if leading:
            read = calls.read_config(self._core, deadline, strict=False)
            task = loop.create_task(self._run(read))
            task.add_done_callback(self._config_read_done)
            self._config_task = task
        assert task is not None
        done, _ = await asyncio.wait({task}, timeout=deadline.left())
        if leading and done and not task.cancelled():
            error = task.exception()
            if error is not None:
                raise error

    def _config_read_done(self, task: asyncio.Task[dict[str, str]]) -> None:
        if self._config_task is task:
            self._config_task = None
        if not task.cancelled():
            task.exception()  # retrieved: only its leader raises it

    def _listen_for(self, ids: Sequence[str], key: str) -> None:
        """Give each id a future the listener of ``key`` resolves; start that listener unless it
        is running (it stops when nobody waits)."""
        loop = asyncio.get_running_loop()
        self._waiters.update({request_id: loop.create_future() for request_id in ids})
        listener = self._listeners.get(key)
        if listener is None or listener.done():
            if key not in self._listen_clients:
                self._listen_clients[key] = redis_deadlines.async_client(
                    self.settings, self.client_id)
            self._listeners[key] = loop.create_task(
                self._listen(key), name=f"tokenq-listener-{self.client_id[:12]}")

    async def _collect(
        self, ids: Sequence[str], deadline: Deadline
    ) -> tuple[dict[str, Outcome | Exception], BaseException | None]:
        futures = {request_id: self._waiters[request_id] for request_id in ids}
        remaining = deadline.remaining()
        if futures and remaining > 0:
            await asyncio.wait(futures.values(), timeout=remaining)
        outcomes: dict[str, Outcome | Exception] = {
            # the listener sets Exceptions only (typeshed: any BaseException)
            request_id: future.exception() or future.result()  # type: ignore[misc]
            for request_id, future in futures.items()
            if future.done()
        }
        return outcomes, self._unreachable

    async def _listen(self, key: str) -> None:
        """Read a reply key while anyone waits, resolving futures by id, as :func:`~.calls.drain`
        does: LRANGE, deliver, only then LTRIM; ``BLMOVE key key`` waits."""
        failures = 0
        redis_ = self._listen_clients[key]
        while self._waiters and not self._closing:
            try:
                landed = await redis_.lrange(key, 0, -1)
                if not landed:
                    wait_s = block_s(float("inf"), self.settings.socket_timeout_s)
                    if await redis_.blmove(key, key, wait_s, "LEFT", "RIGHT") is not None:
                        landed = await redis_.lrange(key, 0, -1)
                for raw in landed:
                    if raw != _WAKE:
                        self._deliver(raw)
                if landed:  # a failed LTRIM reads them again: delivered ones are dropped
                    self._trimming.add(key)
                    try:
                        await redis_.ltrim(key, len(landed), -1)
                    finally:
                        self._trimming.discard(key)
                self._unreachable, failures = None, 0
            except Exception as exc:  # never let one odd error strand every waiter
                down = redis_deadlines.failure(exc)
                if isinstance(down, calls.Unreachable):
                    self._unreachable = down.error
                else:
                    log.exception("tokenq reply listener failed; retrying")
                failures += 1
                await asyncio.sleep(backoff_s(failures))

    def _deliver(self, raw: bytes) -> None:
        reply = decode(raw)
        if reply is None:
            return
        future = self._waiters.get(reply.id)
        if future is None or future.done():
            log.debug("dropping a reply for request %s: nobody waits for it", reply.id)
            return
        future.set_result(outcome(reply))
