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
(``redis://``, ``rediss://``, ``unix://``: built exactly as before), a
``RedisCluster`` (``redis+cluster://``) or a Sentinel-watched master
(``redis+sentinel://``). The same hooks sit in all three: in a cluster the
node pools are built from the bounded pool classes, and the cluster's own
retry loop (which re-reads the topology instead of backing off) stops at the
deadline (:class:`ClusterDeadlineRetry`); behind Sentinel the managed
connections are bounded and so are the sentinels' own.

A connection cut off that way is disconnected by redis-py, never reused
mid-reply. Outside a caller's command (``CALLER_DEADLINE`` None) the
configured timeouts apply unchanged. :func:`failure` names redis-py's
exceptions the way the calls (:mod:`tokenq.producer.calls`) handle them.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from tokenq.producer.calls import ErrorReply, OutOfMemory, Unreachable
from tokenq.producer.core import BACKOFF_BASE_S, BACKOFF_CAP_S, DEADLINE_GRACE_S
from tokenq.shared import functions, redis_refusal
from tokenq.shared.packing import HiredisPacking
from tokenq.shared.redis_url import RedisTarget, parse_redis_url
from tokenq.shared.sentinel_connection import managed_connection
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


_BOUNDED_CLASSES: dict[tuple[type, type], type] = {}


def deadline_bound(connection_class: type, mixin: type = DeadlineTimeouts) -> type:
    """``connection_class`` (plain, TLS or Unix socket) with ``mixin`` in front; made once.

    It also packs commands in C (:class:`~tokenq.shared.packing.HiredisPacking`):
    an enqueue carries a dozen arguments per request, which redis-py's own
    packer walks in Python (issue 25).
    """
    if issubclass(connection_class, mixin):
        return connection_class
    key = (connection_class, mixin)
    made = _BOUNDED_CLASSES.get(key)
    if made is None:
        bases = (mixin, connection_class)
        if not issubclass(connection_class, HiredisPacking):
            bases = (mixin, HiredisPacking, connection_class)
        made = type(f"Bounded{connection_class.__name__}", bases, {})
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


class _SentinelPool(redis.sentinel.SentinelConnectionPool):
    """A Sentinel master's pool: its managed connections wait no longer than their caller."""

    def __init__(self, service_name: str, sentinel_manager: Any, **kwargs: Any) -> None:
        managed = managed_connection(tls=kwargs.pop("ssl", False), asyncio=False)
        kwargs["connection_class"] = deadline_bound(managed, _BoundedSockets)
        super().__init__(service_name, sentinel_manager, **kwargs)


class _BlockingSentinelPool(DeadlinePoolWait, _SentinelPool, redis.BlockingConnectionPool):
    """The same, capped at ``max_connections`` as :class:`_BlockingPool` is."""


class _AsyncSentinelPool(
    DeadlinePoolWait, redis.asyncio.sentinel.SentinelConnectionPool,
    redis.asyncio.BlockingConnectionPool,
):
    """The async command pool behind Sentinel, bounded as :class:`_AsyncPool` is."""

    def __init__(self, service_name: str, sentinel_manager: Any, **kwargs: Any) -> None:
        managed = managed_connection(tls=kwargs.pop("ssl", False), asyncio=True)
        kwargs["connection_class"] = deadline_bound(managed)
        super().__init__(service_name, sentinel_manager, **kwargs)


# ------------------------------------------------------------------- clients


def sync_redis(
    settings: ClientSettings, client_id: str, max_connections: int | None
) -> redis.Redis | redis.RedisCluster:
    """The sync client's Redis: a pooled socket per thread, or at most ``max_connections``.

    In a cluster the cap is per node, and the ``RedisCluster`` is made at the
    first command (:class:`LazyCluster`), as every other client connects.
    """
    target = parse_redis_url(settings.redis_url)
    if target.kind == "cluster":
        options = _options(settings, ClusterDeadlineRetry, client_id)
        return LazyCluster(  # type: ignore[return-value]  # it stands in for one
            lambda: _sync_cluster(target, options, max_connections, settings.timeout_s)
        )
    options = _options(settings, DeadlineRetry, client_id)
    if target.kind == "sentinel":
        pool_class: type = _SentinelPool
        if max_connections is not None:
            pool_class = _BlockingSentinelPool
            options.update(max_connections=max_connections, timeout=settings.timeout_s)
        return _sync_sentinel(target, options).master_for(
            target.service, redis_class=_SentinelMaster, connection_pool_class=pool_class,
            **options, **_master_kwargs(target),
        )
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
    command = _async_client(settings, client_id, max_connections, settings.timeout_s)
    return command, async_listener(settings, client_id)


def async_listener(
    settings: ClientSettings, client_id: str
) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """A listener's client of one connection (per node, in a cluster), for one reply key.

    A sharded queue's replies land in each shard's slot, so an
    ``AsyncClient`` makes one of these per shard it listens on.
    """
    target = parse_redis_url(settings.redis_url)
    if target.kind == "single":
        options = _options(settings, AsyncDeadlineRetry, client_id)
        return redis.asyncio.Redis.from_url(
            settings.redis_url, single_connection_client=True, **options
        )
    return _async_client(settings, client_id, 1, None)


def _async_client(
    settings: ClientSettings, client_id: str, max_connections: int, wait_s: float | None
) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """A pool of ``max_connections`` (per node, in a cluster), waiting at most ``wait_s`` for a
    free one (and never past a caller's deadline; a cluster does not wait)."""
    target = parse_redis_url(settings.redis_url)
    if target.kind == "cluster":
        options = _options(settings, AsyncClusterDeadlineRetry, client_id)
        return _async_cluster(target, options, max_connections)
    options = _options(settings, AsyncDeadlineRetry, client_id)
    if target.kind == "sentinel":
        return _async_sentinel(target, options).master_for(
            target.service, redis_class=_AsyncSentinelMaster,
            connection_pool_class=_AsyncSentinelPool, max_connections=max_connections,
            timeout=wait_s, **_master_kwargs(target), **options,
        )
    pool = _AsyncPool.from_url(
        settings.redis_url, max_connections=max_connections, timeout=wait_s, **options
    )
    return redis.asyncio.Redis.from_pool(pool)


def sync_client_for(url: str, **kwargs: Any) -> redis.Redis | redis.RedisCluster:
    """A plain sync client for ``url`` of any kind, with redis-py's client ``kwargs``.

    For the operator commands (``tokenq stats``, ``top``, ``dlq``), which want
    short timeouts and no caller deadlines. A single-server URL is exactly
    ``redis.Redis.from_url(url, **kwargs)``; a malformed URL is a ValueError.
    """
    target = parse_redis_url(url)
    if target.kind == "single":
        return redis.Redis.from_url(url, **kwargs)
    if target.kind == "cluster":
        return functions.route_by_keys(redis.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(host, port) for host, port in target.nodes],
            **_master_kwargs(target), **kwargs,
        ))
    sentinels = _sentinel_kwargs(target, kwargs)
    sentinel = redis.sentinel.Sentinel(target.nodes, sentinel_kwargs=sentinels)
    following = managed_connection(tls=target.tls, asyncio=False)
    return sentinel.master_for(target.service, redis_class=_SentinelMaster,
                               connection_class=following, **_master_kwargs(target), **kwargs)


# ------------------------------------------------------- cluster and sentinel


def _master_kwargs(target: RedisTarget) -> dict[str, Any]:
    """The URL's credentials, TLS and (Sentinel) database, as redis-py client kwargs."""
    kwargs: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.tls:
        kwargs.update(ssl=True, **target.tls_kwargs())
    if target.kind == "sentinel":
        kwargs["db"] = target.db
    return kwargs


def _sentinel_kwargs(target: RedisTarget, options: dict[str, Any]) -> dict[str, Any]:
    """How to talk to the sentinels: the socket and retry options, their own credentials."""
    kept = {name: value for name, value in options.items()
            if name.startswith("socket_") or name in ("retry", "retry_on_error")}
    return {**kept, "username": target.sentinel_username, "password": target.sentinel_password}


class LazyCluster:
    """A sync ``RedisCluster``, made at its first use rather than with the ``Client``.

    redis-py's sync ``RedisCluster`` reads the topology in its constructor,
    so a cluster whose nodes were all unreachable made ``Client(...)`` raise
    redis-py's ``RedisClusterException``, unbounded by any deadline. Made at
    the first command instead, it is read inside that caller's deadline (the
    node connections are deadline-bound) and a failure is that call's
    ``BrokerUnavailable`` (:func:`failure`); the next call tries again. The
    asyncio ``RedisCluster`` is lazy by itself.
    """

    def __init__(self, make: Callable[[], redis.RedisCluster]) -> None:
        self._make = make
        self._made: redis.RedisCluster | None = None
        self._lock = threading.Lock()

    def resolve(self) -> redis.RedisCluster:
        """The ``RedisCluster``, made now if this is its first use (by one thread)."""
        made = self._made
        if made is None:
            with self._lock:
                if self._made is None:
                    self._made = self._make()
                made = self._made
        return made

    def __getattr__(self, name: str) -> Any:
        return getattr(self.resolve(), name)

    def get_encoder(self) -> Any:
        """redis-py's default encoder, which a script registered before any use asks for."""
        return redis.connection.Encoder("utf-8", "strict", False)

    def register_script(self, script: str) -> Any:
        """A script bound to this stand-in, so registering one connects nothing."""
        return redis.commands.core.Script(self, script)

    def close(self) -> None:
        """Close the cluster's connections, if it was ever made."""
        if self._made is not None:
            self._made.close()


def _node_url(host: str, port: int) -> str:
    return f"redis://[{host}]:{port}" if ":" in host else f"redis://{host}:{port}"


def _sync_cluster(
    target: RedisTarget, options: dict[str, Any], max_connections: int | None, wait_s: float
) -> redis.RedisCluster:
    """A ``RedisCluster`` whose node pools are the deadline-bound ones.

    redis-py builds a node's pool from ``connection_pool_class`` only when
    the client was given a URL (its ``from_url`` mode; otherwise it makes a
    plain ``Redis`` per node, which takes no connection class), so the first
    node goes in as a bare URL and the rest as startup nodes; credentials and
    TLS, passed as kwargs, are not overridden by a URL that has none.
    ``retry_on_error`` is dropped: node connections never retry there, the
    cluster's loop does (:class:`ClusterDeadlineRetry`).
    """
    (host, port), *others = target.nodes
    kwargs = {name: value for name, value in options.items() if name != "retry_on_error"}
    kwargs.update(_master_kwargs(target))
    tls = kwargs.pop("ssl", False)
    kwargs["connection_class"] = redis.SSLConnection if tls else redis.Connection
    if max_connections is None:
        kwargs["connection_pool_class"] = _Pool
    else:
        kwargs.update(connection_pool_class=_BlockingPool, max_connections=max_connections,
                      timeout=wait_s)
    return functions.route_by_keys(redis.RedisCluster(
        url=_node_url(host, port),
        startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in others],
        **kwargs,
    ))


def _async_cluster(
    target: RedisTarget, options: dict[str, Any], max_connections: int
) -> redis.asyncio.RedisCluster:
    """An asyncio ``RedisCluster`` whose node connections are deadline-bound.

    Its constructor takes no connection class (it picks plain or TLS from
    ``ssl``) nor every TLS option, but every node it ever makes, the startup
    nodes aside, is built from the one ``connection_kwargs`` dict it keeps;
    so both are set there, and on the startup nodes, before anything connects.
    """
    kwargs = {name: value for name, value in options.items() if name != "retry_on_error"}
    master = _master_kwargs(target)
    tls = {name: master.pop(name) for name in target.options}
    client = redis.asyncio.RedisCluster(
        startup_nodes=[redis.asyncio.cluster.ClusterNode(h, p) for h, p in target.nodes],
        max_connections=max_connections, **master, **kwargs,
    )
    connection_class = deadline_bound(client.connection_kwargs["connection_class"])
    client.connection_kwargs.update(connection_class=connection_class, **tls)
    for node in client.startup_nodes:
        node.connection_class = connection_class
        node.connection_kwargs.update(tls)
    return functions.route_by_keys(client)


class _SentinelMaster(redis.Redis):
    """A master client that, closed, also closes its Sentinel's connections to the sentinels."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.connection_pool.sentinel_manager.close()


class _AsyncSentinelMaster(redis.asyncio.Redis):
    """The asyncio twin of :class:`_SentinelMaster`."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            await self.connection_pool.sentinel_manager.aclose()


def _sync_sentinel(target: RedisTarget, options: dict[str, Any]) -> redis.sentinel.Sentinel:
    """A Sentinel whose own connections to the sentinels are deadline-bound too."""
    sentinel = redis.sentinel.Sentinel(target.nodes,
                                       sentinel_kwargs=_sentinel_kwargs(target, options))
    for client in sentinel.sentinels:
        pool = client.connection_pool
        pool.connection_class = deadline_bound(pool.connection_class, _BoundedSockets)
    return sentinel


def _async_sentinel(
    target: RedisTarget, options: dict[str, Any]
) -> redis.asyncio.sentinel.Sentinel:
    """The asyncio twin of :func:`_sync_sentinel`."""
    sentinel = redis.asyncio.sentinel.Sentinel(
        target.nodes, sentinel_kwargs=_sentinel_kwargs(target, options))
    for client in sentinel.sentinels:
        pool = client.connection_pool
        pool.connection_class = deadline_bound(pool.connection_class)
    return sentinel
