"""Every redis-py client tokenq makes, sync or asyncio, of one server, a Cluster or a Sentinel
master; what differs between the sides is plugged in (:class:`ClientHooks`, docs/decisions/0052)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel

from tokenq.shared import functions
from tokenq.shared.redis_url import RedisTarget

UNCAPPED = 2**31
"""redis-py's own "no cap" on a pool's connections (an asyncio cluster wants a number)."""


def as_is(connection_class: type) -> type:
    return connection_class


@dataclass(frozen=True, slots=True)
class ClientHooks:
    """What one side plugs into every client (made once: classes are cached by it): wrappers of
    the command connections' class and the sentinels', a mixin in front of a capped pool, a
    cluster's command parser."""

    connection: Callable[[type], type] = as_is
    sentinels: Callable[[type], type] = as_is
    pool_wait: type | None = None
    cluster_parser: type | None = None


PLAIN = ClientHooks()
"""redis-py's classes unchanged (the operator commands)."""


@functools.cache
def with_mixins(connection_class: type, *mixins: type) -> type:
    """``connection_class`` with the ``mixins`` it lacks in front, in order; made once."""
    missing = tuple(mixin for mixin in mixins if not issubclass(connection_class, mixin))
    if not missing:
        return connection_class
    return type(f"Tokenq{connection_class.__name__}", (*missing, connection_class), {})


class FollowsMaster:
    """Mixin in front of redis-py's sync ``SentinelManagedConnection`` (or TLS twin): every
    reconnect, also within a command's retry, asks the sentinels where the master is."""

    connection_pool: Any
    host: str
    port: int

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if getattr(self, "_sock", None) is None:
            self._connect_retry()  # type: ignore[attr-defined]  # the lookup, then connect_to

    def connect_to(self, address: tuple[str, int]) -> None:
        self.host, self.port = address
        super(redis.sentinel.SentinelManagedConnection, self).connect_check_health(  # type: ignore[misc]
            check_health=self.connection_pool.check_connection, retry_socket_connect=False)


class AsyncFollowsMaster:
    """The asyncio twin of :class:`FollowsMaster`."""

    connection_pool: Any
    host: str
    port: int

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not self.is_connected:  # type: ignore[attr-defined]
            await self._connect_retry()  # type: ignore[attr-defined]

    async def connect_to(self, address: tuple[str, int]) -> None:
        self.host, self.port = address
        await super(  # type: ignore[misc]
            redis.asyncio.sentinel.SentinelManagedConnection, self
        ).connect_check_health(
            check_health=self.connection_pool.check_connection, retry_socket_connect=False)


def managed_connection(*, tls: bool, asyncio: bool) -> type:
    """The Sentinel-managed connection class that follows the master, made once per kind."""
    lib: Any = redis.asyncio.sentinel if asyncio else redis.sentinel
    base = lib.SentinelManagedSSLConnection if tls else lib.SentinelManagedConnection
    return with_mixins(base, AsyncFollowsMaster if asyncio else FollowsMaster)


class _HookedPool:
    """Pool mixin: its connections are of the hooked class (a Sentinel pool's follow the master)."""

    _hooks: ClientHooks
    _asyncio: bool
    _sentinel: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if self._sentinel:
            # The TLS flag picks the class here; redis-py's connections take no ``ssl``.
            kwargs["connection_class"] = managed_connection(
                tls=kwargs.pop("ssl", False), asyncio=self._asyncio)
        super().__init__(*args, **kwargs)
        # Set before any connection exists: pools make them on demand.
        self.connection_class = self._hooks.connection(self.connection_class)  # type: ignore[has-type]


@functools.cache
def pool_class(hooks: ClientHooks, *, asyncio: bool, sentinel: bool, capped: bool) -> type[Any]:
    """The pool class for one side, twin, topology and cap; made once."""
    lib: Any = redis.asyncio if asyncio else redis
    bases: list[type] = []
    if capped and hooks.pool_wait is not None:
        bases.append(hooks.pool_wait)
    bases.append(_HookedPool)
    if sentinel:
        bases.append(lib.sentinel.SentinelConnectionPool)
    base = lib.BlockingConnectionPool if capped else lib.ConnectionPool
    bases.append(base)
    name = f"Tokenq{'Async' if asyncio else ''}{'Sentinel' if sentinel else ''}{base.__name__}"
    made = {"__module__": __name__, "_hooks": hooks, "_asyncio": asyncio, "_sentinel": sentinel}
    return type(name, tuple(bases), made)


def _cap(max_connections: int | None, wait_s: float | None) -> dict[str, Any]:
    """A pool's size: uncapped given None (redis-py's own default is 100 connections, which a
    worker's blocking reads, one a lane, outgrow), else ``max_connections`` waiting ``wait_s``."""
    if max_connections is None:
        return {"max_connections": UNCAPPED}
    return {"max_connections": max_connections, "timeout": wait_s}


def sync_client(
    target: RedisTarget, options: dict[str, Any], hooks: ClientHooks = PLAIN, *,
    max_connections: int | None = None, wait_s: float | None = None,
    cluster_retry: Any = None, lazy: bool = False,
) -> redis.Redis | redis.RedisCluster:
    """A sync client of ``target`` with redis-py's ``options``; ``max_connections`` caps a
    blocking pool (per node) that waits ``wait_s``; ``cluster_retry``: the retry a cluster
    counts down itself; ``lazy``: a cluster is made at its first command."""
    capped = max_connections is not None
    if target.kind == "cluster":
        def make() -> redis.RedisCluster:
            return _sync_cluster(target, options, hooks, max_connections, wait_s, cluster_retry)
        return LazyCluster(make) if lazy else make()  # type: ignore[return-value]
    pool = pool_class(hooks, asyncio=False, sentinel=target.kind == "sentinel", capped=capped)
    if target.kind == "sentinel":
        return _master(redis.sentinel.Sentinel, SentinelMaster, pool, target, options, hooks,
                       _cap(max_connections, wait_s))
    return redis.Redis.from_pool(
        pool.from_url(target.url, **options, **_cap(max_connections, wait_s)))


def async_client(
    target: RedisTarget, options: dict[str, Any], hooks: ClientHooks = PLAIN, *,
    max_connections: int | None = None, wait_s: float | None = None,
    cluster_retry: Any = None, one_connection: bool = False,
) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """The asyncio twin of :func:`sync_client`; ``one_connection``: one connection (per node),
    for one blocking reader."""
    if one_connection:
        max_connections, wait_s = (None, None) if target.kind == "single" else (1, None)
    if target.kind == "cluster":
        return _async_cluster(target, options, hooks, max_connections, cluster_retry)
    capped = max_connections is not None
    pool = pool_class(hooks, asyncio=True, sentinel=target.kind == "sentinel", capped=capped)
    if target.kind == "sentinel":
        return _master(redis.asyncio.sentinel.Sentinel, AsyncSentinelMaster, pool, target,
                       options, hooks, _cap(max_connections, wait_s))
    client = redis.asyncio.Redis(
        connection_pool=pool.from_url(target.url, **options, **_cap(max_connections, wait_s)),
        single_connection_client=one_connection)
    client.auto_close_connection_pool = True  # as Redis.from_url and from_pool: it owns the pool
    return client


def master_kwargs(target: RedisTarget) -> dict[str, Any]:
    """The URL's credentials, TLS and (Sentinel) database, as redis-py client kwargs."""
    kwargs: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.tls:
        kwargs.update(ssl=True, **target.tls_kwargs())
    if target.kind == "sentinel":
        kwargs["db"] = target.db
    return kwargs


def _master(
    sentinel_class: type, redis_class: type, pool: type, target: RedisTarget,
    options: dict[str, Any], hooks: ClientHooks, cap: dict[str, Any],
) -> Any:
    """The master of ``target.service``, found through the sentinels (asked with the same
    timeouts and retries, their own credentials, over connections of the hooked class)."""
    kept = {name: value for name, value in options.items()
            if name.startswith("socket_") or name in ("retry", "retry_on_error")}
    sentinel = sentinel_class(target.nodes, sentinel_kwargs={
        **kept, "username": target.sentinel_username, "password": target.sentinel_password})
    for client in sentinel.sentinels:  # made on demand, later: the class can change now
        sentinels_pool = client.connection_pool
        sentinels_pool.connection_class = hooks.sentinels(sentinels_pool.connection_class)
    return sentinel.master_for(
        target.service, redis_class=redis_class, connection_pool_class=pool,
        **options, **cap, **master_kwargs(target))


def _cluster_options(options: dict[str, Any], cluster_retry: Any) -> dict[str, Any]:
    """A cluster's client options: node connections never retry, the cluster's loop does."""
    kwargs = {name: value for name, value in options.items() if name != "retry_on_error"}
    if cluster_retry is not None:
        kwargs["retry"] = cluster_retry
    return kwargs


def _routed(client: Any, hooks: ClientHooks) -> Any:
    if hooks.cluster_parser is not None:
        client.commands_parser.__class__ = hooks.cluster_parser
    return functions.route_by_keys(client)  # FCALL's keys too, without asking Redis


def _sync_cluster(
    target: RedisTarget, options: dict[str, Any], hooks: ClientHooks,
    max_connections: int | None, wait_s: float | None, cluster_retry: Any,
) -> redis.RedisCluster:
    """A ``RedisCluster`` whose node pools are the hooked ones: redis-py takes a
    ``connection_pool_class`` only with a URL, so the first node goes in as one."""
    (host, port), *others = target.nodes
    kwargs = _cluster_options(options, cluster_retry)
    kwargs.update(master_kwargs(target))
    tls = kwargs.pop("ssl", False)
    kwargs["connection_class"] = redis.SSLConnection if tls else redis.Connection
    capped = max_connections is not None
    kwargs["connection_pool_class"] = pool_class(hooks, asyncio=False, sentinel=False,
                                                 capped=capped)
    return _routed(redis.RedisCluster(
        url=f"redis://[{host}]:{port}" if ":" in host else f"redis://{host}:{port}",
        startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in others],
        **kwargs, **_cap(max_connections, wait_s),
    ), hooks)


def _async_cluster(
    target: RedisTarget, options: dict[str, Any], hooks: ClientHooks,
    max_connections: int | None, cluster_retry: Any,
) -> redis.asyncio.RedisCluster:
    """An asyncio ``RedisCluster`` whose node connections are the hooked ones: set in its
    ``connection_kwargs`` and on the startup nodes, the only places it makes nodes from."""
    master = master_kwargs(target)
    tls = {name: master.pop(name) for name in target.options}
    client = redis.asyncio.RedisCluster(
        startup_nodes=[redis.asyncio.cluster.ClusterNode(h, p) for h, p in target.nodes],
        max_connections=UNCAPPED if max_connections is None else max_connections,
        **master, **_cluster_options(options, cluster_retry))
    connection_class = hooks.connection(client.connection_kwargs["connection_class"])
    client.connection_kwargs.update(connection_class=connection_class, **tls)
    for node in client.startup_nodes:
        node.connection_class = connection_class
        node.connection_kwargs.update(tls)
    return _routed(client, hooks)


class LazyCluster:
    """A sync ``RedisCluster`` made at its first command, so reading the topology happens within
    that caller's deadline, not the client's constructor."""

    def __init__(self, make: Callable[[], redis.RedisCluster]) -> None:
        self._make = make
        self._made: redis.RedisCluster | None = None
        self._lock = threading.Lock()

    def resolve(self) -> redis.RedisCluster:
        """The ``RedisCluster``, made now (by one thread) if this is its first use."""
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
        return redis.commands.core.Script(self, script)  # type: ignore[arg-type]  # duck-typed

    def close(self) -> None:
        if self._made is not None:
            self._made.close()


class SentinelMaster(redis.Redis):
    """A master client that, closed, also closes its Sentinel's connections to the sentinels."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.connection_pool.sentinel_manager.close()  # type: ignore[attr-defined]


class AsyncSentinelMaster(redis.asyncio.Redis):
    """The asyncio twin of :class:`SentinelMaster`."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            await self.connection_pool.sentinel_manager.aclose()  # type: ignore[attr-defined]
