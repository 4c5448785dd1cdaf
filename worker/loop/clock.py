"""Redis's clock, estimated (deadlines and queue waits are on it: a skewed host cannot expire
everything; docs/decisions/0011-deadlines-on-redis-clock.md)."""

from __future__ import annotations

import time

import redis.asyncio as aioredis


class RedisClock:
    """Epoch milliseconds on Redis's clock, estimated from the local clock and an offset."""

    def __init__(self) -> None:
        self.offset_ms = 0.0
        """Redis's clock minus ours; 0 until the first :meth:`sync`."""

    async def sync(self, client: aioredis.Redis) -> None:
        """Measure the offset once (one ``TIME`` round trip)."""
        before = time.time()
        seconds, micros = await client.time()
        after = time.time()
        redis_ms = int(seconds) * 1000 + int(micros) / 1000
        self.offset_ms = redis_ms - (before + after) * 500.0

    def now_ms(self) -> int:
        """Now, in epoch milliseconds on Redis's clock."""
        return int(time.time() * 1000 + self.offset_ms)
