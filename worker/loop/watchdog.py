"""The watchdog: the one task that decides the worker is hung, and what it does then.

Which stage is late is :class:`~tokenq.worker.loop.stages.Stages`' rule. Once one is,
the worker stops reading and refreshing claims (:attr:`Lifecycle.hung`),
publishes what is done within a grace, deletes its liveness keys and raises
:class:`WorkerHung` (exit 3). Each turn also ticks the loop's liveness (``/livez``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from tokenq.shared.errors import TokenqError
from tokenq.worker.health import Health
from tokenq.worker.loop.lifecycle import STOP_GRACE_S, Lifecycle
from tokenq.worker.loop.stages import Stages
from tokenq.worker.settings import WorkerSettings

log = logging.getLogger("tokenq.worker")


class WorkerHung(TokenqError):
    """A stage holding entries ran past its deadline; the process must be restarted.

    Its thread cannot be stopped from Python, so the command exits (``os._exit(3)``).
    """


def watchdog_period_s(settings: WorkerSettings) -> float:
    """How often the watchdog looks at the stages (and ticks the event loop's liveness)."""
    return min(1.0, settings.batch_timeout_s / 4)


class Watchdog:
    """Watches the stages; raises :class:`WorkerHung` once one is past its deadline."""

    def __init__(
        self, *, period_s: float, stages: Stages, lifecycle: Lifecycle, health: Health,
        wake: Callable[[], None], unpublished: Callable[[], bool],
        drop_liveness: Callable[[], Awaitable[None]],
    ) -> None:
        self._period_s = period_s
        self._stages = stages
        self._lifecycle = lifecycle
        self._health = health
        self._wake = wake
        """Wake whatever waits (the device feed, readers waiting for room) to see the hang."""
        self._unpublished = unpublished
        self._drop_liveness = drop_liveness

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            self._health.tick(time.monotonic())
            now = self._stages.now()  # the stages' clock: a stopped process's time left out
            late = self._stages.overdue(now, self._lifecycle.stop_started, STOP_GRACE_S)
            if late is None:
                continue
            self._lifecycle.hung = True
            self._health.stage_hung(late.stage.name, late.reason)
            log.critical(
                "%s hung: %s (for %.0fs); stopping to read and to keep claims, so that "
                "other workers take this worker's requests, and exiting",
                late.stage.name, late.reason, now - late.stage.started,
            )
            self._wake()
            grace = time.monotonic() + STOP_GRACE_S
            while self._unpublished() and time.monotonic() < grace:
                await asyncio.sleep(0.05)
            with contextlib.suppress(RedisError, asyncio.TimeoutError):
                await asyncio.wait_for(self._drop_liveness(), 2.0)
            raise WorkerHung(f"{late.stage.name} hung: {late.reason}")
