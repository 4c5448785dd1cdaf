"""Prometheus metrics of one worker process (``--metrics-port``; off by default), the
per-request histograms fed a whole batch in one call."""

from __future__ import annotations

import bisect
import collections
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tokenq.shared import wire
from tokenq.shared.keys import DEFAULT_TENANT

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


_SERIES: dict[str, tuple[str, str, str, Any]] = {
    # attribute: (kind, name, help, buckets, or the second label of a family)
    "_requests": ("counter", "tokenq_requests", "Requests answered, by outcome (ok or error code)",
                  "outcome"),
    "_refusals": ("counter", "tokenq_redis_refusals",
                  "Calls Redis refused for its own state (oom, readonly, ...), retried", "reason"),
    "_batches": ("counter", "tokenq_batches", "Batches run on the device", None),
    "_tokens": ("counter", "tokenq_tokens", "Real (unpadded) tokens run", None),
    "_padded": ("counter", "tokenq_padded_tokens", "Tokens run including padding", None),
    "_oom_splits": ("counter", "tokenq_oom_splits", "Batches split after out-of-memory", None),
    "_reclaimed": ("counter", "tokenq_reclaimed", "Entries claimed from other consumers", None),
    "_dead": ("counter", "tokenq_dead_lettered", "Requests moved to the dead stream", None),
    "_rows": ("histogram", "tokenq_batch_rows", "Rows (sequences) per batch", ROW_BUCKETS),
    "_batch_tokens": ("histogram", "tokenq_batch_tokens", "Real tokens per batch", TOKEN_BUCKETS),
    "_efficiency": ("histogram", "tokenq_batch_padding_efficiency_ratio",
                    "Real / padded tokens per batch", EFFICIENCY_BUCKETS),
    "_infer": ("histogram", "tokenq_inference_seconds", "Time one batch spent in the backend",
               INFER_BUCKETS),
    "_tokenize": ("histogram", "tokenq_tokenization_seconds",
                  "Time to admit one read: decode-checks and exact tokenization of its requests",
                  INFER_BUCKETS),
    "_wait": ("histogram", "tokenq_queue_wait_seconds",
              "From enqueue (the stream entry id's time) to the start of its batch", WAIT_BUCKETS),
    "_duration": ("histogram", "tokenq_request_duration_seconds",
                  "From enqueue (the stream entry id's time) to its reply's publish", WAIT_BUCKETS),
    "_input": ("histogram", "tokenq_request_input_tokens",
               "Tokens of each request run (after truncation)", INPUT_BUCKETS),
    "_budget": ("gauge", "tokenq_batch_budget_tokens", "Token budget now in force", None),
    "_length": ("gauge", "tokenq_queue_length",
                "Entries in the request stream (XLEN): waiting or held", None),
    "_pending": ("gauge", "tokenq_queue_pending",
                 "Entries delivered to some worker and not yet answered", None),
    "_lag": ("gauge", "tokenq_queue_lag", "Entries no worker has read yet (the group's lag)", None),
    "_shared": ("counter", "tokenq_cache_requests", "Requests looked up in the result cache (hit, "
                "miss) or answered by an identical request's row (coalesced)", "how"),
    "_cache_bytes": ("gauge", "tokenq_cache_bytes",
                     "The result cache's bytes, as its last write counted them", None),
    "_pending_tokens": ("gauge", "tokenq_queue_pending_tokens", "Tokens of the request stream's "
                        "entries (waiting or held), as enqueue estimated", None),
    "_tenant_requests": ("counter", "tokenq_tenant_requests", "Requests answered, by tenant (64 "
                         "named per worker, the rest as (others))", "tenant"),
    "_tenant_tokens": ("counter", "tokenq_tenant_tokens", "Counted tokens of the requests "
                       "answered, by tenant (the unit of pending tokens)", "tenant"),
    "_tenant_duration": ("histogram", "tokenq_tenant_request_duration_seconds",
                         "From enqueue to its reply's publish, by tenant", "tenant"),
    "_tenant_pending": ("gauge", "tokenq_tenant_pending_tokens", "Pending tokens by tenant (the "
                        "64 with the most, the rest as (others))", "tenant"),
}


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
        """One batch ran: its size, tokens, padding, queue wait, device time, input tokens."""

    def answered(self, answers: Sequence[Answer], *, now_epoch_ms: int,
                 tenant: str = DEFAULT_TENANT) -> None:
        """Replies published: by outcome, time since enqueue, and by ``tenant`` (a label)."""

    def reclaimed(self, n: int) -> None:
        """``n`` entries taken over from dead or stuck consumers."""

    def dead_lettered(self, n: int) -> None:
        """``n`` requests moved to the dead stream."""

    def redis_refused(self, reason: str) -> None:
        """Redis refused a call for its own state (``oom``, ``readonly``, ...); it is retried."""

    def queue_depth(self, length: int, pending: int, lag: int, tokens: int = 0) -> None:
        """The queue as Redis sees it, each heartbeat: what autoscalers read."""

    def tenant_pending(self, tokens: dict[str, int]) -> None:
        """Each tenant label's pending tokens (bounded by :func:`queue_depth.bounded`)."""

    def shared(self, how: str, n: int) -> None:
        """``n`` requests found in the result cache, missed, or ``coalesced`` with another."""

    def cache_bytes(self, n: int) -> None:
        """The result cache's bytes, as its last write counted them."""

    def wsgi_app(self) -> WsgiApp | None:
        """The ``/metrics`` application (None: no metrics to serve)."""
        return None


class Metrics(NullMetrics):
    """The worker's metrics in a registry of their own."""

    enabled = True

    def __init__(self, queue: str) -> None:
        import prometheus_client as prom

        prom.disable_created_metrics()  # process-wide, read at each scrape
        self.registry = registry = prom.CollectorRegistry()
        self.queue = queue
        for collector in (prom.ProcessCollector, prom.PlatformCollector, prom.GCCollector):
            collector(registry=registry)
        kinds = {"counter": prom.Counter, "gauge": prom.Gauge, "histogram": prom.Histogram}
        for attr, (kind, name, doc, extra) in _SERIES.items():
            if isinstance(extra, str):  # a second label: the family itself
                buckets = {"buckets": WAIT_BUCKETS} if kind == "histogram" else {}
                family = kinds[kind](name, doc, ("queue", extra), registry=registry, **buckets)
                setattr(self, attr, family)
            else:  # a series labelled by queue alone
                buckets = {"buckets": extra} if extra else {}
                family = kinds[kind](name, doc, ("queue",), registry=registry, **buckets)
                setattr(self, attr, family.labels(queue))
        for family in (self._tenant_requests, self._tenant_tokens, self._tenant_duration,
                       self._tenant_pending):
            family.labels(queue, DEFAULT_TENANT)  # present from the start, as _requests'
        self._pending_labels = {DEFAULT_TENANT}
        self._info = prom.Gauge(
            "tokenq_worker_info", "Static facts about the worker (value is always 1)",
            ("queue", "consumer", "model", "backend", "device"), registry=registry,
        )
        self._requests.labels(queue, "ok")  # present from the start, so rate() works at once
        for how in ("hit", "miss", "coalesced"):
            self._shared.labels(queue, how)
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
        self._oom_splits.inc(record.oom_splits)
        self._rows.observe(record.rows)
        self._batch_tokens.observe(record.tokens)
        if record.padded_tokens:
            self._efficiency.observe(record.tokens / record.padded_tokens)
        self._infer.observe(record.device_ms / 1000.0)
        self._budget.set(budget)
        observe_many(self._wait, _ages_s(entry_ids, started_epoch_ms))
        observe_many(self._input, input_tokens)

    def answered(self, answers: Sequence[Answer], *, now_epoch_ms: int,
                 tenant: str = DEFAULT_TENANT) -> None:
        # An entry deleted while pending has no outcome: acked, nobody to answer.
        replied = [answer for answer in answers if answer.outcome is not None]
        for outcome, n in collections.Counter(answer.outcome for answer in replied).items():
            self._requests.labels(self.queue, outcome).inc(n)
        ages = _ages_s((a.entry_id for a in replied), now_epoch_ms)
        observe_many(self._duration, ages)
        if replied:
            self._tenant_requests.labels(self.queue, tenant).inc(len(replied))
            self._tenant_tokens.labels(self.queue, tenant).inc(sum(a.counted for a in replied))
            observe_many(self._tenant_duration.labels(self.queue, tenant), ages)

    def tenant_pending(self, tokens: dict[str, int]) -> None:
        for gone in self._pending_labels - tokens.keys():
            self._tenant_pending.remove(self.queue, gone)
        for tenant, n in tokens.items():
            self._tenant_pending.labels(self.queue, tenant).set(n)
        self._pending_labels = set(tokens)

    def reclaimed(self, n: int) -> None:
        self._reclaimed.inc(n)

    def dead_lettered(self, n: int) -> None:
        self._dead.inc(n)

    def redis_refused(self, reason: str) -> None:
        self._refusals.labels(self.queue, reason).inc()

    def queue_depth(self, length: int, pending: int, lag: int, tokens: int = 0) -> None:
        self._pending_tokens.set(tokens)
        self._length.set(length)
        self._pending.set(pending)
        self._lag.set(lag)

    def shared(self, how: str, n: int) -> None:
        self._shared.labels(self.queue, how).inc(n)

    def cache_bytes(self, n: int) -> None:
        self._cache_bytes.set(n)

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


def observe_many(histogram: Any, values: Iterable[float]) -> None:
    """Add every value to one series of a ``prometheus_client`` histogram, one update per
    bucket instead of per value: the bucket and sum values its own ``observe`` updates."""
    bounds = histogram._upper_bounds  # the last one is +Inf
    counts = [0] * len(bounds)
    total = 0.0
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1  # first bound >= value: Prometheus's le
        total += value
    for bucket, count in zip(histogram._buckets, counts, strict=True):
        if count:
            bucket.inc(count)
    histogram._sum.inc(total)
