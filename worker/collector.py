"""Python's garbage collector, set for a worker's steady state.

A worker keeps thousands of container objects per read alive until answered, so
the default youngest threshold made the collector run often, free nothing, and
now and then walk everything, the model included
(docs/decisions/0017-collector-frozen-after-startup.md). Once startup is done:
one full collection, ``gc.freeze()``, and the youngest threshold raised to
:data:`YOUNG_THRESHOLD`. The collector stays on, so later cycles are still freed.
Only the ``tokenq worker`` command does this; an embedding process is left alone.
"""

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
