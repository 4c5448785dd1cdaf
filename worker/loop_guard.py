"""The guard behind the watchdog: a thread that ends a worker whose event loop is stuck.

The watchdog (``worker/watchdog.py``) is a task on the event loop, so it can
only act while the loop runs. A stage that holds the loop itself, a read
admitted on the loop (``worker/admit_place.py``) whose tokenizer never
returns, blocks the watchdog with it: no exit 3, no ``/livez`` answer, the
entries held until someone kills the process.

So the ``tokenq worker`` command also starts this thread. Once a period it
asks the same :class:`~tokenq.worker.stages.Stages` which stage is past its
deadline; a stage still overdue ``patience_s`` later, by which time the
watchdog, had the loop run, would long since have published what was done
and ended the process, means the loop is stuck. The guard then logs which
stage, and calls ``on_stuck`` (the command: ``os._exit(3)``, as for any
hang). What the worker held stays pending to it, and peers claim it once its
liveness key expires (the beat, on the same loop, stopped refreshing it).

The guard's thread also ticks the stages' clock
(:class:`~tokenq.worker.stage_clock.StageClock`): a process stopped (SIGSTOP)
longer than a deadline stops this thread too, so the stopped time is left
out and the continued worker is not called hung; a loop stuck for real
leaves this thread ticking, so its time counts.

A thread, not a signal or ``faulthandler``: it needs no handler in the main
thread (which is the one stuck) and nothing process-wide that tests or
embedders also use.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tokenq.worker.lifecycle import STOP_GRACE_S, Lifecycle
from tokenq.worker.stage_clock import StageClock
from tokenq.worker.stages import Overdue, Stages

log = logging.getLogger("tokenq.worker")


def patience_s(period_s: float) -> float:
    """How long a stage may stay overdue before the guard calls the loop stuck: the
    watchdog's period, its grace to publish, the worker's two stop graces (tasks, then
    deregistering) and a margin, so a loop that runs always gets there first."""
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
