"""One place that turns settings into a resilient asyncio Redis client.

Every command retries with exponential backoff on connection errors and
timeouts (redis-py's own Retry), TLS and ACL credentials come from the URL
(``rediss://user:password@host``), and the socket timeout is longer than any
blocking read the worker issues, so a dead server surfaces as an error
instead of a hang.

Commands are packed by hiredis's C packer when hiredis is installed (it is
in the worker extra): redis-py's asyncio connection packs every argument in
Python, about 1.5 µs each, and a batch's publish script carries four
arguments per answer, so packing alone cost ~6 µs per request.
"""

from __future__ import annotations

import functools
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenq.shared.settings import WorkerSettings

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis is in the worker extra
    _hiredis_pack = None


class HiredisPacking:
    """Connection mixin: ``pack_command`` in C (hiredis), byte-for-byte redis-py's output.

    What hiredis refuses (a bool, an unknown type) goes to redis-py's own
    packer, so the errors a caller sees are redis-py's.
    """

    def pack_command(self, *args: Any) -> list[bytes]:
        if _hiredis_pack is not None and args:
            first = args[0]
            # A command name with a space ("SCRIPT LOAD") is two arguments, as redis-py splits it.
            if isinstance(first, str):
                args = (*first.encode().split(), *args[1:])
            elif isinstance(first, bytes) and b" " in first:
                args = (*first.split(), *args[1:])
            try:
                return [_hiredis_pack(args)]
            except TypeError:
                pass
        return super().pack_command(*args)  # type: ignore[misc]


@functools.cache
def _with_packing(connection_class: type) -> type:
    return type(f"Packed{connection_class.__name__}", (HiredisPacking, connection_class), {})


def connect(settings: WorkerSettings) -> aioredis.Redis:
    """An asyncio client for the worker (bytes in, bytes out)."""
    client = aioredis.Redis.from_url(
        settings.redis_url,
        decode_responses=False,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=min(5.0, settings.socket_timeout_s),
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), settings.retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=30,
        client_name="tokenq-worker",
    )
    # The URL's scheme chose the class (TCP, TLS, Unix socket); pack in C on any of them.
    pool = client.connection_pool
    pool.connection_class = _with_packing(pool.connection_class)
    return client
