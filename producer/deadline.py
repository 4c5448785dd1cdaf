"""How long a producer's call and each of its Redis commands may take: no I/O, no redis.

One call has one :class:`Deadline` on the monotonic clock; every command,
retry and blocking wait of the call is cut to it (:mod:`tokenq.producer.calls`
decides the order, :mod:`tokenq.producer.redis_deadlines` holds each command to
it). The caller's own ``timeout_s`` and ``deadline_s`` are checked by
:func:`check_seconds`, so a value Python's ``threading`` cannot wait for is a
:class:`BadRequest` naming its argument, never an ``OverflowError`` later.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from tokenq.shared.errors import BadRequest
from tokenq.shared.settings import MAX_SECONDS

BLOCK_FLOOR_S = 0.01
"""Shortest blocking wait; a timeout of 0 would block forever, which tokenq never does."""

BACKOFF_BASE_S = 0.02
BACKOFF_CAP_S = 0.5
"""Outages are retried with exponential backoff between these (by redis-py and by the calls)."""

DEADLINE_GRACE_S = 0.2
"""How far past the caller's deadline one Redis command may run before it is cut off.

A blocking read that blocks for exactly the caller's remaining time must get its
``nil`` back before the socket gives up on it (else a healthy Redis would be
reported as unreachable), so every socket wait is the remaining time plus
this. It is also the most a command started at the deadline may take.
"""


def backoff_s(failures: int) -> float:
    """The pause after the ``failures``-th outage in a row that redis-py's retries gave up on."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**failures)


def check_seconds(value: object, name: str) -> float:
    """``value`` as seconds if it is a positive finite number a wait can take; else BadRequest
    naming ``name`` (the caller's argument) as its ``param``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(
            f"{name} must be a number of seconds, got {type(value).__name__}", param=name
        )
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise BadRequest(
            f"{name} must be a positive number of seconds, at most {MAX_SECONDS:,} "
            f"(about 31 years), got {value!r}",
            param=name,
        )
    return float(value)


def block_s(remaining_s: float, socket_timeout_s: float) -> float:
    """How long one blocking read may block: under the socket timeout and the caller's deadline.

    A blocking read that outlives the socket timeout would be reported as a dead
    connection, so each wait is at most half the socket timeout and the
    caller loops until its own deadline.
    """
    return max(BLOCK_FLOOR_S, min(remaining_s, socket_timeout_s / 2))


@dataclass(frozen=True, slots=True)
class Deadline:
    """When one call of a client gives up, and how it treats a Redis that is down.

    ``at`` is on the ``time.monotonic()`` clock. With ``persist`` a command
    that fails because Redis is unreachable is tried again, with backoff,
    until ``at`` (``infer``, ``infer_many``: the caller gave that time to
    get an answer, and a retried enqueue is deduplicated by the script; the
    blocking loops of every wait retry the same way by themselves); without it
    redis-py's ``retries`` are all it gets (``submit``, admin calls). Either
    way no retry or backoff starts after ``at``, and no command runs more
    than :data:`DEADLINE_GRACE_S` past it.
    """

    at: float
    persist: bool = False

    @classmethod
    def after(cls, seconds: float, *, persist: bool = False) -> Deadline:
        return cls(time.monotonic() + seconds, persist)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def left(self) -> float:
        """The time left, never negative: how long a wait for something else may last."""
        return max(0.0, self.remaining())

    def cap(self, seconds: float) -> float:
        """``seconds`` cut short to end by the deadline (a backoff that must not outlast it)."""
        return max(0.0, min(seconds, self.remaining()))
