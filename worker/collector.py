"""Python's garbage collector, set for a worker's steady state."""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""Net container allocations between two collections of the youngest generation."""


def settle_after_startup() -> None:
    """Collect startup's garbage, freeze what is left, and widen the youngest generation."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
