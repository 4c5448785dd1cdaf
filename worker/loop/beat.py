"""The heartbeat: presence on every lane, fresh claims on what the worker holds, depth.

Each ``heartbeat_s``: heartbeat and liveness key per lane (``presence.py``), idle
times of held entries reset, retired lanes tended, the Redis clock synced, the
depth measured (metrics on). A hung worker stops beating so peers take its entries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from tokenq.shared import keys
from tokenq.shared.failures import error_text
from tokenq.shared.heartbeat import Heartbeat
from tokenq.worker.health import Health
from tokenq.worker.loop import depth_probe, presence
from tokenq.worker.loop.clock import RedisClock
from tokenq.worker.loop.intake import Intake
from tokenq.worker.loop.lanes import Lane, Retirement
from tokenq.worker.loop.lifecycle import Lifecycle
from tokenq.worker.loop.recorder import Recorder
from tokenq.worker.pipeline.feed import wait_event

log = logging.getLogger("tokenq.worker")

CLAIM_CHUNK = 512
"""Most entry ids one XCLAIM refreshes."""


class Beat:
    """The worker's heartbeat task and what it keeps fresh."""

    def __init__(
        self, client: Any, *, consumer: str, heartbeat_s: float, lanes: list[Lane],
        intake: Intake, lifecycle: Lifecycle, health: Health, recorder: Recorder,
        clock: RedisClock, retirement: Retirement, status: Callable[[], Heartbeat],
    ) -> None:
        self.client = client
        self.consumer = consumer
        self.heartbeat_s = heartbeat_s
        self.lanes = lanes
        """The worker's lanes (shared: this removes the drained retired ones)."""
        self._intake = intake
        self._lifecycle = lifecycle
        self._health = health
        self._recorder = recorder
        self._clock = clock
        self._retirement = retirement
        self._status = status
        self._depth_failed = False

    async def run(self) -> None:
        ttl_ms = int(self.heartbeat_s * 3000)
        while not (self._lifecycle.hung or self._lifecycle.closing.is_set()):
            self._health.beat_started(time.monotonic())
            try:
                await self._beat_lanes(self._status(), ttl_ms)
                await self._tend_retired()
                await self._clock.sync(self.client)
                self._health.beat_finished()
            except RedisError as exc:
                self._health.beat_finished(exc)
                log.warning("heartbeat failed: %s", error_text(exc))
            except Exception:
                # A stopped heartbeat lets peers take this worker's work: log and keep beating.
                self._health.beat_finished()
                log.exception("heartbeat failed unexpectedly")
            if self._recorder.metrics.enabled and self._health.redis_error is None:
                await self._measure_depth()  # not after a failed beat: Redis is away
            await wait_event(self._lifecycle.closing, self.heartbeat_s)

    async def _tend_retired(self) -> None:
        """Stop reading the retired lanes that are drained and removed."""
        for lane in await self._retirement.tend(self.client, self.lanes, self.consumer):
            lane.drained = True
            self.lanes.remove(lane)

    async def _measure_depth(self) -> None:
        """Refresh the queue-depth gauges; a failure (an ACL without XLEN) is logged once."""
        try:
            found = await depth_probe.measure(self.client, [lane.stream for lane in self.lanes])
        except RedisError as exc:
            if not self._depth_failed:
                log.warning("queue depth metrics unavailable (%s); needs XLEN and "
                            "XINFO GROUPS on %s", error_text(exc), streams_of(self.lanes))
            self._depth_failed = True
            return
        self._depth_failed = False
        self._recorder.queue_depth(found.length, found.pending, found.lag)

    async def _beat_lanes(self, status: Heartbeat, ttl_ms: int) -> None:
        """Beat, and keep held entries' claims fresh, on every lane at once, each bounded by
        the liveness TTL (a down shard cannot lapse the others); raises if no lane took it.
        """
        held = self._intake.held_by_lane()
        if len(self.lanes) == 1:
            await self._beat_lane(self.lanes[0], status, ttl_ms, held.get(0, []))
            return
        results = await asyncio.gather(*(
            asyncio.wait_for(self._beat_lane(lane, status, ttl_ms, held.get(lane.index, [])),
                             ttl_ms / 1000)
            for lane in self.lanes
        ), return_exceptions=True)
        failed = [(lane, outcome) for lane, outcome in zip(self.lanes, results, strict=True)
                  if isinstance(outcome, BaseException)]
        for lane, exc in failed:
            if not isinstance(exc, (RedisError, asyncio.TimeoutError)):
                raise exc
            log.warning("heartbeat on %s failed: %s", lane.stream, error_text(exc))
        if len(failed) == len(self.lanes):
            raise RedisError(f"no stream took the heartbeat: {error_text(failed[0][1])}")

    async def _beat_lane(
        self, lane: Lane, status: Heartbeat, ttl_ms: int, held: list[bytes]
    ) -> None:
        await presence.beat(self.client, lane.queue, self.consumer, status, ttl_ms)
        await self._keep_claims_fresh(lane, held)

    async def _keep_claims_fresh(self, lane: Lane, held: list[bytes]) -> None:
        """Reset the idle time of held entries so nobody claims them; never while a batch is
        hung (that worker must let them go).
        """
        for start in range(0, len(held), CLAIM_CHUNK):
            if self._lifecycle.hung:
                return
            await self.client.xclaim(
                lane.stream, keys.GROUP, self.consumer, 0, held[start:start + CLAIM_CHUNK],
                justid=True,
            )


def streams_of(lanes: list[Lane]) -> str:
    """The streams a worker reads, for its log lines."""
    return ", ".join(lane.stream for lane in lanes)
