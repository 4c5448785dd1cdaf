"""The heartbeat: each ``heartbeat_s``, presence on every lane (``presence.py``), held entries'
claims kept fresh, retired lanes tended, the Redis clock synced, the depth measured (metrics
on). A hung worker stops beating so peers take its entries."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from tokenq.shared import functions, keys
from tokenq.shared.failures import error_text
from tokenq.shared.heartbeat import Heartbeat
from tokenq.shared.queue_depth import Depth, bounded, lane_depth, total
from tokenq.worker.batch_stats import MAX_TENANT_LABELS
from tokenq.worker.loop import presence
from tokenq.worker.loop.intake import Intake
from tokenq.worker.loop.lanes import Lane, LaneSet, Retirement
from tokenq.worker.loop.lifecycle import Wiring
from tokenq.worker.pipeline.feed import wait_event

log = logging.getLogger("tokenq.worker")

CLAIM_CHUNK = 512
"""Most entry ids one XCLAIM refreshes."""


@dataclass(slots=True)
class Beat:
    """The worker's heartbeat task and what it keeps fresh."""

    _wiring: Wiring
    _lanes: LaneSet
    _intake: Intake
    _retirement: Retirement
    _status: Callable[[], Heartbeat]
    _depth_failed: bool = False

    async def run(self) -> None:
        wiring = self._wiring
        health, lifecycle = wiring.health, wiring.lifecycle
        heartbeat_s = wiring.settings.heartbeat_s
        ttl_ms = int(heartbeat_s * 3000)
        while not (lifecycle.hung or lifecycle.closing.is_set()):
            health.beat_started(time.monotonic())
            try:
                await self._beat_lanes(self._status(), ttl_ms)
                for lane in await self._retirement.tend(wiring.client, self._lanes,
                                                        wiring.consumer):
                    self._lanes.remove(lane)  # drained and removed: read no more
                await wiring.clock.sync(wiring.client)
                health.beat_finished()
            except RedisError as exc:
                health.beat_finished(exc)
                log.warning("heartbeat failed: %s", error_text(exc))
            except Exception:
                # A stopped heartbeat lets peers take this worker's work: log and keep beating.
                health.beat_finished()
                log.exception("heartbeat failed unexpectedly")
            if wiring.recorder.metrics.enabled and health.redis_error is None:
                await self._measure_depth()  # not after a failed beat: Redis is away
            await wait_event(lifecycle.closing, heartbeat_s)

    async def _measure_depth(self) -> None:
        """Refresh the queue-depth gauges; a failure (an ACL without XLEN, a bug) is logged
        once while it lasts, and the beat goes on."""
        try:
            found = await measure(self._wiring.client, [lane.queue for lane in self._lanes])
        except Exception as exc:
            if not self._depth_failed:
                log.warning("queue depth metrics unavailable (%s); needs queue_depth.lua's "
                            "reads (docs/SECURITY.md) on %s", error_text(exc),
                            self._lanes.streams(), exc_info=not isinstance(exc, RedisError))
            self._depth_failed = True
            return
        self._depth_failed = False
        metrics = self._wiring.recorder.metrics
        metrics.queue_depth(found.length, found.pending, found.lag, found.tokens)
        metrics.tenant_pending(bounded(found.tenants, MAX_TENANT_LABELS))

    async def _beat_lanes(self, status: Heartbeat, ttl_ms: int) -> None:
        """Beat, and keep held entries' claims fresh, on every lane at once, each bounded by
        the liveness TTL (a down shard cannot lapse the others); raises if no lane took it."""
        held = self._intake.held_by_lane()
        lanes = list(self._lanes)
        if len(lanes) == 1:
            await self._beat_lane(lanes[0], status, ttl_ms, held.get(lanes[0].index, []))
            return
        results = await asyncio.gather(*(asyncio.wait_for(
            self._beat_lane(lane, status, ttl_ms, held.get(lane.index, [])), ttl_ms / 1000)
            for lane in lanes), return_exceptions=True)
        failed = [(lane, outcome) for lane, outcome in zip(lanes, results, strict=True)
                  if isinstance(outcome, BaseException)]
        for lane, exc in failed:
            if not isinstance(exc, (RedisError, asyncio.TimeoutError)):
                raise exc
            log.warning("heartbeat on %s failed: %s", lane.stream, error_text(exc))
        if len(failed) == len(lanes):
            raise RedisError(f"no stream took the heartbeat: {error_text(failed[0][1])}")

    async def _beat_lane(
        self, lane: Lane, status: Heartbeat, ttl_ms: int, held: list[bytes]
    ) -> None:
        """Beat, then reset the idle time of held entries so nobody claims them; never while a
        stage is hung (that worker must let them go)."""
        client, consumer = self._wiring.client, self._wiring.consumer
        if lane.tenant == keys.DEFAULT_TENANT:  # a tenant's lane shares its queue's presence
            await presence.beat(client, lane.queue, consumer, status, ttl_ms)
        for start in range(0, len(held), CLAIM_CHUNK):
            if self._wiring.lifecycle.hung:
                return
            await client.xclaim(lane.stream, keys.GROUP, consumer, 0,
                                held[start:start + CLAIM_CHUNK], justid=True)


async def measure(client: Any, queues: list[keys.QueueRef]) -> Depth:
    """The queue's depth now, over every stream of each lane, tenants' too (queue_depth.lua,
    then HGETALL of its pending hash; raises RedisError, e.g. NOPERM without ``+smembers`` of
    ``tenants`` or ``+xlen +exists +xinfo|groups`` of ``requests*``)."""
    script, found = functions.AsyncFunction(client, "queue_depth"), []
    for q in dict.fromkeys(queues):  # a tenant's lane is its queue's: counted once
        reply = await script(keys=[keys.requests(q)], args=["depth", keys.GROUP])
        found.append(lane_depth(reply, await client.hgetall(keys.pending(q))))
    return total(found)
