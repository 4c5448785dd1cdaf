"""A thread that ends a worker whose event loop is stuck in an overdue stage (the watchdog runs
on that loop); it also ticks the :class:`~tokenq.worker.loop.stages.StageClock`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tokenq.worker.loop.lifecycle import STOP_GRACE_S, Lifecycle
from tokenq.worker.loop.stages import Overdue, StageClock, Stages

log = logging.getLogger("tokenq.worker")


def patience_s(period_s: float) -> float:
    """How long a stage may stay overdue before the guard calls the loop stuck: the
    watchdog's period, its grace, both stop graces and a margin, so the watchdog wins.
    """
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
                log.critical(
                    "event loop stuck: %s, and the watchdog could not act for %.0fs more; "
                    "exiting", late.reason, self._patience_s,
                )
                self._on_stuck(late)
                return
        finally:
            self._clock.stop_ticking()
