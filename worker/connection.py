"""One place that turns settings into a resilient asyncio Redis client.

Every command retries with exponential backoff on connection errors and
timeouts (redis-py's own Retry), TLS and ACL credentials come from the URL
(``rediss://user:password@host``), and the socket timeout is longer than any
blocking read the worker issues, so a dead server surfaces as an error
instead of a hang.

The URL (:mod:`tokenq.shared.redis_url`) may also name a Redis Cluster
(``redis+cluster://``: an asyncio ``RedisCluster``, which follows MOVED/ASK
and re-reads the topology itself, retrying ``retries`` times at cluster
level) or a Sentinel-watched master (``redis+sentinel://``: a master client
that asks the sentinels where the master is whenever it reconnects, a
reconnect inside a command's retries included: ``shared/sentinel_connection.py``).

Commands are packed by hiredis's C packer when hiredis is installed (it is
in the worker extra): redis-py's asyncio connection packs every argument in
Python, about 1.5 µs each, and a batch's publish script carries four
arguments per answer, so packing alone cost ~6 µs per request.
"""

from __future__ import annotations

import functools
from typing import Any

import redis.asyncio as aioredis
from redis._parsers import AsyncCommandsParser
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenq.shared import functions
from tokenq.shared.packing import HiredisPacking
from tokenq.shared.redis_url import RedisTarget, parse_redis_url
from tokenq.shared.sentinel_connection import managed_connection
from tokenq.shared.settings import WorkerSettings


@functools.cache
def _with_packing(connection_class: type) -> type:
    return type(f"Packed{connection_class.__name__}", (HiredisPacking, connection_class), {})


def connect(settings: WorkerSettings) -> aioredis.Redis | aioredis.RedisCluster:
    """An asyncio client for the worker (bytes in, bytes out)."""
    target = parse_redis_url(settings.redis_url)
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), settings.retries)
    options: dict[str, Any] = {
        "decode_responses": False,
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": min(5.0, settings.socket_timeout_s),
        "retry": retry,
        "health_check_interval": 30,
        "client_name": "tokenq-worker",
    }
    if target.kind == "cluster":
        return _cluster(target, options)
    options["retry_on_error"] = [RedisConnectionError, RedisTimeoutError]
    if target.kind == "sentinel":
        return _sentinel_master(target, options)
    client = aioredis.Redis.from_url(settings.redis_url, **options)
    # The URL's scheme chose the class (TCP, TLS, Unix socket); pack in C on any of them.
    pool = client.connection_pool
    pool.connection_class = _with_packing(pool.connection_class)
    return client


def _credentials(target: RedisTarget) -> dict[str, Any]:
    return {"username": target.username, "password": target.password}


def _cluster(target: RedisTarget, options: dict[str, Any]) -> aioredis.RedisCluster:
    """A ``RedisCluster`` packing in C, with no cap on connections per node (as a pool has).

    Its constructor takes no connection class and not every TLS option, but
    builds every node it finds from the one ``connection_kwargs`` dict it
    keeps; both are set there and on the startup nodes before anything connects.
    """
    tls = target.tls_kwargs()
    client = aioredis.RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
        max_connections=2**31, ssl=target.tls, **_credentials(target), **options,
    )
    connection_class = _with_packing(client.connection_kwargs["connection_class"])
    client.connection_kwargs.update(connection_class=connection_class, **tls)
    for node in client.startup_nodes:
        node.connection_class = connection_class
        node.connection_kwargs.update(tls)
    client.commands_parser.__class__ = _StreamKeysParser
    return functions.route_by_keys(client)  # FCALL's keys too, without asking Redis


def stream_read_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """The keys of an ``XREADGROUP``/``XREAD`` command line (the first half after ``STREAMS``),
    or None when it is not one or does not parse (the caller then asks Redis)."""
    name = (args[0].decode() if isinstance(args[0], bytes) else str(args[0])) if args else ""
    options_from = {"XREADGROUP": 4, "XREAD": 1}.get(name.upper())  # past GROUP group consumer
    if options_from is None:
        return None
    words = [a.decode() if isinstance(a, bytes) else str(a) for a in args]
    try:
        at = next(i for i in range(options_from, len(words)) if words[i].upper() == "STREAMS")
    except StopIteration:
        return None
    rest = list(args[at + 1:])
    if not rest or len(rest) % 2:
        return None
    return rest[: len(rest) // 2]


class _StreamKeysParser(AsyncCommandsParser):
    """redis-py's cluster command parser, finding a stream read's keys without asking Redis.

    ``XREADGROUP`` has "movable" keys, so redis-py sends ``COMMAND GETKEYS``
    (twice) to its default node before every read to learn which slot to
    send it to: two round trips per read, to a node that may hold nothing of
    the queue (``scripts/bench/run.py shards`` counted 126 of 705). The keys
    are simply the first half of what follows ``STREAMS``.
    """

    async def _get_moveable_keys(self, *args: Any) -> Any:
        keys = stream_read_keys(args)
        return keys if keys is not None else await super()._get_moveable_keys(*args)


class _PackedSentinelPool(SentinelConnectionPool):
    """A Sentinel master's pool whose managed connections pack in C."""

    def __init__(self, service_name: str, sentinel_manager: Any, **kwargs: Any) -> None:
        managed = managed_connection(tls=kwargs.pop("ssl", False), asyncio=True)
        kwargs["connection_class"] = _with_packing(managed)
        super().__init__(service_name, sentinel_manager, **kwargs)


class _SentinelMaster(aioredis.Redis):
    """A master client that, closed, also closes its Sentinel's connections to the sentinels."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            await self.connection_pool.sentinel_manager.aclose()


def _sentinel_master(target: RedisTarget, options: dict[str, Any]) -> aioredis.Redis:
    """The master of ``target.service``, found through the sentinels (asked with the same
    timeouts and retries, and their own credentials from the URL's query)."""
    sentinels = {name: options[name] for name in
                 ("socket_timeout", "socket_connect_timeout", "retry", "retry_on_error")}
    sentinel = Sentinel(target.nodes, sentinel_kwargs={
        **sentinels, "username": target.sentinel_username, "password": target.sentinel_password,
    })
    tls = {"ssl": True, **target.tls_kwargs()} if target.tls else {}
    return sentinel.master_for(
        target.service, redis_class=_SentinelMaster, connection_pool_class=_PackedSentinelPool,
        db=target.db, **_credentials(target), **tls, **options,
    )
