"""The clock of stage deadlines: monotonic seconds, less the time the process was stopped."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["COUNTED_PERIODS", "StageClock"]

COUNTED_PERIODS = 1.5
"""The most of one gap between ticks that counts, in periods (one plus scheduling slack)."""


class StageClock:
    """Monotonic seconds that leave out what the ticks could not cover; any thread reads it."""

    def __init__(self, tick_period_s: float, raw: Callable[[], float] = time.monotonic) -> None:
        """``tick_period_s``: the ticking thread's period (``math.inf``: every gap counts in full).
        """
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
