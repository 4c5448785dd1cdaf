"""Publishing answers: reply, XACK and XDEL of a batch in one MULTI/EXEC.

A request is either still pending in the stream or answered, never both and
never neither: the RPUSH of its reply, the PEXPIRE of the reply key, the XACK
and the XDEL of its entry commit together. If Redis is unreachable the
answers are kept and retried with backoff until they land, so a computed
result is never thrown away because of a network blip.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tokenq.worker.jobs import Answer

log = logging.getLogger("tokenq.worker")


async def publish_once(
    client: aioredis.Redis,
    stream: str,
    group: str,
    answers: Sequence[Answer],
    reply_ttl_ms: int,
) -> None:
    """One MULTI/EXEC for a batch of answers."""
    if not answers:
        return
    async with client.pipeline(transaction=True) as pipe:
        expire: set[str] = set()
        for answer in answers:
            if answer.reply_to is not None:
                pipe.rpush(answer.reply_to, answer.payload)
                expire.add(answer.reply_to)
        for key in expire:
            pipe.pexpire(key, reply_ttl_ms)
        entry_ids = [answer.entry_id for answer in answers]
        pipe.xack(stream, group, *entry_ids)
        pipe.xdel(stream, *entry_ids)
        await pipe.execute()


async def publish(
    client: aioredis.Redis,
    stream: str,
    group: str,
    answers: Sequence[Answer],
    reply_ttl_ms: int,
    *,
    max_backoff_s: float = 5.0,
) -> None:
    """Publish, retrying until Redis takes it (results are never dropped)."""
    delay = 0.1
    while True:
        try:
            await publish_once(client, stream, group, answers, reply_ttl_ms)
            return
        except RedisError as exc:
            log.warning(
                "could not publish %d answers (%s); keeping them and retrying in %.1fs",
                len(answers), exc, delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_backoff_s)
