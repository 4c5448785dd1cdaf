"""What ends a hung worker: the watchdog task, which decides a stage is past its deadline, and
the loop guard, a thread that ends a worker whose event loop (the watchdog's) is stuck in an
overdue stage; the guard also ticks the stages' clock."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from tokenq.shared import keys
from tokenq.shared.errors import TokenqError
from tokenq.worker.loop.device import Device
from tokenq.worker.loop.lanes import LaneSet
from tokenq.worker.loop.lifecycle import STOP_GRACE_S, Lifecycle, Wiring
from tokenq.worker.loop.outbox import Outbox
from tokenq.worker.loop.stages import Overdue, StageClock, Stages
from tokenq.worker.settings import WorkerSettings

log = logging.getLogger("tokenq.worker")


class WorkerHung(TokenqError):
    """A stage holding entries ran past its deadline; the process must be restarted."""


def watchdog_period_s(settings: WorkerSettings) -> float:
    """How often the watchdog looks at the stages (and ticks the event loop's liveness)."""
    return min(1.0, settings.batch_timeout_s / 4)


async def watch(wiring: Wiring, lanes: LaneSet, device: Device, outbox: Outbox) -> None:
    """Watch the stages; once one is past its deadline, let its entries go and raise
    :class:`WorkerHung`."""
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
        log.critical("%s hung: %s (for %.0fs); stopping to read and to keep claims, so that "
                     "other workers take this worker's requests, and exiting",
                     late.stage.name, late.reason, now - late.stage.started)
        device.wake()  # and the readers waiting for room: they see the hang
        lifecycle.room_made.set()
        grace = time.monotonic() + STOP_GRACE_S
        while outbox.unpublished() and time.monotonic() < grace:
            await asyncio.sleep(0.05)
        alive = [keys.worker_alive(lane.queue, wiring.consumer) for lane in lanes]
        with contextlib.suppress(RedisError, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*map(wiring.client.delete, alive)), 2.0)
        raise WorkerHung(f"{late.stage.name} hung: {late.reason}")


def patience_s(period_s: float) -> float:
    """How long a stage may stay overdue before the guard calls the loop stuck: the
    watchdog's period, its grace, both stop graces and a margin, so the watchdog wins."""
    return period_s + 3 * STOP_GRACE_S + 2.0


class LoopGuard:
    """A daemon thread: :meth:`start` it with the worker, :meth:`stop` it on the way out."""

    def __init__(
        self, *, stages: Stages, lifecycle: Lifecycle, period_s: float,
        on_stuck: Callable[[Overdue], None], clock: StageClock,
    ) -> None:
        """``clock``: the one ``stages`` reads, ticked by this thread once a period."""
        self._stages = stages
        self._lifecycle = lifecycle
        self._period_s = period_s
        self._patience_s = patience_s(period_s)
        self._on_stuck = on_stuck
        self._clock = clock
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenq-loop-guard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._period_s + 1.0)

    def check(self, now: float) -> Overdue | None:
        """The stage overdue for longer than the patience at ``now``, or None."""
        return self._stages.overdue(now - self._patience_s, self._lifecycle.stop_started,
                                    STOP_GRACE_S)

    def _run(self) -> None:
        self._clock.tick()
        try:
            while not self._stopped.wait(self._period_s):
                self._clock.tick()
                late = self.check(self._clock())
                if late is None:
                    continue
                log.critical("event loop stuck: %s, and the watchdog could not act for %.0fs "
                             "more; exiting", late.reason, self._patience_s)
                self._on_stuck(late)
                return
        finally:
            self._clock.stop_ticking()
