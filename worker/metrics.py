"""Prometheus metrics of one worker process (``--metrics-port``; off by default).

Each :class:`Metrics` owns its own ``CollectorRegistry``, so two workers in
one process (tests, an embedding app) never collide on metric names, and
the HTTP endpoint serves exactly that worker's numbers. The loop calls the
hooks right beside the code they measure (TEI's habit); with metrics off it
holds a :class:`NullMetrics` whose hooks do nothing and which never imports
``prometheus_client``.

Every name starts with ``tokenq_`` and carries a ``queue`` label; the list,
with units and how to read them, is docs/METRICS.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tokenq.shared.errors import ConfigError

if TYPE_CHECKING:
    from tokenq.shared.settings import WorkerSettings
    from tokenq.worker.pipeline.jobs import Answer
    from tokenq.worker.stats import BatchRecord

log = logging.getLogger("tokenq.worker")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = tuple(float(1 << k) for k in range(6, 19))  # 64 .. 262144
EFFICIENCY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
INFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0, 10.0)


class NullMetrics:
    """The hooks, doing nothing: what a worker without ``--metrics-port`` holds."""

    enabled = False

    def describe(self, **info: str) -> None:
        """Static facts about the worker (model, backend, device, consumer)."""

    def batch(
        self, record: BatchRecord, entry_ids: Iterable[bytes], *,
        started_epoch_ms: int, budget: int,
    ) -> None:
        """One batch ran: its size, tokens, padding, queue wait and device time."""

    def answered(self, answers: Sequence[Answer]) -> None:
        """Replies published, counted by outcome (``ok`` or the error code)."""

    def reclaimed(self, n: int) -> None:
        """``n`` entries taken over from dead or stuck consumers."""

    def dead_lettered(self, n: int) -> None:
        """``n`` requests moved to the dead stream."""

    def budget(self, tokens: int) -> None:
        """The batch budget now in force (it drops after an OOM and climbs back)."""

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Start the HTTP endpoint (no-op here)."""

    def close(self) -> None:
        """Stop the HTTP endpoint."""


class Metrics(NullMetrics):
    """The worker's metrics in a registry of their own."""

    enabled = True

    def __init__(self, queue: str, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        self.queue = queue
        self._server: Any = None
        self._thread: Any = None

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Counter(name, doc, ("queue", *labels), registry=self.registry)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, ("queue",), buckets=buckets, registry=self.registry)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, ("queue",), registry=self.registry)

        self._requests = counter(
            "tokenq_requests", "Requests answered, by outcome (ok or error code)", ("outcome",)
        )
        self._batches = counter("tokenq_batches", "Batches run on the device")
        self._tokens = counter("tokenq_tokens", "Real (unpadded) tokens run")
        self._padded = counter("tokenq_padded_tokens", "Tokens run including padding")
        self._oom_splits = counter("tokenq_oom_splits", "Batches split after out-of-memory")
        self._reclaimed = counter("tokenq_reclaimed", "Entries claimed from other consumers")
        self._dead = counter("tokenq_dead_lettered", "Requests moved to the dead stream")
        self._rows = histogram("tokenq_batch_rows", "Rows (sequences) per batch", ROW_BUCKETS)
        self._batch_tokens = histogram(
            "tokenq_batch_tokens", "Real tokens per batch", TOKEN_BUCKETS
        )
        self._efficiency = histogram(
            "tokenq_batch_padding_efficiency", "Real / padded tokens per batch",
            EFFICIENCY_BUCKETS,
        )
        self._wait = histogram(
            "tokenq_queue_wait_seconds",
            "From enqueue (the stream entry id's time) to the start of its batch", WAIT_BUCKETS,
        )
        self._infer = histogram(
            "tokenq_inference_seconds", "Time one batch spent in the backend", INFER_BUCKETS
        )
        self._budget = gauge("tokenq_batch_budget_tokens", "Token budget now in force")
        self._info = Gauge(
            "tokenq_worker_info", "Static facts about the worker (value is always 1)",
            ("queue", "consumer", "model", "backend", "device"), registry=self.registry,
        )
        for outcome in ("ok",):  # present from the start, so rate() works at once
            self._requests.labels(queue, outcome)
        for metric in (self._batches, self._tokens, self._padded, self._oom_splits,
                       self._reclaimed, self._dead):
            metric.labels(queue)

    def describe(self, **info: str) -> None:
        labels = {name: str(info.get(name, "")) for name in
                  ("consumer", "model", "backend", "device")}
        self._info.labels(queue=self.queue, **labels).set(1)

    def batch(
        self, record: BatchRecord, entry_ids: Iterable[bytes], *,
        started_epoch_ms: int, budget: int,
    ) -> None:
        q = self.queue
        self._batches.labels(q).inc()
        self._tokens.labels(q).inc(record.tokens)
        self._padded.labels(q).inc(record.padded_tokens)
        if record.oom_splits:
            self._oom_splits.labels(q).inc(record.oom_splits)
        self._rows.labels(q).observe(record.rows)
        self._batch_tokens.labels(q).observe(record.tokens)
        if record.padded_tokens:
            self._efficiency.labels(q).observe(record.tokens / record.padded_tokens)
        self._infer.labels(q).observe(record.device_ms / 1000.0)
        self._budget.labels(q).set(budget)
        wait = self._wait.labels(q)
        for entry_id in entry_ids:
            enqueued_ms = _entry_ms(entry_id)
            if enqueued_ms is not None:  # clip: worker and Redis clocks may disagree a little
                wait.observe(max(0.0, started_epoch_ms - enqueued_ms) / 1000.0)

    def answered(self, answers: Sequence[Answer]) -> None:
        counts: dict[str, int] = {}
        for answer in answers:
            outcome = answer.outcome
            if outcome is None:
                continue  # entry deleted while pending: acked, nobody to answer
            counts[outcome] = counts.get(outcome, 0) + 1
        for outcome, n in counts.items():
            self._requests.labels(self.queue, outcome).inc(n)

    def reclaimed(self, n: int) -> None:
        if n:
            self._reclaimed.labels(self.queue).inc(n)

    def dead_lettered(self, n: int) -> None:
        if n:
            self._dead.labels(self.queue).inc(n)

    def budget(self, tokens: int) -> None:
        self._budget.labels(self.queue).set(tokens)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def text(self) -> str:
        """The exposition text, as a scrape would see it (tests, debugging)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


def create(settings: WorkerSettings) -> NullMetrics:
    """Metrics for a worker process: real and served when ``metrics_port`` is set."""
    if not settings.metrics_port:
        return NullMetrics()
    try:
        metrics = Metrics(settings.queue)
    except ImportError:
        log.warning("--metrics-port needs prometheus-client (pip install 'tokenq[worker]'); "
                    "metrics are off")
        return NullMetrics()
    try:
        metrics.serve(settings.metrics_port, settings.metrics_host)
    except OSError as exc:  # port taken, address not local: say which, exit 2
        raise ConfigError(
            f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: {exc}"
        ) from exc
    return metrics


def _entry_ms(entry_id: bytes | str) -> int | None:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    head = text.split("-", 1)[0]
    return int(head) if head.isdigit() else None
