"""Start-up check that the Redis server is configured the way tokenq assumes
(docs/RELIABILITY.md): ``maxmemory-policy noeviction`` and an append-only file.
A worker warns and carries on; an ACL user without CONFIG rights skips the check."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tokenq.shared.failures import error_text

log = logging.getLogger("tokenq.worker")


async def check_server(client: aioredis.Redis) -> list[str]:
    """Warnings about the server's settings (also logged); empty when all is well."""
    try:
        policy = await client.config_get("maxmemory-policy")
        persistence = await client.config_get("appendonly")
    except RedisError as exc:
        log.debug("cannot read the server's settings (%s); skipping the check", error_text(exc))
        return []
    warnings = []
    value = _value(policy, "maxmemory-policy")
    if value and value != "noeviction":
        warnings.append(
            f"Redis maxmemory-policy is {value!r}: under memory pressure it may evict pending "
            "requests or replies; set maxmemory-policy noeviction"
        )
    if _value(persistence, "appendonly") == "no":
        warnings.append(
            "Redis appendonly is off: a Redis restart loses every queued request; "
            "set appendonly yes and appendfsync everysec for durability"
        )
    for warning in warnings:
        log.warning("%s", warning)
    return warnings


def _value(reply: dict, name: str) -> str | None:
    value = reply.get(name.encode(), reply.get(name))
    return value.decode() if isinstance(value, bytes) else value
