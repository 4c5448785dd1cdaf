"""The worker's Redis: its resilient asyncio client, made from settings in one place, and the
start-up check that the server is configured the way tokenq assumes (docs/RELIABILITY.md)."""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis
from redis._parsers import AsyncCommandsParser
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenq.shared import redis_client
from tokenq.shared.failures import error_text
from tokenq.shared.packing import HiredisPacking as HiredisPacking  # the mixin, for tests
from tokenq.shared.packing import packed
from tokenq.shared.redis_url import parse_redis_url
from tokenq.worker.settings import WorkerSettings

log = logging.getLogger("tokenq.worker")


def connect(settings: WorkerSettings) -> aioredis.Redis | aioredis.RedisCluster:
    """An asyncio client for the worker (bytes in, bytes out), with no cap on connections."""
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), settings.retries)
    options: dict[str, Any] = {
        "decode_responses": False,
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": min(5.0, settings.socket_timeout_s),
        "retry": retry,
        "health_check_interval": 30,
        "client_name": "tokenq-worker",
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],  # not in a cluster
    }
    return redis_client.async_client(parse_redis_url(settings.redis_url), options, HOOKS)


def stream_read_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """The keys of an ``XREADGROUP``/``XREAD`` command line (the first half after ``STREAMS``),
    or None when it is not one or does not parse (the caller then asks Redis)."""
    words = [a.decode() if isinstance(a, bytes) else str(a) for a in args]
    options_from = {"XREADGROUP": 4, "XREAD": 1}.get(words[0].upper() if words else "")
    if options_from is None:  # XREADGROUP's options come after GROUP group consumer
        return None
    at = next((i for i in range(options_from, len(words)) if words[i].upper() == "STREAMS"), None)
    rest = [] if at is None else list(args[at + 1:])
    return rest[: len(rest) // 2] if rest and not len(rest) % 2 else None


class _StreamKeysParser(AsyncCommandsParser):
    """redis-py's cluster command parser, finding a stream read's keys without asking Redis."""

    async def _get_moveable_keys(self, *args: Any) -> Any:
        keys = stream_read_keys(args)
        return keys if keys is not None else await super()._get_moveable_keys(*args)


HOOKS = redis_client.ClientHooks(connection=packed, cluster_parser=_StreamKeysParser)
"""The worker's connections pack in C, on any topology; a cluster finds a read's keys itself."""


async def check_server(client: aioredis.Redis) -> None:
    """Warn, and carry on, unless the server has ``maxmemory-policy noeviction`` and an
    append-only file; an ACL user without CONFIG rights skips the check."""
    try:
        policy = _config(await client.config_get("maxmemory-policy"), "maxmemory-policy")
        appendonly = _config(await client.config_get("appendonly"), "appendonly")
    except RedisError as exc:
        log.debug("cannot read the server's settings (%s); skipping the check", error_text(exc))
        return
    if policy and policy != "noeviction":
        log.warning("Redis maxmemory-policy is %r: under memory pressure it may evict pending "
                    "requests or replies; set maxmemory-policy noeviction", policy)
    if appendonly == "no":
        log.warning("Redis appendonly is off: a Redis restart loses every queued request; "
                    "set appendonly yes and appendfsync everysec for durability")


def _config(reply: dict, name: str) -> str | None:
    value = reply.get(name.encode(), reply.get(name))
    return value.decode() if isinstance(value, bytes) else value
