"""How a worker makes itself known: the queue's config hash and heartbeats.

At start a worker writes the model's limits to ``keys.config(q)`` so that
producers can refuse over-long input early and load the same tokenizer. Every
heartbeat refreshes a liveness key with a TTL (``keys.worker_alive``) and
writes its totals to the ``keys.workers(q)`` hash, which ``tokenq stats``
reads. At a clean exit both are removed.
"""

from __future__ import annotations

import socket
import time
from importlib import resources
from typing import Any

import msgpack
import redis.asyncio as aioredis

from tokenq.shared import keys, wire
from tokenq.worker.backends.base import BackendInfo

DROP_CONSUMER_SCRIPT = (
    resources.files("tokenq.worker").joinpath("lua/drop_consumer.lua").read_text()
)


def config_fields(info: BackendInfo, *, policy: str, max_batch_tokens: int) -> dict[str, str]:
    """The config hash's fields (strings, so redis-cli HGETALL reads them)."""
    fields = {
        "protocol": str(wire.PROTOCOL_VERSION),
        "backend": info.name,
        "model": info.model,
        "task": info.task,
        "max_input_tokens": str(info.max_input_tokens),
        "policy": policy,
        "pairs": "1" if info.pairs else "0",
        "padded": "1" if info.padded else "0",
        "max_batch_tokens": str(max_batch_tokens),
        "updated_at": str(int(time.time())),
    }
    if info.dim is not None:
        fields["dim"] = str(info.dim)
    if info.tokenizer:
        fields["tokenizer"] = info.tokenizer
    return fields


async def write_config(client: aioredis.Redis, q: keys.QueueRef, fields: dict[str, str]) -> None:
    await client.hset(keys.config(q), mapping=fields)


async def beat(
    client: aioredis.Redis,
    q: keys.QueueRef,
    consumer: str,
    status: dict[str, Any],
    ttl_ms: int,
) -> None:
    """Refresh liveness and publish this worker's totals."""
    status = {**status, "host": socket.gethostname(), "at": time.time()}
    async with client.pipeline(transaction=True) as pipe:
        pipe.set(keys.worker_alive(q, consumer), b"1", px=ttl_ms)
        pipe.hset(keys.workers(q), consumer, msgpack.packb(status, use_bin_type=True))
        await pipe.execute()


async def leave(client: aioredis.Redis, q: keys.QueueRef, consumer: str) -> None:
    """Deregister: drop liveness, then forget the consumer as a dead one is forgotten."""
    await client.delete(keys.worker_alive(q, consumer))
    await drop_consumer(client, q, consumer)


async def drop_consumer(client: aioredis.Redis, q: keys.QueueRef, consumer: str) -> bool:
    """Remove a gone consumer's heartbeat row, and it from the group if it holds nothing.

    One script (``drop_consumer.lua``) does every removal, re-checking liveness
    and pending entries at the moment it acts. True when it left the group.
    """
    script = client.register_script(DROP_CONSUMER_SCRIPT)  # EVALSHA, loaded once per server
    removed = await script(
        keys=[keys.requests(q), keys.worker_alive(q, consumer), keys.workers(q)],
        args=[keys.GROUP, consumer],
    )
    return bool(removed)
