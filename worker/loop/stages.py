"""Deadlines of the stages that hold entries (device, tokenizing, read, publish): every rule of
"hung" (docs/decisions/0057-stage-deadlines.md), on a clock that leaves out a stopped process."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from tokenq.worker.settings import WorkerSettings

DEVICE = "device"
TOKENIZING = "tokenizing"
READ = "read"
PUBLISH = "publish"


@dataclass(frozen=True, slots=True)
class Stage:
    """One running stage: what it is doing, since when, and its deadline."""

    name: str  # DEVICE, TOKENIZING, READ or PUBLISH
    what: str  # what it holds, for people: "a batch of 12 requests on the device"
    started: float
    limit_s: float
    limit_name: str  # the setting (or rule) the limit comes from, named in the probe and log
    shortened_by_stop: bool = False  # tokenizing: once the worker stops, only the stop grace


class Overdue(NamedTuple):
    """A stage past its deadline, and the sentence that says so."""

    stage: Stage
    reason: str


class Stages:
    """The stages running now, written by any thread, read by the watchdog."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._running: dict[int, Stage] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @contextmanager
    def running(
        self, name: str, what: str, limit_s: float, limit_name: str, *,
        shortened_by_stop: bool = False,
    ) -> Iterator[Callable[[], None]]:
        """Register a stage for the ``with`` block; yields ``restart`` (a publisher's next try)."""
        stage = Stage(name, what, self._clock(), limit_s, limit_name, shortened_by_stop)
        with self._lock:
            key = next(self._ids)
            self._running[key] = stage

        def restart() -> None:
            with self._lock:
                if key in self._running:
                    self._running[key] = dataclasses.replace(
                        self._running[key], started=self._clock())

        try:
            yield restart
        finally:
            with self._lock:
                self._running.pop(key, None)

    def now(self) -> float:
        """Now on the clock the stages' starts are read from."""
        return self._clock()

    def overdue(
        self, now: float, stopped_at: float | None = None, stop_grace_s: float = 0.0
    ) -> Overdue | None:
        """The running stage furthest past its deadline, or None; after ``stopped_at`` a stage a
        stop shortens must end within ``stop_grace_s`` of the later of its start and the stop."""
        worst: tuple[float, Overdue] | None = None
        with self._lock:
            running = list(self._running.values())
        for stage in running:
            late = now - (stage.started + stage.limit_s)
            reason = f"{stage.what} for more than {stage.limit_name} ({stage.limit_s:g}s)"
            if stopped_at is not None and stage.shortened_by_stop:
                after_stop = now - (max(stage.started, stopped_at) + stop_grace_s)
                if after_stop > late:
                    late = after_stop
                    reason = (f"{stage.what} for more than the stop grace "
                              f"({stop_grace_s:g}s) after the worker was told to stop")
            if late >= 0 and (worst is None or late > worst[0]):
                worst = (late, Overdue(stage, reason))
        return None if worst is None else worst[1]


COUNTED_PERIODS = 1.5
"""The most of one gap between ticks that counts, in periods (one plus scheduling slack)."""


class StageClock:
    """Monotonic seconds less the time the process was stopped (SIGSTOP, a frozen cgroup): the
    loop guard ticks it each period and at most :data:`COUNTED_PERIODS` of a gap counts."""

    def __init__(self, tick_period_s: float, raw: Callable[[], float] = time.monotonic) -> None:
        self._max_gap_s = COUNTED_PERIODS * tick_period_s
        self._raw = raw
        self._lock = threading.Lock()
        self._last_tick: float | None = None
        self._left_out = 0.0

    def _uncounted(self, raw_now: float) -> float:
        last = self._last_tick
        return 0.0 if last is None else max(0.0, raw_now - last - self._max_gap_s)

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


REDIS_CALL_BOUND = "twice the Redis call bound"
"""How the deadline of a Redis read or publish attempt is named in the probe and the log."""


def redis_call_deadline_s(settings: WorkerSettings) -> float:
    """The deadline of one Redis read or publish attempt: twice what redis-py can take."""
    attempt = settings.block_ms / 1000 + settings.socket_timeout_s + min(
        5.0, settings.socket_timeout_s)
    return 2 * ((settings.retries + 1) * attempt + settings.retries * 2.0)
