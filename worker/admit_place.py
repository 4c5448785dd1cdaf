"""Where a read is admitted: on the event loop when that costs less than a thread hop.

Admitting a read (the pipeline's checks, the tokenizer, the jobs) ran in a
thread, always, so a slow tokenizer never held the event loop. With a cheap
tokenizer and short text that hop is most of the cost: the thread and the
loop take turns at the GIL, and the loop, interrupted in smaller steps,
publishes and hands the device smaller batches. Measured with the null
backend (docs/BENCHMARKS.md, "cpu"), admitting on the loop took
about a tenth off the worker's CPU per request.

So each read goes where its predicted cost says: on the loop when the
prediction is at most ``budget_s`` (``--admit-inline-ms``, 2 ms by default:
a read held that long delays a publish by no more than one Redis round
trip under load would), in a thread otherwise, and always in a thread
before anything was learned, with ``--tokenize-processes`` (the wait is for
the children), or with a budget of 0.

The prediction is a rate per unit of work times the read's units (each
request counts :data:`REQUEST_UNITS` plus the characters of its text and
pair: a tokenizer's cost grows with both). The rate rises at once to a read
that cost more and falls slowly (a tenth of the way per read), so one
expensive read sends the next ones back to the thread at once, and the
cheap ones must show it many times over before the loop is used again.

A read admitted on the loop that never returns (a tokenizer stuck in a
loop) blocks the very watchdog that would notice it; the worker command's
:class:`~tokenq.worker.loop_guard.LoopGuard` thread ends the process then.

Pure: no clock and no asyncio; times are passed in.
"""

from __future__ import annotations

REQUEST_UNITS = 64
"""What one request costs in characters' worth of work, besides its text."""
FALL = 0.1
"""How far the rate moves down towards a cheaper read's, per read."""
INLINE_LIMIT_S = 10.0
"""A read admitted on the loop is hung after this long (or ``batch_timeout_s``, if shorter):
it was predicted to take ``budget_s``, and it holds the whole loop while it runs."""
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
