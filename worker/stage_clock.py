"""The clock of stage deadlines: monotonic seconds, less the time the process was stopped.

``time.monotonic`` keeps counting while the whole process is stopped (SIGSTOP,
a frozen cgroup, a paused container), and every thread stands still with it:
the device's, the event loop's, the watchdog's and the loop guard's. Measured
on that clock, a stage running at the stop (an XREADGROUP, a batch on the
device) is overdue once the process continues, and the worker would exit 3
(hung) although nothing in it was stuck, as would every stopped worker of a
supervisor, each restart losing its buffered work.

So the loop guard's thread ticks this clock once a period, and of the time
between two ticks at most :data:`COUNTED_PERIODS` periods count. The guard's thread only
sleeps and reads a table, so a tick much later than its period means the
process was not running (or a C call held the GIL that long: the guard could
not have acted either). A stuck stage, on the loop or in a thread, leaves the
guard ticking, so its time counts in full. Read between ticks, the clock
counts at most as much past the last one, so the watchdog, which may
look before the guard ticks again, sees the same time. Unticked (no guard,
or once it has stopped) it is the monotonic clock less what it left out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["COUNTED_PERIODS", "StageClock"]

COUNTED_PERIODS = 1.5
"""The most of one gap between two ticks that counts, in tick periods: the period and
half of one more for a busy machine's scheduling. So a stop of any length adds at most
1.5 periods to a stage's time (the watchdog's period: at most a quarter of
``batch_timeout_s``, and 1 s)."""


class StageClock:
    """Monotonic seconds that leave out what the ticks could not cover; any thread reads it."""

    def __init__(self, tick_period_s: float, raw: Callable[[], float] = time.monotonic) -> None:
        """``tick_period_s``: how often the ticking thread ticks (``math.inf``: every gap
        counts in full)."""
        self._max_gap_s = COUNTED_PERIODS * tick_period_s
        self._raw = raw
        self._lock = threading.Lock()
        self._last_tick: float | None = None
        self._left_out = 0.0

    def _uncounted(self, raw_now: float) -> float:
        if self._last_tick is None:
            return 0.0
        return max(0.0, raw_now - self._last_tick - self._max_gap_s)

    def __call__(self) -> float:
        with self._lock:
            raw_now = self._raw()
            return raw_now - self._left_out - self._uncounted(raw_now)

    def tick(self) -> None:
        """The ticking thread ran: what it could not cover since its last tick is left out."""
        with self._lock:
            raw_now = self._raw()
            self._left_out += self._uncounted(raw_now)
            self._last_tick = raw_now

    def stop_ticking(self) -> None:
        """No more ticks: from now on every second counts."""
        self.tick()
        with self._lock:
            self._last_tick = None
