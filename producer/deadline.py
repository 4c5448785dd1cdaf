"""How long a producer's call and each of its Redis commands may take (no I/O, no redis)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from tokenq.shared.errors import BadRequest
from tokenq.shared.settings import MAX_SECONDS

BLOCK_FLOOR_S = 0.01
"""Shortest blocking wait (a timeout of 0 would block forever)."""

BACKOFF_BASE_S = 0.02
BACKOFF_CAP_S = 0.5
"""Outages are retried with exponential backoff between these (by redis-py and by the calls)."""

DEADLINE_GRACE_S = 0.2
"""How far past the caller's deadline one Redis command may run: a blocking read for all the
time left must get its ``nil`` back before the socket gives up on it."""


def backoff_s(failures: int) -> float:
    """The pause after the ``failures``-th outage in a row that redis-py's retries gave up on."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**failures)


def check_seconds(value: object, name: str) -> float:
    """``value`` as seconds a wait can take (positive, finite); else BadRequest naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number of seconds, got {type(value).__name__}",
                         param=name)
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise BadRequest(f"{name} must be a positive number of seconds, at most {MAX_SECONDS:,} "
                         f"(about 31 years), got {value!r}", param=name)
    return float(value)


def block_s(remaining_s: float, socket_timeout_s: float) -> float:
    """One blocking read's wait: at most half the socket timeout (a longer one would read as a
    dead connection) and the time left; the caller loops until its deadline."""
    return max(BLOCK_FLOOR_S, min(remaining_s, socket_timeout_s / 2))


@dataclass(frozen=True, slots=True)
class Deadline:
    """When one call gives up (``at``, monotonic); with ``persist`` an unreachable Redis is
    tried again, with backoff, until then."""

    at: float
    persist: bool = False

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def left(self) -> float:
        """The time left, never negative: how long a wait for something else may last."""
        return max(0.0, self.remaining())

    def cap(self, seconds: float) -> float:
        """``seconds`` cut short to end by the deadline (a backoff that must not outlast it)."""
        return max(0.0, min(seconds, self.remaining()))
