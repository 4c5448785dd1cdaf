"""Every rule behind the worker's ``/livez`` and ``/readyz`` answers, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_LOADING = "model loading"
NOT_JOINED = "consumer group not joined"
STOPPING = "stopping"
READ_FAILURES_BEFORE_UNREADY = 3
"""Consecutive failed reads on every lane after which ``/readyz`` fails (the read
loop's backoff makes three about 0.7 s: one blip is not enough)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """An answer for a probe: ok, or the reasons it is not (short, for people)."""

    reasons: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def text(self) -> str:
        return "ok" if self.ok else "; ".join(self.reasons)


class Health:
    """What the probes know about one worker process: plain attributes written by the loop
    and read by the endpoint's thread (atomic stores)."""

    def __init__(self, heartbeat_s: float, watchdog_period_s: float = 1.0) -> None:
        self.stall_after_s = 3.0 * max(heartbeat_s, watchdog_period_s)
        self._redis_after_s = 3.0 * heartbeat_s
        self.model_loaded = False
        self.joined = False
        self.stopping = False
        self.redis_error: str | None = None  # why the last Redis check failed
        self.hung: str | None = None  # the watchdog's reason once it fired
        self._read_failures: dict[int, tuple[int, str]] = {}  # lane: failures in a row, error
        self.publish_refusal: str | None = None  # why Redis refused the last publish
        self._ticked: float | None = None  # the loop's last tick; None unless it runs
        self._beat_since: float | None = None  # when the heartbeat waiting on Redis started

    def loaded(self) -> None:
        self.model_loaded = True

    def redis_answered(self, error: BaseException | str | None = None) -> None:
        """A Redis check finished: passed (None) or failed with ``error``."""
        self.redis_error = None if error is None else (str(error) or type(error).__name__)

    def running(self, now: float) -> None:
        """The worker's tasks started: from now on the event loop must keep ticking."""
        self.joined = True
        self._ticked = now

    def tick(self, now: float) -> None:
        """The event loop ran one of the worker's periodic tasks."""
        if self._ticked is not None:
            self._ticked = now

    def beat_started(self, now: float) -> None:
        self.tick(now)
        self._beat_since = now

    def beat_finished(self, error: BaseException | None = None) -> None:
        self._beat_since = None
        self.redis_answered(error)

    def publish_refused(self, reason: str) -> None:
        """Redis refused a publish call for its own state (``oom``, ``readonly``, ...)."""
        self.publish_refusal = reason

    def publish_ok(self) -> None:
        self.publish_refusal = None

    def stage_hung(self, stage: str, reason: str) -> None:
        """The watchdog found ``stage`` (``device``, ``tokenizing``, ...) past its deadline."""
        self.hung = f"{stage} hung: {reason}"

    def reader_started(self, lane: int) -> None:
        """``lane`` is read from now on: readiness counts its reads."""
        self._read_failures[lane] = (0, "")

    def reader_ended(self, lane: int) -> None:
        self._read_failures.pop(lane, None)

    def read_failed(self, lane: int, error: BaseException | str) -> None:
        """A read (XREADGROUP, a reclaim scan) on ``lane`` failed with ``error``."""
        failures, _ = self._read_failures.get(lane, (0, ""))
        self._read_failures[lane] = (failures + 1, str(error) or type(error).__name__)

    def read_ok(self, lane: int) -> None:
        if lane in self._read_failures:
            self._read_failures[lane] = (0, "")

    def closed(self) -> None:
        """The worker's tasks ended (the process is about to exit): stop expecting ticks."""
        self.stopping = True
        self._ticked = None
        self._beat_since = None

    def live(self, now: float) -> Verdict:
        if self.hung is not None:
            return Verdict((self.hung,))
        if self._ticked is not None and now - self._ticked > self.stall_after_s:
            stalled = f"no heartbeat or watchdog tick for {now - self._ticked:.1f}s"
            return Verdict((f"event loop stalled: {stalled}",))
        return Verdict()

    def ready(self, now: float) -> Verdict:
        reasons: list[str] = []
        if not self.model_loaded:
            reasons.append(MODEL_LOADING)
        elif not self.joined:
            reasons.append(NOT_JOINED)
        since = self._beat_since
        if since is not None and now - since > self._redis_after_s:
            reasons.append(f"redis unreachable: no answer for {now - since:.1f}s")
        elif self.redis_error is not None:
            reasons.append(f"redis unreachable: {self.redis_error}")
        lanes = list(self._read_failures.values())
        if lanes and all(failures >= READ_FAILURES_BEFORE_UNREADY for failures, _ in lanes):
            reasons.append(f"reads failing: {lanes[-1][1]}")
        if self.publish_refusal is not None:
            reasons.append(f"redis refuses writes: {self.publish_refusal}")
        if self.stopping:
            reasons.append(STOPPING)
        return Verdict((*reasons, *self.live(now).reasons))
