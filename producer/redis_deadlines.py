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

The URL (:mod:`tokenq.shared.redis_url`) picks the client: a single server
(``redis://``, ``rediss://``, ``unix://``), a ``RedisCluster``
(``redis+cluster://``) or a Sentinel-watched master (``redis+sentinel://``),
all built by :mod:`tokenq.shared.redis_client`; this module only hands it the
hooks (:data:`SYNC_HOOKS`, :data:`ASYNC_HOOKS`), which sit in all three: in a
cluster the node pools are built from the bounded classes, and the cluster's
own retry loop (which re-reads the topology instead of backing off) stops at
the deadline (:class:`ClusterDeadlineRetry`); behind Sentinel the managed
connections are bounded and so are the sentinels' own.

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
from tokenq.shared import redis_client, redis_refusal
from tokenq.shared.packing import packing_mixin
from tokenq.shared.redis_client import ClientHooks, with_mixins
from tokenq.shared.redis_client import LazyCluster as LazyCluster  # the sync cluster's stand-in
from tokenq.shared.redis_url import parse_redis_url
from tokenq.shared.settings import ClientSettings

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
"""redis-py's errors for a Redis that did not answer (retried, then BrokerUnavailable)."""

CLUSTER_UNAVAILABLE = (
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
)
"""A cluster that could not run the command (mid-failover, a slot moving): as safe to retry."""

REFUSED_NOW_RETRIED = {
    "BUSY": "Redis is busy running a script",
    "READONLY": "Redis is a read-only replica (a failover may be under way)",
    "MASTERDOWN": "Redis is a replica that lost its master",
}
"""Error replies for a command Redis did not run because of its own state, not the
command's (:mod:`tokenq.shared.redis_refusal`): retried within the call's deadline, then
``BrokerUnavailable`` naming the reason, like a refused connection."""

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


SLOW_REPLY_S: contextvars.ContextVar[float] = contextvars.ContextVar(
    "tokenq_slow_reply_s", default=0.0
)
"""How long Redis itself may take to answer the command being run, beyond the socket timeout.

Set by :class:`slow_reply` around a command that waits on the server by design
(the durable enqueue's ``WAIT``); 0 otherwise. The socket timeout is then this
plus ``socket_timeout_s`` (still ended by the caller's deadline plus the grace),
so a ``durable_timeout_ms`` longer than ``socket_timeout_s`` is waited for, not
reported as Redis being unreachable.
"""


class slow_reply:
    """Run the block's commands with ``seconds`` of server-side waiting allowed on top of
    the socket timeout (see :data:`SLOW_REPLY_S`)."""

    __slots__ = ("_seconds", "_token")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def __enter__(self) -> None:
        self._token = SLOW_REPLY_S.set(self._seconds)

    def __exit__(self, *exc_info: object) -> None:
        SLOW_REPLY_S.reset(self._token)


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

    A ``BUSY``, ``READONLY`` or ``MASTERDOWN`` error reply counts as Redis
    being down (:data:`REFUSED_NOW_RETRIED`): Redis answers it before running
    the command (a script past ``busy-reply-threshold``; a write sent to a
    replica, as after a failover behind a DNS name), so the command was not
    run and is as safe to retry as a refused connection.
    So do a cluster's ``CLUSTERDOWN`` and ``TRYAGAIN`` (:data:`CLUSTER_UNAVAILABLE`).
    """
    if isinstance(exc, REDIS_DOWN):
        return Unreachable(exc)
    if isinstance(exc, CLUSTER_UNAVAILABLE) or (
        isinstance(exc, redis.RedisClusterException) and isinstance(exc.__cause__, REDIS_DOWN)
    ):  # the second: no startup node of a cluster answered
        down = redis.ConnectionError(f"Redis Cluster could not serve the command: {exc}")
        down.__cause__ = exc
        return Unreachable(down)
    if redis_refusal.is_out_of_memory(exc):
        return OutOfMemory(exc)
    if not isinstance(exc, redis.ResponseError):
        return exc
    code = redis_refusal.error_code(exc)
    if code not in REFUSED_NOW_RETRIED:
        return ErrorReply(exc)
    down = redis.ConnectionError(f"{REFUSED_NOW_RETRIED[code]}: {exc}")
    down.__cause__ = exc
    return Unreachable(down)


# ------------------------------------------------------------------ timeouts


def bounded_timeout(configured: float | None, *, reads: bool = False) -> float | None:
    """A socket (or pool) timeout cut down to the current caller's deadline plus the grace.

    ``reads``: the timeout of waiting for a reply, which :class:`slow_reply` lengthens.
    """
    slow = SLOW_REPLY_S.get() if reads else 0.0
    if slow and configured is not None:
        configured += slow
    deadline = CALLER_DEADLINE.get()
    if deadline is None:
        return configured
    left = max(0.0, deadline - time.monotonic()) + DEADLINE_GRACE_S
    if configured is not None:
        left = min(configured, left)
    return max(MIN_SOCKET_TIMEOUT_S, left)


class _Bounded:
    """A timeout attribute that reads as :func:`bounded_timeout` of the value kept in ``slot``."""

    def __init__(self, slot: str, *, reads: bool = False) -> None:
        self._slot = slot
        self._reads = reads

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return bounded_timeout(getattr(obj, self._slot, None), reads=self._reads)

    def __set__(self, obj: object, value: float | None) -> None:
        setattr(obj, self._slot, value)


class DeadlineTimeouts:
    """Mixin for a redis-py connection class: socket waits end at the caller's deadline.

    redis-py reads ``socket_timeout`` and ``socket_connect_timeout`` when it
    connects, runs the handshake and (asyncio) reads each reply. The
    configured values stay where redis-py keeps them (its sync connection
    writes ``_socket_timeout`` itself, past the property).
    """

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
    """``connection_class`` (plain, TLS or Unix socket) with ``mixin`` in front; made once.

    It also packs commands in C (:class:`~tokenq.shared.packing.HiredisPacking`):
    an enqueue carries a dozen arguments per request, which redis-py's own
    packer walks in Python.
    """
    if issubclass(connection_class, mixin):
        return connection_class
    return with_mixins(
        connection_class,  # type: ignore[arg-type]  # a class is hashable
        mixin, packing_mixin(connection_class))


def _sync_bound(connection_class: type) -> type:
    return deadline_bound(connection_class, _BoundedSockets)


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


class _RetriesLeft(int):
    """A retry count that reads as none left (``> 0`` is False) once the caller's deadline passed.

    redis-py's cluster client takes ``retry.get_retries()`` once and counts
    it down itself (``while``/``for`` loops around ``if left > 0: left -= 1``,
    re-reading the topology between tries instead of backing off), so a
    plain number would let it retry past the deadline.
    """

    def __gt__(self, other: object) -> bool:
        deadline = CALLER_DEADLINE.get()
        if deadline is not None and deadline <= time.monotonic():
            return False
        return int(self) > other  # type: ignore[operator]

    def __sub__(self, other: object) -> _RetriesLeft:
        return _RetriesLeft(int(self) - other)  # type: ignore[operator]


class _ClusterRetries:
    """Mixin for the cluster clients' retry: what it hands out to count down is a _RetriesLeft."""

    def get_retries(self) -> int:
        return _RetriesLeft(self._retries)  # type: ignore[attr-defined]


class ClusterDeadlineRetry(_ClusterRetries, DeadlineRetry):
    """The sync ``RedisCluster``'s retry: none starts after the caller's deadline."""


class AsyncClusterDeadlineRetry(_ClusterRetries, AsyncDeadlineRetry):
    """The asyncio ``RedisCluster``'s retry: none starts after the caller's deadline."""


def _retry(settings: ClientSettings, retry_class: type) -> Any:
    """Retries with a deadline-bound backoff, of ``retry_class`` (sync, asyncio, cluster)."""
    return retry_class(
        DeadlineBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
        settings.retries,
        supported_errors=REDIS_DOWN,
    )


def _options(settings: ClientSettings, retry_class: type, client_id: str) -> dict[str, Any]:
    """Socket timeouts, retries with backoff and a client name, for either client."""
    return {
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": settings.socket_timeout_s,
        "retry": _retry(settings, retry_class),
        "retry_on_error": list(REDIS_DOWN),  # redis-py 5 ignores `retry` without it
        "client_name": f"tokenq-producer-{client_id[:12]}",
    }


# ------------------------------------------------------------------- clients


SYNC_HOOKS = ClientHooks(connection=_sync_bound, sentinels=_sync_bound, pool_wait=DeadlinePoolWait)
"""What the sync client plugs into the factory: deadline-bound connections (which re-arm a
pooled socket's timeout before each command, the sentinels' too) and pool waits."""

ASYNC_HOOKS = ClientHooks(connection=deadline_bound, sentinels=deadline_bound,
                          pool_wait=DeadlinePoolWait)
"""The same for the asyncio clients."""


def sync_redis(
    settings: ClientSettings, client_id: str, max_connections: int | None
) -> redis.Redis | redis.RedisCluster:
    """The sync client's Redis: a pooled socket per thread, or at most ``max_connections``.

    In a cluster the cap is per node, and the ``RedisCluster`` is made at the
    first command (:class:`LazyCluster`), as every other client connects.
    """
    return redis_client.sync_client(
        parse_redis_url(settings.redis_url), _options(settings, DeadlineRetry, client_id),
        SYNC_HOOKS, max_connections=max_connections, wait_s=settings.timeout_s,
        cluster_retry=_retry(settings, ClusterDeadlineRetry), lazy=True,
    )


def async_redis(
    settings: ClientSettings, client_id: str, max_connections: int
) -> tuple[redis.asyncio.Redis | redis.asyncio.RedisCluster,
           redis.asyncio.Redis | redis.asyncio.RedisCluster]:
    """The async client's command pool, and its listener's connection of its own.

    In a cluster both are ``RedisCluster`` clients, the command one with
    ``max_connections`` per node (redis-py's cluster fails a command at once
    with ``MaxConnectionsError`` when a node has none free, where the single
    and Sentinel pools wait for one until the deadline), the listener's with
    one connection per node. Behind Sentinel both are master clients, each of
    its own Sentinel, the listener's with a pool of one.
    """
    command = _async_client(settings, client_id, max_connections=max_connections,
                            wait_s=settings.timeout_s)
    return command, async_listener(settings, client_id)


def async_listener(
    settings: ClientSettings, client_id: str
) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """A listener's client of one connection (per node, in a cluster), for one reply key.

    A sharded queue's replies land in each shard's slot, so an
    ``AsyncClient`` makes one of these per shard it listens on.
    """
    return _async_client(settings, client_id, one_connection=True)


def _async_client(
    settings: ClientSettings, client_id: str, *, max_connections: int | None = None,
    wait_s: float | None = None, one_connection: bool = False,
) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """A pool of ``max_connections`` (per node, in a cluster), waiting at most ``wait_s`` for a
    free one (and never past a caller's deadline; a cluster does not wait); or a client of
    ``one_connection``."""
    return redis_client.async_client(
        parse_redis_url(settings.redis_url), _options(settings, AsyncDeadlineRetry, client_id),
        ASYNC_HOOKS, max_connections=max_connections, wait_s=wait_s,
        one_connection=one_connection,
        cluster_retry=_retry(settings, AsyncClusterDeadlineRetry),
    )


def sync_client_for(url: str, **kwargs: Any) -> redis.Redis | redis.RedisCluster:
    """A plain sync client for ``url`` of any kind, with redis-py's client ``kwargs``.

    For the operator commands (``tokenq stats``, ``top``, ``dlq``), which want
    short timeouts and no caller deadlines. A single-server URL is built as
    ``redis.Redis.from_url(url, **kwargs)`` builds it; a malformed URL is a ValueError.
    """
    return redis_client.sync_client(parse_redis_url(url), kwargs)
