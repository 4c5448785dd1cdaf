"""Keeping the device fed: the one scheduling loop both batching loops run.

The pipeline's only asyncio piece. Whenever the device is idle, ask the
packer for a batch; run it (one batch on the device at a time: the budget is
the memory bound, so two in flight would double it); when the packer holds
an unsealed batch, wait until its ``ready_at`` (linger) or until new input
wakes the loop. The Redis worker and the in-process batcher pass what
differs: how to run a batch, when to flush, when they are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tokenq.shared.packer import Batch, Packer

T = TypeVar("T")


def monotonic_ms() -> float:
    """The packer's clock: monotonic milliseconds."""
    return time.monotonic() * 1000.0


async def wait_event(event: asyncio.Event, timeout: float | None) -> None:
    """Wait for ``event`` at most ``timeout`` seconds (forever when None)."""
    if timeout is None:
        await event.wait()
        return
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


async def feed_device(
    packer: Packer[T],
    wake: asyncio.Event,
    run: Callable[[Batch[T]], Awaitable[Any]],
    *,
    flushing: Callable[[], bool],
    finished: Callable[[], bool],
    prune: Callable[[], None] | None = None,
) -> None:
    """Run the packer's batches one at a time until ``finished()`` holds with none ready.

    ``wake`` is set by whoever adds input (or stops the loop); ``flushing()``
    lets an unsealed batch go without lingering (stopping, closing);
    ``prune`` drops abandoned input before each pick.
    """
    while True:
        if prune is not None:
            prune()
        now = monotonic_ms()
        batch = packer.next_batch(now, flush=flushing())
        if batch is not None:
            await run(batch)
            continue
        if finished():
            return
        ready = packer.ready_at()
        timeout = None if ready is None else max(0.0, (ready - now) / 1000.0)
        wake.clear()
        await wait_event(wake, timeout)
