"""Where a worker is in its life (running, stopping, hung, closing), Redis's clock as the worker
estimates it (docs/decisions/0011-deadlines-on-redis-clock.md), and the wiring its parts share:
the client, the settings and the hooks every part calls (deadlines, recorder, health). The
:class:`Recorder` records each event in one call, so no call site updates one sink (heartbeat
totals, metrics, batch log) and forgets another."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tokenq.shared.packer import Batch, Budget
from tokenq.worker.batch_stats import BatchLog, BatchRecord, TenantTally, WorkerStats
from tokenq.worker.health import Health
from tokenq.worker.loop.lanes import Ref
from tokenq.worker.loop.stages import REDIS_CALL_BOUND, Stages, redis_call_deadline_s
from tokenq.worker.metrics import NullMetrics
from tokenq.worker.pipeline.jobs import Answer
from tokenq.worker.pipeline.pipeline import BatchOutcome, Job
from tokenq.worker.settings import WorkerSettings

_T = TypeVar("_T")

STOP_GRACE_S = 5.0
"""How long a stopping worker keeps trying to publish and deregister while Redis is down."""


class Lifecycle:
    """The run state the worker's tasks share: a stop or the watchdog changes it."""

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
        self.on_stop: list[Callable[[], None]] = []
        """Called once, at the first stop (whoever asks for it: a signal, the idle timeout)."""
        self._stopped: asyncio.Future[None] | None = None

    def stop(self) -> None:
        """Mark the stop; the first one calls the ``on_stop`` hooks."""
        self.room_made.set()
        if self.stopping.is_set():
            return
        self.stop_started = self._clock()
        self.stopping.set()
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)
        for hook in self.on_stop:
            hook()

    async def until_stopped(self, work: Awaitable[_T], grace_s: float) -> _T | None:
        """``work``'s result (or error); once a stop comes it gets ``grace_s`` more, then is
        cancelled (None), a cancel redis-py swallows waited on for a second at most."""
        task: asyncio.Future[Any] = asyncio.ensure_future(work)
        await asyncio.wait({task, self._stop_future()}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and grace_s > 0:
            await asyncio.wait({task}, timeout=grace_s)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 1.0)
        return None

    def _stop_future(self) -> asyncio.Future[None]:
        """A plain future the stop resolves, one per event loop (not a task per wait)."""
        stopped = self._stopped
        if stopped is None or stopped.get_loop() is not asyncio.get_running_loop():
            stopped = self._stopped = asyncio.get_running_loop().create_future()
            if self.stopping.is_set():
                stopped.set_result(None)
        return stopped

    def reading(self) -> bool:
        return not (self.stopping.is_set() or self.hung)

    def past_grace(self) -> bool:
        """A stopping (or hung) worker gives up on an unreachable Redis after a grace."""
        started = self.stop_started
        return self.hung or (started is not None and self._clock() - started > STOP_GRACE_S)


class Recorder:
    """The worker's stats, metrics and batch log, updated together."""

    def __init__(self, consumer: str, metrics: NullMetrics, batch_log: Path | None) -> None:
        self.consumer = consumer
        self.metrics = metrics
        self.stats = WorkerStats()
        self.tenants = TenantTally()
        self._batch_log = BatchLog(batch_log)

    def batch(
        self, batch: Batch[Job[Ref]], outcome: BatchOutcome[Ref], *, packed_under: Budget,
        started_epoch_ms: int, budget_now: int,
    ) -> None:
        """One batch the device ran: totals, metrics and its batch-log line."""
        record = BatchRecord(
            worker=self.consumer, rows=batch.rows, tokens=batch.tokens,
            padded_tokens=batch.padded_tokens, cost=batch.cost,
            max_batch_tokens=packed_under.max_batch_tokens,
            max_batch_size=packed_under.max_batch_size, sealed=batch.sealed,
            device_ms=round(outcome.device_ms, 3),
            failed=sum(not done.ok for done in outcome.answered), oom_splits=outcome.oom_splits,
        )
        self.stats.record(record)
        if self.metrics.enabled:
            self.metrics.batch(
                record, [job.ref.entry_id for job in batch.payloads],
                input_tokens=[done.tokens for done in outcome.answered if done.tokens],
                started_epoch_ms=started_epoch_ms, budget=budget_now,
            )
        self._batch_log.write(record)

    def answered(self, tenant: str, answers: Sequence[Answer], now_epoch_ms: int) -> None:
        """Answers published for ``tenant``'s stream: its tally and the metrics."""
        label = self.tenants.answered(tenant, answers, now_epoch_ms)
        self.metrics.answered(answers, now_epoch_ms=now_epoch_ms, tenant=label)

    def refused_at_intake(self, answers: Sequence[Answer]) -> None:
        """Answers owed for entries that never reached the device (refused, dead letters)."""
        dead = sum(bool(a.dead_fields) for a in answers)
        self.stats.requests_failed += len(answers)
        self.stats.dead_lettered += dead
        self.metrics.dead_lettered(dead)

    def shared(self, how: str, n: int) -> None:
        """``n`` requests looked up in the result cache (``hit``, ``miss``) or answered by an
        identical request's row (``coalesced``)."""
        if not n:
            return
        if how == "hit":
            self.stats.cache_hits += n
        elif how == "miss":
            self.stats.cache_misses += n
        else:
            self.stats.coalesced += n
        self.metrics.shared(how, n)

    def reclaimed(self, n: int) -> None:
        self.stats.reclaimed += n
        self.metrics.reclaimed(n)

    def close(self) -> None:
        self._batch_log.close()


class RedisClock:
    """Epoch milliseconds on Redis's clock, estimated from the local clock and an offset."""

    def __init__(self) -> None:
        self.offset_ms = 0.0
        """Redis's clock minus ours; 0 until the first :meth:`sync`."""

    async def sync(self, client: Any) -> None:
        """Measure the offset once (one ``TIME`` round trip)."""
        before = time.time()
        seconds, micros = await client.time()
        after = time.time()
        redis_ms = int(seconds) * 1000 + int(micros) / 1000
        self.offset_ms = redis_ms - (before + after) * 500.0

    def now_ms(self) -> int:
        """Now, in epoch milliseconds on Redis's clock."""
        return int(time.time() * 1000 + self.offset_ms)


@dataclass(slots=True)
class Wiring:
    """What every part of the loop shares; ``client`` is set once the worker runs."""

    consumer: str
    settings: WorkerSettings
    lifecycle: Lifecycle
    stages: Stages
    recorder: Recorder
    health: Health
    clock: RedisClock = field(init=False, default_factory=RedisClock)
    client: Any = field(init=False, default=None)
    call_deadline: tuple[float, str] = field(init=False)
    """The deadline of one Redis read or publish attempt, and the rule it comes from."""

    def __post_init__(self) -> None:
        self.call_deadline = (redis_call_deadline_s(self.settings), REDIS_CALL_BOUND)

    def refused(self, reason: str, error: str) -> None:
        """Redis refused a publish call (OOM, READONLY, ...): counted, and /readyz says why."""
        self.recorder.metrics.redis_refused(reason)
        self.health.publish_refused(f"{reason}: {error}"[:200])

    def published(self) -> None:
        """A publish call went through: Redis takes writes again."""
        self.health.publish_ok()
