"""What the worker reports about its work, recorded in one call per event, so no call
site updates one sink (heartbeat totals, metrics, batch log) and forgets another."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenq.shared.packer import Batch, Budget
from tokenq.worker.batch_stats import BatchLog, BatchRecord, WorkerStats
from tokenq.worker.loop.lanes import Ref
from tokenq.worker.metrics import NullMetrics
from tokenq.worker.pipeline.jobs import Answer
from tokenq.worker.pipeline.pipeline import BatchOutcome, Job


class Recorder:
    """The worker's stats, metrics and batch log, updated together."""

    def __init__(self, consumer: str, metrics: NullMetrics, batch_log: Path | None) -> None:
        self.consumer = consumer
        self.metrics = metrics
        self.stats = WorkerStats()
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

    def refused_at_intake(self, answers: Sequence[Answer]) -> None:
        """Answers owed for entries that never reached the device (refused, dead letters)."""
        dead = sum(bool(a.dead_fields) for a in answers)
        self.stats.requests_failed += len(answers)
        self.stats.dead_lettered += dead
        self.metrics.dead_lettered(dead)

    def reclaimed(self, n: int) -> None:
        self.stats.reclaimed += n
        self.metrics.reclaimed(n)

    def close(self) -> None:
        self._batch_log.close()
