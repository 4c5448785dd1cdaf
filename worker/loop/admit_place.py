"""Where a read is admitted: on the event loop when that costs less than a thread hop."""

from __future__ import annotations

REQUEST_UNITS = 64
"""What one request costs in characters' worth of work, besides its text."""
FALL = 0.1
"""How far the rate moves down towards a cheaper read's, per read."""
INLINE_LIMIT_S = 10.0
"""A read admitted on the loop is hung after this long (or ``batch_timeout_s``, if
shorter): it holds the whole loop while it runs."""
INLINE_LIMIT_NAME = "the limit of a read admitted on the event loop"
"""How that deadline is named in ``/livez`` and the log."""


class AdmitPlace:
    """Decides, read by read, whether admission runs on the event loop or in a thread."""

    def __init__(self, budget_s: float, *, threads_only: bool = False) -> None:
        if budget_s < 0:
            raise ValueError(f"budget_s must be >= 0, got {budget_s}")
        self.budget_s = 0.0 if threads_only else budget_s
        self.seconds_per_unit: float | None = None
        """The learned cost of one unit of a read (None until a read was admitted)."""

    @staticmethod
    def units(requests: int, characters: int) -> int:
        """A read's size in units of work: its requests and its text."""
        return requests * REQUEST_UNITS + characters

    def on_loop(self, units: int) -> bool:
        """Whether a read of ``units`` is predicted to cost at most the budget."""
        rate = self.seconds_per_unit
        return rate is not None and rate * units <= self.budget_s

    def learn(self, units: int, seconds: float) -> None:
        """A read of ``units`` took ``seconds`` to admit (wherever it ran)."""
        if units <= 0 or seconds < 0:
            return
        observed = seconds / units
        rate = self.seconds_per_unit
        if rate is None or observed >= rate:
            self.seconds_per_unit = observed
        else:
            self.seconds_per_unit = rate + FALL * (observed - rate)
