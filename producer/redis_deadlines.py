"""The hooks that keep redis-py's socket waits, pool waits and retries within the caller's
deadline (:data:`CALLER_DEADLINE`, set by :func:`for_caller` around each command)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from tokenq.producer.calls import ErrorReply, OutOfMemory, Unreachable
from tokenq.producer.deadline import BACKOFF_BASE_S, BACKOFF_CAP_S, DEADLINE_GRACE_S
from tokenq.shared import redis_client, redis_refusal
from tokenq.shared.packing import packing_mixin
from tokenq.shared.redis_client import ClientHooks, with_mixins
from tokenq.shared.redis_client import LazyCluster as LazyCluster  # the sync cluster's stand-in
from tokenq.shared.redis_url import parse_redis_url
from tokenq.shared.settings import ClientSettings

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
"""A Redis that did not answer: retried, then BrokerUnavailable."""
CLUSTER_UNAVAILABLE = (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
                       redis.exceptions.SlotNotCoveredError)
"""A cluster that could not run the command (mid-failover, a slot moving): as safe to retry."""

REFUSED_NOW_RETRIED = {
    "BUSY": "Redis is busy running a script",
    "READONLY": "Redis is a read-only replica (a failover may be under way)",
    "MASTERDOWN": "Redis is a replica that lost its master",
    "MISCONF": "Redis refuses writes until it can save to disk",
    "NOREPLICAS": "Redis refuses writes while fewer replicas than min-replicas-to-write answer",
}
"""Error replies for a command Redis did not run because of its own state: retried like a
refused connection, then ``BrokerUnavailable`` naming the reason."""

MIN_SOCKET_TIMEOUT_S = 0.01
"""Floor of a deadline-bound socket timeout (0 would make the socket non-blocking)."""

CALLER_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "tokenq_caller_deadline", default=None)
"""The monotonic deadline of the caller on whose behalf Redis is called (None: no caller)."""
SLOW_REPLY_S: contextvars.ContextVar[float] = contextvars.ContextVar(
    "tokenq_slow_reply_s", default=0.0)
"""How long Redis itself may take to answer on top of the socket timeout: the durable
enqueue's ``WAIT``, which waits on the server by design."""


class _Setting:
    """Sets a context variable for the block (a class: ``@contextmanager`` costs a microsecond
    more on every command)."""

    __slots__ = ("_token", "_value", "_variable")

    def __init__(self, variable: contextvars.ContextVar[Any], value: float) -> None:
        self._variable = variable
        self._value = value

    def __enter__(self) -> None:
        self._token = self._variable.set(self._value)

    def __exit__(self, *exc_info: object) -> None:
        self._variable.reset(self._token)


slow_reply = functools.partial(_Setting, SLOW_REPLY_S)
"""``with slow_reply(seconds)``: the block's commands get that much :data:`SLOW_REPLY_S`."""
for_caller = functools.partial(_Setting, CALLER_DEADLINE)
"""``with for_caller(deadline)``: what the block starts (a command, a task) runs under it."""


def failure(exc: Exception) -> Exception:
    """What to throw into a call for ``exc``: :mod:`.calls`' name for a command failure, else
    ``exc``; a command Redis did not run (:data:`REFUSED_NOW_RETRIED`,
    :data:`CLUSTER_UNAVAILABLE`) counts as Redis being down."""
    if isinstance(exc, REDIS_DOWN):
        return Unreachable(exc)
    if isinstance(exc, CLUSTER_UNAVAILABLE) or (
        isinstance(exc, redis.RedisClusterException) and isinstance(exc.__cause__, REDIS_DOWN)
    ):  # the second: no startup node of a cluster answered
        why: str | None = "Redis Cluster could not serve the command"
    elif redis_refusal.is_out_of_memory(exc):
        return OutOfMemory(exc)
    elif not isinstance(exc, redis.ResponseError):
        return exc
    else:
        why = REFUSED_NOW_RETRIED.get(redis_refusal.error_code(exc))
        if why is None:
            return ErrorReply(exc)
    down = redis.ConnectionError(f"{why}: {exc}")
    down.__cause__ = exc
    return Unreachable(down)


class _Bounded:
    """A timeout attribute that reads as the value kept in ``slot`` cut to the caller's deadline
    plus the grace; ``reads``: a wait for a reply, which :data:`slow_reply` lengthens."""

    def __init__(self, slot: str, *, reads: bool = False) -> None:
        self._slot = slot
        self._reads = reads

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        configured: float | None = getattr(obj, self._slot, None)
        slow = SLOW_REPLY_S.get() if self._reads else 0.0
        if slow and configured is not None:
            configured += slow
        deadline = CALLER_DEADLINE.get()
        if deadline is None:
            return configured
        left = max(0.0, deadline - time.monotonic()) + DEADLINE_GRACE_S
        return max(MIN_SOCKET_TIMEOUT_S, left if configured is None else min(configured, left))

    def __set__(self, obj: object, value: float | None) -> None:
        setattr(obj, self._slot, value)


class DeadlineTimeouts:
    """Mixin for a redis-py connection class: socket waits (connect, handshake, replies) end
    at the caller's deadline."""

    socket_timeout = _Bounded("_socket_timeout", reads=True)
    socket_connect_timeout = _Bounded("_socket_connect_timeout")


class DeadlinePoolWait:
    """Mixin for a redis-py BlockingConnectionPool: waiting for a free connection ends in time."""

    timeout = _Bounded("_tokenq_wait_s")


class _BoundedSockets(DeadlineTimeouts):
    """Sets the socket's timeout before each command: a pooled socket keeps the last one."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):  # a dead socket: the send below reports it
                sock.settimeout(self.socket_timeout)
        super().send_packed_command(command, check_health)  # type: ignore[misc]


def deadline_bound(connection_class: type, mixin: type = DeadlineTimeouts) -> type:
    """``connection_class`` (plain, TLS or Unix socket) with ``mixin`` in front, packing
    commands in C; made once."""
    if issubclass(connection_class, mixin):
        return connection_class
    return with_mixins(
        connection_class,  # type: ignore[arg-type]  # a class is hashable
        mixin, packing_mixin(connection_class))


class DeadlineBackoff(ExponentialBackoff):
    """redis-py's exponential backoff, never sleeping past the caller's deadline."""

    def compute(self, failures: int) -> float:
        backoff = super().compute(failures)
        deadline = CALLER_DEADLINE.get()
        if deadline is None:
            return backoff
        return max(0.0, min(backoff, deadline - time.monotonic()))


def _past_deadline() -> bool:
    deadline = CALLER_DEADLINE.get()
    return deadline is not None and deadline <= time.monotonic()


class _RetriesLeft(int):
    """A retry count that reads as none left once the caller's deadline passed (redis-py's
    cluster client counts ``get_retries()`` down itself)."""

    def __gt__(self, other: object) -> bool:
        return not _past_deadline() and int(self) > other  # type: ignore[operator]

    def __sub__(self, other: object) -> _RetriesLeft:
        return _RetriesLeft(int(self) - other)  # type: ignore[operator]


class DeadlineRetries:
    """Mixin for redis-py's ``Retry``: past the caller's deadline no retry starts."""

    @property
    def _retries(self) -> int:
        return 0 if _past_deadline() else _RetriesLeft(self._tokenq_retries)

    @_retries.setter
    def _retries(self, value: int) -> None:
        self._tokenq_retries = value


class DeadlineRetry(DeadlineRetries, Retry):
    """redis-py's ``Retry``, bounded by the caller's deadline."""


class AsyncDeadlineRetry(DeadlineRetries, AsyncRetry):
    """redis-py's asyncio ``Retry``, bounded by the caller's deadline."""


def _retry(settings: ClientSettings, retry_class: type) -> Any:
    return retry_class(
        DeadlineBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
        settings.retries,
        supported_errors=REDIS_DOWN)


def _options(settings: ClientSettings, retry_class: type, client_id: str) -> dict[str, Any]:
    return {
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": settings.socket_timeout_s,
        "retry": _retry(settings, retry_class),
        "retry_on_error": list(REDIS_DOWN),  # redis-py 5 ignores `retry` without it
        "client_name": f"tokenq-producer-{client_id[:12]}",
    }


_sync_bound = functools.partial(deadline_bound, mixin=_BoundedSockets)
SYNC_HOOKS = ClientHooks(connection=_sync_bound, sentinels=_sync_bound, pool_wait=DeadlinePoolWait)
ASYNC_HOOKS = ClientHooks(connection=deadline_bound, sentinels=deadline_bound,
                          pool_wait=DeadlinePoolWait)


def sync_redis(
    settings: ClientSettings, client_id: str, max_connections: int | None
) -> redis.Redis | redis.RedisCluster:
    """The sync client's Redis: a pooled socket per thread, or at most ``max_connections``
    (per node of a cluster, made at the first command: :class:`LazyCluster`)."""
    return redis_client.sync_client(
        parse_redis_url(settings.redis_url), _options(settings, DeadlineRetry, client_id),
        SYNC_HOOKS, max_connections=max_connections, wait_s=settings.timeout_s,
        cluster_retry=_retry(settings, DeadlineRetry), lazy=True)


def async_redis(
    settings: ClientSettings, client_id: str, max_connections: int
) -> tuple[redis.asyncio.Redis | redis.asyncio.RedisCluster,
           redis.asyncio.Redis | redis.asyncio.RedisCluster]:
    """The async client's command pool and its listener's connection (:func:`async_client`)."""
    return async_client(settings, client_id, max_connections), async_client(settings, client_id)


def async_client(
    settings: ClientSettings, client_id: str, max_connections: int | None = None
) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """A pool of ``max_connections`` (per node of a cluster, where a command fails at once when
    a node has none free) waiting ``timeout_s`` at most for a free one; None: a listener's one
    connection (per node)."""
    one = max_connections is None
    return redis_client.async_client(
        parse_redis_url(settings.redis_url), _options(settings, AsyncDeadlineRetry, client_id),
        ASYNC_HOOKS, max_connections=max_connections, wait_s=None if one else settings.timeout_s,
        one_connection=one, cluster_retry=_retry(settings, AsyncDeadlineRetry))


def sync_client_for(url: str, **kwargs: Any) -> redis.Redis | redis.RedisCluster:
    """A plain sync client for ``url`` of any kind, for the operator commands (no caller
    deadlines); a malformed URL is a ValueError."""
    return redis_client.sync_client(parse_redis_url(url), kwargs)
