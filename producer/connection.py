"""How the producer plugs into redis-py: no wait redis-py makes outlasts the caller.

Every place tokenq hooks into redis-py lives here, for both clients. A
client runs each command for a caller inside :func:`for_caller`, which puts
the caller's ``time.monotonic()`` deadline in :data:`CALLER_DEADLINE` (per
thread for ``Client``, per task for ``AsyncClient``). The hooks below read
it:

* connection classes (:class:`DeadlineTimeouts`): every socket wait, the
  connect and the handshake included, ends by the deadline plus
  ``DEADLINE_GRACE_S``; the sync connection also re-arms a pooled socket's
  timeout before each command, since a socket keeps the last one set;
* pools (:class:`DeadlinePoolWait`): waiting for a free connection ends by
  then too;
* retries (:class:`DeadlineRetry`, :class:`AsyncDeadlineRetry`): no retry
  starts after the deadline and no backoff sleeps past it.

A connection cut off that way is disconnected by redis-py, never reused
mid-reply. Outside a caller's command (``CALLER_DEADLINE`` None) the
configured timeouts apply unchanged. :func:`failure` names redis-py's
exceptions the way the calls (:mod:`tokenq.producer.calls`) handle them.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from tokenq.producer.calls import ErrorReply, OutOfMemory, Unreachable
from tokenq.producer.core import BACKOFF_BASE_S, BACKOFF_CAP_S, DEADLINE_GRACE_S
from tokenq.shared.settings import ClientSettings

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
"""redis-py's errors for a Redis that did not answer (retried, then BrokerUnavailable)."""

MIN_SOCKET_TIMEOUT_S = 0.01
"""Floor of a deadline-bound socket timeout (0 would put the socket in non-blocking mode)."""

CALLER_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "tokenq_caller_deadline", default=None
)
"""The ``time.monotonic()`` deadline of the caller on whose behalf Redis is being called.

Set by :func:`for_caller` around each command (in the calling thread, or in
the task that runs one command for an async caller) and read by the hooks
below; None outside a caller's command.
"""


class for_caller:
    """Run what the block starts (a command, or a task it creates) under ``deadline``.

    A class rather than ``@contextmanager``: it wraps every command a client
    sends, and a generator-based context manager costs a microsecond more.
    """

    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def __enter__(self) -> None:
        self._token = CALLER_DEADLINE.set(self._deadline)

    def __exit__(self, *exc_info: object) -> None:
        CALLER_DEADLINE.reset(self._token)


def failure(exc: Exception) -> Exception:
    """What to throw into a call for ``exc``: the calls' name for a command failure, else ``exc``.

    A ``BUSY`` error reply counts as Redis being down: Redis answers it to
    every command while a script has run past ``busy-reply-threshold``, so
    the command was not run and is as safe to retry as a refused connection.
    """
    if isinstance(exc, REDIS_DOWN):
        return Unreachable(exc)
    if isinstance(exc, redis.OutOfMemoryError):
        return OutOfMemory(exc)
    if not isinstance(exc, redis.ResponseError):
        return exc
    if not str(exc).startswith("BUSY"):
        return ErrorReply(exc)
    down = redis.ConnectionError(f"Redis is busy running a script: {exc}")
    down.__cause__ = exc
    return Unreachable(down)


# ------------------------------------------------------------------ timeouts


def bounded_timeout(configured: float | None) -> float | None:
    """A socket (or pool) timeout cut down to the current caller's deadline plus the grace."""
    deadline = CALLER_DEADLINE.get()
    if deadline is None:
        return configured
    left = max(0.0, deadline - time.monotonic()) + DEADLINE_GRACE_S
    if configured is not None:
        left = min(configured, left)
    return max(MIN_SOCKET_TIMEOUT_S, left)


class _Bounded:
    """A timeout attribute that reads as :func:`bounded_timeout` of the value kept in ``slot``."""

    def __init__(self, slot: str) -> None:
        self._slot = slot

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return bounded_timeout(getattr(obj, self._slot, None))

    def __set__(self, obj: object, value: float | None) -> None:
        setattr(obj, self._slot, value)


class DeadlineTimeouts:
    """Mixin for a redis-py connection class: socket waits end at the caller's deadline.

    redis-py reads ``socket_timeout`` and ``socket_connect_timeout`` when it
    connects, runs the handshake and (asyncio) reads each reply. The
    configured values stay where redis-py keeps them (its sync connection
    writes ``_socket_timeout`` itself, past the property).
    """

    socket_timeout = _Bounded("_socket_timeout")
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


_BOUNDED_CLASSES: dict[tuple[type, type], type] = {}


def deadline_bound(connection_class: type, mixin: type = DeadlineTimeouts) -> type:
    """``connection_class`` (plain, TLS or Unix socket) with ``mixin`` in front; made once."""
    if issubclass(connection_class, mixin):
        return connection_class
    key = (connection_class, mixin)
    made = _BOUNDED_CLASSES.get(key)
    if made is None:
        made = type(f"Bounded{connection_class.__name__}", (mixin, connection_class), {})
        _BOUNDED_CLASSES[key] = made
    return made


# ------------------------------------------------------------------- retries


class DeadlineBackoff(ExponentialBackoff):
    """redis-py's exponential backoff, never sleeping past the caller's deadline."""

    def compute(self, failures: int) -> float:
        backoff = super().compute(failures)
        deadline = CALLER_DEADLINE.get()
        if deadline is None:
            return backoff
        return max(0.0, min(backoff, deadline - time.monotonic()))


class DeadlineRetries:
    """Mixin for redis-py's ``Retry`` (sync or asyncio): no retry starts after the deadline.

    After each failure ``call_with_retry`` compares the count with
    ``_retries`` and sleeps what its backoff (a :class:`DeadlineBackoff`)
    computes; past the caller's deadline ``_retries`` reads as 0, so the
    failure is raised instead. One class serves both twins because neither
    ``call_with_retry`` has to be rewritten.
    """

    @property
    def _retries(self) -> int:
        deadline = CALLER_DEADLINE.get()
        if deadline is not None and deadline <= time.monotonic():
            return 0
        return self._tokenq_retries

    @_retries.setter
    def _retries(self, value: int) -> None:
        self._tokenq_retries = value


class DeadlineRetry(DeadlineRetries, Retry):
    """redis-py's ``Retry``, bounded by the caller's deadline."""


class AsyncDeadlineRetry(DeadlineRetries, AsyncRetry):
    """redis-py's asyncio ``Retry``, bounded by the caller's deadline."""


def _options(settings: ClientSettings, retry_class: type, client_id: str) -> dict[str, Any]:
    """Socket timeouts, retries with backoff and a client name, for either client."""
    return {
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": settings.socket_timeout_s,
        "retry": retry_class(
            DeadlineBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
            settings.retries,
            supported_errors=REDIS_DOWN,
        ),
        "retry_on_error": list(REDIS_DOWN),  # redis-py 5 ignores `retry` without it
        "client_name": f"tokenq-producer-{client_id[:12]}",
    }


# --------------------------------------------------------------------- pools


class _Pool(redis.ConnectionPool):
    """A connection pool whose connections wait no longer than their caller."""

    def __init__(self, connection_class: type = redis.Connection, **kwargs: Any) -> None:
        super().__init__(connection_class=deadline_bound(connection_class, _BoundedSockets),
                         **kwargs)


class _BlockingPool(DeadlinePoolWait, redis.BlockingConnectionPool):
    """The same, capped at ``max_connections``; waits for a free one end by the deadline."""

    def __init__(self, connection_class: type = redis.Connection, **kwargs: Any) -> None:
        super().__init__(connection_class=deadline_bound(connection_class, _BoundedSockets),
                         **kwargs)


class _AsyncPool(DeadlinePoolWait, redis.asyncio.BlockingConnectionPool):
    """The async command pool: connections and waits for one bounded by the caller's deadline."""

    def __init__(
        self, connection_class: type = redis.asyncio.Connection, **kwargs: Any
    ) -> None:
        super().__init__(connection_class=deadline_bound(connection_class), **kwargs)


def sync_redis(
    settings: ClientSettings, client_id: str, max_connections: int | None
) -> redis.Redis:
    """The sync client's Redis: a pooled socket per thread, or at most ``max_connections``."""
    options = _options(settings, DeadlineRetry, client_id)
    if max_connections is None:
        pool: redis.ConnectionPool = _Pool.from_url(settings.redis_url, **options)
    else:
        pool = _BlockingPool.from_url(
            settings.redis_url,
            max_connections=max_connections,
            timeout=settings.timeout_s,
            **options,
        )
    return redis.Redis.from_pool(pool)


def async_redis(
    settings: ClientSettings, client_id: str, max_connections: int
) -> tuple[redis.asyncio.Redis, redis.asyncio.Redis]:
    """The async client's command pool, and its listener's connection of its own."""
    options = _options(settings, AsyncDeadlineRetry, client_id)
    pool = _AsyncPool.from_url(
        settings.redis_url, max_connections=max_connections, timeout=settings.timeout_s, **options
    )
    listener = redis.asyncio.Redis.from_url(
        settings.redis_url, single_connection_client=True, **options
    )
    return redis.asyncio.Redis.from_pool(pool), listener
