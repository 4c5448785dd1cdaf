"""Where a worker is in its life: running, stopping, hung, closing.

Every task asks; only :class:`~tokenq.worker.loop.Worker` (a stop) and the
watchdog (a hang) change the answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

STOP_GRACE_S = 5.0
"""How long a stopping worker keeps trying to publish and deregister while Redis is down."""


class Lifecycle:
    """The run state the worker's tasks share."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.stopping = asyncio.Event()
        """Set by a stop: read nothing more, finish and answer what was read."""
        self.closing = asyncio.Event()
        """Set once the tasks are being cancelled (redis-py can swallow a cancel)."""
        self.room_made = asyncio.Event()
        """Set when read-ahead room may have come free: readers waiting for room look again."""
        self.stop_started: float | None = None
        self.hung = False
        """Set by the watchdog: read nothing, refresh no claims, give up on Redis soon."""

    def stop(self) -> bool:
        """Mark the stop (True the first time)."""
        first = not self.stopping.is_set()
        if first:
            self.stop_started = self._clock()
        self.stopping.set()
        self.room_made.set()
        return first

    async def unless_stopping(self, work: Awaitable[object]) -> bool:
        """Run ``work`` to its end (True), or abandon it once a stop comes (False); a cancel
        redis-py swallows is waited on for a second at most.
        """
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            task.result()  # its error, if it failed
            return True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 1.0)
        return False

    def reading(self) -> bool:
        return not (self.stopping.is_set() or self.hung)

    def past_grace(self) -> bool:
        """A stopping (or hung) worker gives up on an unreachable Redis after a grace."""
        if self.hung:
            return True
        started = self.stop_started
        return started is not None and self._clock() - started > STOP_GRACE_S
