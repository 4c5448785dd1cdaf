"""The watchdog: the one task that decides the worker is hung, and what it does then."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

from tokenq.shared import keys
from tokenq.shared.errors import TokenqError
from tokenq.worker.loop.device import Device
from tokenq.worker.loop.lanes import LaneSet
from tokenq.worker.loop.lifecycle import STOP_GRACE_S, Wiring
from tokenq.worker.loop.outbox import Outbox
from tokenq.worker.settings import WorkerSettings

log = logging.getLogger("tokenq.worker")


class WorkerHung(TokenqError):
    """A stage holding entries ran past its deadline; the process must be restarted."""


def watchdog_period_s(settings: WorkerSettings) -> float:
    """How often the watchdog looks at the stages (and ticks the event loop's liveness)."""
    return min(1.0, settings.batch_timeout_s / 4)


class Watchdog:
    """Watches the stages; raises :class:`WorkerHung` once one is past its deadline."""

    def __init__(self, wiring: Wiring, lanes: LaneSet, device: Device, outbox: Outbox) -> None:
        self._wiring = wiring
        self._lanes = lanes
        self._device = device
        self._outbox = outbox

    async def run(self) -> None:
        wiring = self._wiring
        lifecycle, stages = wiring.lifecycle, wiring.stages
        period_s = watchdog_period_s(wiring.settings)
        while True:
            await asyncio.sleep(period_s)
            wiring.health.tick(time.monotonic())
            now = stages.now()  # the stages' clock: a stopped process's time left out
            late = stages.overdue(now, lifecycle.stop_started, STOP_GRACE_S)
            if late is None:
                continue
            lifecycle.hung = True
            wiring.health.stage_hung(late.stage.name, late.reason)
            log.critical(
                "%s hung: %s (for %.0fs); stopping to read and to keep claims, so that "
                "other workers take this worker's requests, and exiting",
                late.stage.name, late.reason, now - late.stage.started,
            )
            self._device.wake()  # and the readers waiting for room: they see the hang
            lifecycle.room_made.set()
            grace = time.monotonic() + STOP_GRACE_S
            while self._outbox.unpublished() and time.monotonic() < grace:
                await asyncio.sleep(0.05)
            with contextlib.suppress(RedisError, asyncio.TimeoutError):
                await asyncio.wait_for(self._drop_liveness(), 2.0)
            raise WorkerHung(f"{late.stage.name} hung: {late.reason}")

    async def _drop_liveness(self) -> None:
        for lane in self._lanes:
            await self._wiring.client.delete(
                keys.worker_alive(lane.queue, self._wiring.consumer))
