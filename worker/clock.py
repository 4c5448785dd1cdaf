"""The worker's estimate of Redis's clock.

Deadlines (``timeout_ms`` after an entry's stream id) and queue-wait times
are measured on Redis's clock, which stamped every stream id, so that a
producer's or a worker's skewed wall clock cannot answer everything
``deadline_exceeded`` or run everything late. The worker reads ``TIME`` at
start and with every heartbeat and keeps the offset from its own clock,
corrected by half the round trip; between reads it adds its own clock's
progress, so the estimate is as good as one round trip plus the drift of a
few seconds.
"""

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
