"""Python's garbage collector, set for a worker's steady state.

Why it matters: a worker keeps every request it has read alive until its
answer is published: a read of 240 short entries makes some 3,000 container
objects (the entry's fields, ``Request``, ``Job``, the packer's ``Item``,
``Outcome``, ``Answer``, references) that all outlive the default youngest
generation's threshold of 700 allocations. So the collector ran every few
dozen requests, found nothing to free (these objects are freed by reference
counting when answered, never by the collector), promoted them, and every
few thousand requests walked *everything* in a full collection: every
module, every function, the model's Python objects. Measured on a null
worker draining 60,000 short requests (``gc.callbacks`` timing each
collection): 0.19 s in 552 young and 4 full collections, 3.2 µs per
request, about a seventh of the worker's CPU; with a real model loaded a
full collection walks millions of objects and stalls the event loop and
the device thread for its whole length.

What is done, once, after the backend has loaded and the worker is built:

* one full collection, so that startup's garbage is not kept forever, then
  ``gc.freeze()``: what startup made (modules, the model, settings) moves to
  the permanent generation, which no later collection walks;
* the youngest generation's threshold raised to :data:`YOUNG_THRESHOLD`
  (the older two keep Python's defaults): a few reads' worth of objects.

The same run then spent 0.002 s in 3 young collections and no full one. The
collector stays on: a reference cycle made later (an exception's traceback
holding its frame) is still freed, once :data:`YOUNG_THRESHOLD` more
container objects are alive than at the last collection. The cost is that
wait: whatever such a cycle holds (an array a frame refers to) is freed that
much later. A backend's failure is reported as its text (``FailedRun``),
not as the exception and its frames, so a failing batch does not leave its
arrays to such a cycle.

Only the ``tokenq worker`` command does this (the process is tokenq's own);
a worker embedded in someone else's process leaves their collector alone.
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
