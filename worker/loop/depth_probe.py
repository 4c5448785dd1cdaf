"""How deep the queue is, as the worker reports it for autoscalers (KEDA, an HPA)."""

from __future__ import annotations

import redis.asyncio as aioredis

from tokenq.shared import keys
from tokenq.shared.queue_depth import Depth, depth, total
from tokenq.shared.redis_text import as_text


async def measure(client: aioredis.Redis, streams: list[str]) -> Depth:
    """The queue's depth now, over all its streams (raises RedisError, e.g. NOPERM without
    ``+xlen +xinfo|groups``)."""
    return total([await _measure_one(client, stream) for stream in streams])


async def _measure_one(client: aioredis.Redis, stream: str) -> Depth:
    async with client.pipeline(transaction=False) as pipe:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
        length, groups = await pipe.execute()
    group = next((g for g in groups if as_text(g.get("name")) == keys.GROUP), None)
    pending = int(group.get("pending") or 0) if group else 0
    return depth(int(length), pending, group_exists=group is not None,
                 reported_lag=group.get("lag") if group else None)
