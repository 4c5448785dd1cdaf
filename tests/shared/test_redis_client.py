"""The one Redis client factory (``shared/redis_client.py``) on a real redis-server."""

from __future__ import annotations

import asyncio

import redis

from tokenq.shared import redis_client
from tokenq.shared.redis_url import parse_redis_url


def test_a_client_given_no_cap_holds_as_many_connections_as_its_callers_block_on(
    redis_url: str,
) -> None:
    """A worker blocks one read per lane (its shards and up to 256 tenants' streams): a pool
    given no cap must not stop at redis-py's default of 100 (``MaxConnectionsError``)."""
    async def block_on_many() -> list[object]:
        client = redis_client.async_client(parse_redis_url(redis_url), {})
        try:
            return await asyncio.gather(*(client.blpop([f"nothing-{i}"], timeout=0.5)
                                          for i in range(150)))
        finally:
            await client.aclose()

    assert asyncio.run(block_on_many()) == [None] * 150
    sync = redis_client.sync_client(parse_redis_url(redis_url), {})
    assert sync.connection_pool.max_connections == redis_client.UNCAPPED
    sync.close()
    assert isinstance(sync, redis.Redis)
