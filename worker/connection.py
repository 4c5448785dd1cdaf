"""One place that turns settings into a resilient asyncio Redis client.

Every command retries with exponential backoff on connection errors and
timeouts (redis-py's own Retry), TLS and ACL credentials come from the URL
(``rediss://user:password@host``), and the socket timeout is longer than any
blocking read the worker issues, so a dead server surfaces as an error
instead of a hang.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenq.shared.settings import WorkerSettings


def connect(settings: WorkerSettings) -> aioredis.Redis:
    """An asyncio client for the worker (bytes in, bytes out)."""
    return aioredis.Redis.from_url(
        settings.redis_url,
        decode_responses=False,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=min(5.0, settings.socket_timeout_s),
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), settings.retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=30,
        client_name="tokenq-worker",
    )
