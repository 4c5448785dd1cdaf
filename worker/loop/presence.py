"""How a worker makes itself known: the queue's config hash and heartbeats."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, RedisError

from tokenq.shared import functions, keys, lua_scripts, redis_refusal
from tokenq.shared.failures import error_text
from tokenq.shared.heartbeat import Heartbeat, encode_heartbeat

log = logging.getLogger("tokenq.worker")


_ONLY_WHEN_SET = ("shards", functions.ENQUEUE_FUNCTION_FIELD)
"""Fields absent at their default; a write without one removes a stale one (resharding to 1)."""


async def write_config(client: aioredis.Redis, q: keys.QueueRef, fields: dict[str, str]) -> None:
    """Load tokenq's functions, then write the config hash naming the enqueue function (none on
    Redis < 7, EVALSHA there, or when this worker's ACL may not load them)."""
    try:
        if await functions.async_load(client) is not None:
            enqueue = lua_scripts.library().functions["enqueue"]
            fields = {**fields, functions.ENQUEUE_FUNCTION_FIELD: enqueue}
    except NoPermissionError as exc:
        log.warning("cannot load tokenq's Redis functions (%s): producers whose ACL allows "
                    "only FCALL will fail until an admin runs `tokenq functions load` or this "
                    "worker's ACL gets +function|load (docs/SECURITY.md)", error_text(exc))
    stale = [name for name in _ONLY_WHEN_SET if name not in fields]
    async with client.pipeline(transaction=True) as pipe:
        pipe.hset(keys.config(q), mapping=fields)
        if stale:
            pipe.hdel(keys.config(q), *stale)
        await pipe.execute()


async def beat(
    client: aioredis.Redis, q: keys.QueueRef, consumer: str, status: Heartbeat, ttl_ms: int
) -> None:
    """Refresh liveness and publish this worker's totals, in one MULTI."""
    try:
        async with client.pipeline(transaction=True) as pipe:
            pipe.set(keys.worker_alive(q, consumer), b"1", px=ttl_ms)
            pipe.hset(keys.workers(q), consumer, encode_heartbeat(status))
            await pipe.execute()
    except RedisError as exc:
        if not redis_refusal.is_out_of_memory(exc):
            raise
        if not await client.pexpire(keys.worker_alive(q, consumer), ttl_ms):
            raise


async def leave(client: aioredis.Redis, q: keys.QueueRef, consumer: str) -> None:
    """Deregister: drop liveness, then forget the consumer as a dead one is forgotten."""
    await client.delete(keys.worker_alive(q, consumer))
    await drop_consumer(client, q, consumer)


async def drop_consumer(client: aioredis.Redis, q: keys.QueueRef, consumer: str) -> bool:
    """Remove a gone consumer's heartbeat row, and it from the group if it holds nothing
    (``drop_consumer.lua`` re-checks atomically); True when it left the group."""
    script = functions.AsyncFunction(client, "drop_consumer")  # drop_consumer.lua, by FCALL
    removed = await script(
        keys=[keys.requests(q), keys.worker_alive(q, consumer), keys.workers(q)],
        args=[keys.GROUP, consumer],
    )
    return bool(removed)
