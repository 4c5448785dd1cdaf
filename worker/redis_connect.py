"""One place that turns settings into a resilient asyncio Redis client."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis._parsers import AsyncCommandsParser
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenq.shared import redis_client
from tokenq.shared.packing import HiredisPacking as HiredisPacking  # the mixin, for tests
from tokenq.shared.packing import packed
from tokenq.shared.redis_url import parse_redis_url
from tokenq.worker.settings import WorkerSettings


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
