"""What a worker reports about itself: per-batch records and rolling totals."""

from __future__ import annotations

import collections
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tokenq.shared import wire
from tokenq.shared.heartbeat import OTHER_TENANTS, Totals
from tokenq.shared.keys import DEFAULT_TENANT
from tokenq.shared.text import plural, ratio

log = logging.getLogger("tokenq.worker")


@dataclass(frozen=True, slots=True)
class BatchRecord:
    worker: str
    rows: int
    tokens: int
    padded_tokens: int
    cost: int
    max_batch_tokens: int
    max_batch_size: int
    sealed: bool
    device_ms: float
    failed: int
    oom_splits: int

    def as_json(self) -> str:
        """The batch log's line, without the newline (not ``asdict``: it costs 3x)."""
        return json.dumps({name: getattr(self, name) for name in _RECORD_FIELDS})


_RECORD_FIELDS = tuple(item.name for item in fields(BatchRecord))


@dataclass(slots=True)
class WorkerStats(Totals):
    """Totals since start; published in each heartbeat."""

    started_at: float = field(default_factory=time.time)

    def record(self, batch: BatchRecord) -> None:
        self.batches += 1
        self.tokens += batch.tokens
        self.padded_tokens += batch.padded_tokens
        self.device_ms += batch.device_ms
        self.oom_splits += batch.oom_splits
        self.requests_ok += batch.rows - batch.failed
        self.requests_failed += batch.failed

    def snapshot(self) -> dict[str, Any]:
        efficiency = ratio(self.tokens, self.padded_tokens)
        return {**asdict(self), "padding_efficiency": 1.0 if efficiency is None else efficiency}

    def exit_fields(self, worker: str, now: float) -> dict[str, Any]:
        """The exit log line's fields (``--log-format json`` logs them as they are)."""
        counts = asdict(self)
        started, device_ms = counts.pop("started_at"), counts.pop("device_ms")
        return {"event": "worker_stopped", "worker": worker,
                "uptime_s": round(max(0.0, now - started), 3), **counts,
                "padding_efficiency": ratio(self.tokens, self.padded_tokens),  # None: no batch
                "device_s": round(device_ms / 1000.0, 3)}


MAX_TENANT_LABELS = 64  # most tenants one worker names; later ones count as others
LATENCY_WINDOW = 128  # a tenant's p50 is of its last this many publishes (one answer each)


class TenantTally:
    """Answers per tenant: entries settled, their counted tokens and the p50 of their
    enqueue-to-publish times. The default tenant and the first :data:`MAX_TENANT_LABELS`
    answered keep their label for the worker's life; later ones count as ``OTHER_TENANTS``."""

    def __init__(self, cap: int = MAX_TENANT_LABELS) -> None:
        self.cap = cap
        # label -> [entries settled, counted tokens]; the default tenant always named
        self._counts: dict[str, list[int]] = {DEFAULT_TENANT: [0, 0]}
        self._recent = {DEFAULT_TENANT: collections.deque[int](maxlen=LATENCY_WINDOW)}

    def label(self, tenant: str) -> str:
        """``tenant``'s label: its own name while there is room, else ``OTHER_TENANTS``."""
        named = len(self._counts) - (OTHER_TENANTS in self._counts)
        return tenant if tenant in self._counts or named < self.cap else OTHER_TENANTS

    def answered(self, tenant: str, answers: Sequence[Any], now_epoch_ms: int) -> str:
        """Count one publish of ``tenant``'s stream (its middle answer's age the p50's one
        sample); returns the tenant's label."""
        label = self.label(tenant)
        if not answers:
            return label
        counts = self._counts.get(label)
        if counts is None:
            counts = self._counts[label] = [0, 0]
            self._recent[label] = collections.deque(maxlen=LATENCY_WINDOW)
        counts[0] += len(answers)
        counts[1] += sum(answer.counted for answer in answers)
        enqueued_ms = wire.stream_id_ms(answers[len(answers) // 2].entry_id)
        if enqueued_ms is not None:
            self._recent[label].append(max(0, now_epoch_ms - enqueued_ms))
        return label

    def snapshot(self) -> dict[str, list[float]] | None:
        """The heartbeat's ``tenants``: label -> [requests, tokens, p50 ms] (None: none yet)."""
        return {label: [requests, tokens, statistics.median(self._recent[label] or [0])]
                for label, (requests, tokens) in self._counts.items() if requests} or None


def exit_line(fields: dict[str, Any]) -> str:
    """:meth:`WorkerStats.exit_fields` as one line a person reads at a glance."""
    efficiency = fields["padding_efficiency"]
    return (
        f"worker {fields['worker']} stopped after {_duration(fields['uptime_s'])}: "
        f"{plural(fields['requests_ok'], 'request')} ok, {fields['requests_failed']:,} failed, "
        f"{plural(fields['batches'], 'batch')}, {plural(fields['tokens'], 'token')} "
        f"(padding efficiency {'-' if efficiency is None else format(efficiency, '.2f')}), "
        f"{fields['device_s']:,.1f}s on the device, {plural(fields['oom_splits'], 'OOM split')}, "
        f"{fields['reclaimed']:,} reclaimed, {fields['dead_lettered']:,} dead-lettered"
    )


def _duration(seconds: float) -> str:  # 42.1s, 5m12s, 3h07m
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class BatchLog:
    """Appends one JSON line per batch to a file, when one is given."""

    def __init__(self, path: Path | None) -> None:
        self._file = path.open("a", encoding="utf-8", buffering=1) if path else None

    def write(self, record: BatchRecord) -> None:
        log.debug(
            "batch rows=%d tokens=%d padded=%d cost=%d/%d ms=%.1f failed=%d",
            record.rows, record.tokens, record.padded_tokens, record.cost,
            record.max_batch_tokens, record.device_ms, record.failed,
        )
        if self._file is not None:
            self._file.write(record.as_json() + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
