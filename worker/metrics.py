"""Prometheus metrics of one worker process (``--metrics-port``; off by default), the
per-request histograms fed a whole batch in one call."""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tokenq.shared import wire

if TYPE_CHECKING:
    from tokenq.worker.batch_stats import BatchRecord
    from tokenq.worker.endpoint import WsgiApp
    from tokenq.worker.pipeline.jobs import Answer
    from tokenq.worker.settings import WorkerSettings

log = logging.getLogger("tokenq.worker")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = tuple(float(1 << k) for k in range(6, 19))  # 64 .. 262144
INPUT_BUCKETS = tuple(float(1 << k) for k in range(2, 16))  # 4 .. 32768
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

    def tokenized(self, seconds: float) -> None:
        """One read was tokenized (the admission call, in its thread) in ``seconds``."""

    def batch(
        self, record: BatchRecord, entry_ids: Iterable[bytes], *,
        input_tokens: Sequence[int], started_epoch_ms: int, budget: int,
    ) -> None:
        """One batch ran: its size, tokens, padding, queue wait, device time and ``input_tokens``.
        """

    def answered(self, answers: Sequence[Answer], *, now_epoch_ms: int) -> None:
        """Replies published, counted by outcome, and each one's time since enqueue."""

    def reclaimed(self, n: int) -> None:
        """``n`` entries taken over from dead or stuck consumers."""

    def dead_lettered(self, n: int) -> None:
        """``n`` requests moved to the dead stream."""

    def redis_refused(self, reason: str) -> None:
        """Redis refused a call for its own state (``oom``, ``readonly``, ...); it is retried."""

    def queue_depth(self, length: int, pending: int, lag: int) -> None:
        """The queue as Redis sees it (refreshed every heartbeat): what autoscalers read."""

    def wsgi_app(self) -> WsgiApp | None:
        """The ``/metrics`` application (None: no metrics to serve)."""
        return None


class Metrics(NullMetrics):
    """The worker's metrics in a registry of their own."""

    enabled = True

    def __init__(self, queue: str) -> None:
        import prometheus_client
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            GCCollector,
            Histogram,
            PlatformCollector,
            ProcessCollector,
        )

        # Process-wide and read at each scrape (the variable is read once at import,
        # maybe already done). prometheus-client < 0.20 has no switch.
        disable = getattr(prometheus_client, "disable_created_metrics", None)
        if disable is not None:
            disable()
        self.registry = registry = CollectorRegistry()
        self.queue = queue
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=registry)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ("queue",), registry=registry).labels(queue)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, ("queue",), buckets=buckets,
                             registry=registry).labels(queue)

        def per_request(name: str, doc: str, buckets: Sequence[float]) -> BatchHistogram:
            return BatchHistogram(name, doc, buckets, {"queue": queue}, registry)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, ("queue",), registry=registry).labels(queue)

        self._requests = Counter("tokenq_requests", "Requests answered, by outcome (ok or error "
                                 "code)", ("queue", "outcome"), registry=registry)
        self._refusals = Counter(
            "tokenq_redis_refusals", "Calls Redis refused for its own state (oom, readonly, ...), "
            "retried", ("queue", "reason"), registry=registry)
        self._batches = counter("tokenq_batches", "Batches run on the device")
        self._tokens = counter("tokenq_tokens", "Real (unpadded) tokens run")
        self._padded = counter("tokenq_padded_tokens", "Tokens run including padding")
        self._oom_splits = counter("tokenq_oom_splits", "Batches split after out-of-memory")
        self._reclaimed = counter("tokenq_reclaimed", "Entries claimed from other consumers")
        self._dead = counter("tokenq_dead_lettered", "Requests moved to the dead stream")
        self._rows = histogram("tokenq_batch_rows", "Rows (sequences) per batch", ROW_BUCKETS)
        self._batch_tokens = histogram(
            "tokenq_batch_tokens", "Real tokens per batch", TOKEN_BUCKETS)
        self._efficiency = histogram("tokenq_batch_padding_efficiency_ratio",
                                     "Real / padded tokens per batch", EFFICIENCY_BUCKETS)
        self._infer = histogram(
            "tokenq_inference_seconds", "Time one batch spent in the backend", INFER_BUCKETS)
        self._tokenize = histogram(
            "tokenq_tokenization_seconds",
            "Time to admit one read: decode-checks and exact tokenization of its requests",
            INFER_BUCKETS,
        )
        self._wait = per_request(
            "tokenq_queue_wait_seconds",
            "From enqueue (the stream entry id's time) to the start of its batch", WAIT_BUCKETS,
        )
        self._duration = per_request(
            "tokenq_request_duration_seconds",
            "From enqueue (the stream entry id's time) to its reply's publish", WAIT_BUCKETS,
        )
        self._input = per_request(
            "tokenq_request_input_tokens", "Tokens of each request run (after truncation)",
            INPUT_BUCKETS,
        )
        self._budget = gauge("tokenq_batch_budget_tokens", "Token budget now in force")
        self._length = gauge(
            "tokenq_queue_length", "Entries in the request stream (XLEN): waiting or held")
        self._pending = gauge(
            "tokenq_queue_pending", "Entries delivered to some worker and not yet answered")
        self._lag = gauge("tokenq_queue_lag", "Entries no worker has read yet (the group's lag)")
        self._info = Gauge(
            "tokenq_worker_info", "Static facts about the worker (value is always 1)",
            ("queue", "consumer", "model", "backend", "device"), registry=registry,
        )
        self._requests.labels(queue, "ok")  # present from the start, so rate() works at once
        self._refusals.labels(queue, "oom")  # so an alert on it has a series before the first

    def describe(self, **info: str) -> None:
        labels = {name: str(info.get(name, "")) for name in
                  ("consumer", "model", "backend", "device")}
        self._info.labels(queue=self.queue, **labels).set(1)

    def tokenized(self, seconds: float) -> None:
        self._tokenize.observe(seconds)

    def batch(
        self, record: BatchRecord, entry_ids: Iterable[bytes], *,
        input_tokens: Sequence[int], started_epoch_ms: int, budget: int,
    ) -> None:
        self._batches.inc()
        self._tokens.inc(record.tokens)
        self._padded.inc(record.padded_tokens)
        if record.oom_splits:
            self._oom_splits.inc(record.oom_splits)
        self._rows.observe(record.rows)
        self._batch_tokens.observe(record.tokens)
        if record.padded_tokens:
            self._efficiency.observe(record.tokens / record.padded_tokens)
        self._infer.observe(record.device_ms / 1000.0)
        self._budget.set(budget)
        self._wait.observe_many(_ages_s(entry_ids, started_epoch_ms))
        if input_tokens:
            self._input.observe_many(input_tokens)

    def answered(self, answers: Sequence[Answer], *, now_epoch_ms: int) -> None:
        counts: dict[str, int] = {}
        replied = []
        for answer in answers:
            outcome = answer.outcome
            if outcome is None:
                continue  # entry deleted while pending: acked, nobody to answer
            counts[outcome] = counts.get(outcome, 0) + 1
            replied.append(answer.entry_id)
        for outcome, n in counts.items():
            self._requests.labels(self.queue, outcome).inc(n)
        self._duration.observe_many(_ages_s(replied, now_epoch_ms))

    def reclaimed(self, n: int) -> None:
        if n:
            self._reclaimed.inc(n)

    def dead_lettered(self, n: int) -> None:
        if n:
            self._dead.inc(n)

    def redis_refused(self, reason: str) -> None:
        self._refusals.labels(self.queue, reason).inc()

    def queue_depth(self, length: int, pending: int, lag: int) -> None:
        self._length.set(length)
        self._pending.set(pending)
        self._lag.set(lag)

    def wsgi_app(self) -> WsgiApp:
        from prometheus_client import make_wsgi_app

        return make_wsgi_app(self.registry)  # type: ignore[no-any-return]


def create(settings: WorkerSettings) -> NullMetrics:
    """Metrics for a worker process: real when ``metrics_port`` is set (and the library is in)."""
    if not settings.metrics_port:
        return NullMetrics()
    try:
        return Metrics(settings.queue)
    except ImportError:
        log.warning("--metrics-port needs prometheus-client (pip install 'tokenq[worker]'); "
                    "/metrics is off, /livez and /readyz still answer")
        return NullMetrics()


def _ages_s(entry_ids: Iterable[bytes], now_epoch_ms: int) -> list[float]:
    """Seconds from each entry's enqueue (its stream id, Redis's clock) to ``now`` (the
    worker's estimate of that clock); negatives clip to 0, malformed ids are skipped."""
    ages = []
    for entry_id in entry_ids:
        enqueued_ms = wire.stream_id_ms(entry_id)
        if enqueued_ms is not None:
            ages.append(max(0, now_epoch_ms - enqueued_ms) / 1000.0)
    return ages


class BatchHistogram:
    """A histogram series fed in bulk; register it on a ``CollectorRegistry``."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float],
        labels: dict[str, str], registry: Any,
    ) -> None:
        bounds = sorted(float(b) for b in buckets if not math.isinf(b))
        if not bounds:
            raise ValueError(f"{name}: a histogram needs at least one finite bucket")
        self.name = name
        self._doc = documentation
        self._bounds = bounds
        self._labels = dict(labels)
        self._counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: Iterable[float]) -> None:
        """Add every value (scraped from another thread: one lock for the whole call)."""
        bounds, place = self._bounds, bisect.bisect_left
        with self._lock:
            counts = self._counts
            total = 0.0
            for value in values:
                counts[place(bounds, value)] += 1  # first bound >= value: Prometheus's le
                total += value
            self._sum += total

    def describe(self) -> list[Any]:
        """The family without samples, so the registry can refuse a duplicate name."""
        from prometheus_client.core import HistogramMetricFamily

        return [HistogramMetricFamily(self.name, self._doc, labels=list(self._labels))]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip([*self._bounds, math.inf], counts, strict=True):
            running += count
            cumulative.append((floatToGoString(bound), running))
        family = HistogramMetricFamily(self.name, self._doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), cumulative, total)
        yield family
