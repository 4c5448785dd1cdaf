"""Prometheus metrics: scraped from a real worker after a run, and the registry in isolation."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenq.producer import Client
from tokenq.shared.errors import ConfigError, ErrorCode
from tokenq.shared.settings import WorkerSettings
from tokenq.worker import metrics
from tokenq.worker.backends.sim import SIM_FAIL_MARKER
from tokenq.worker.pipeline.jobs import Answer, error_answer
from tokenq.worker.stats import BatchRecord
from tokenq.worker.tooling.embedded import free_port

pytest_plugins = ("tests.cli_fixtures",)

DOCUMENTED = {
    "tokenq_requests", "tokenq_batches", "tokenq_tokens", "tokenq_padded_tokens",
    "tokenq_oom_splits", "tokenq_reclaimed", "tokenq_dead_lettered", "tokenq_batch_rows",
    "tokenq_batch_tokens", "tokenq_batch_padding_efficiency", "tokenq_queue_wait_seconds",
    "tokenq_inference_seconds", "tokenq_batch_budget_tokens", "tokenq_worker_info",
}


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """metric sample name -> {sorted label items: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def settled_scrape(port: int, queue: str, answered: int) -> dict[str, dict[tuple, float]]:
    """A scrape once the worker has counted ``answered`` replies.

    A reply is counted when its publish returns, which may be a moment after
    the caller already popped it; so wait (bounded) for the count, not a sleep.
    """
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(port)
        counted = sum(value for labels, value in samples.get("tokenq_requests_total", {}).items()
                      if ("queue", queue) in labels)
        if counted >= answered or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def only(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    matches = [value for key, value in samples[name].items()
               if labels.items() <= dict(key).items()]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


def test_metrics_endpoint_after_a_run(sim_worker, redis_url, queue_name):
    port = free_port()
    worker = sim_worker("--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                        "--max-batch-tokens", "8192")
    texts = [f"request number {i} " + "word " * (i % 7) for i in range(60)]
    with Client(redis_url=redis_url, queue=queue_name) as client:
        results = client.infer_many([*texts, f"poison {SIM_FAIL_MARKER}"], timeout_s=30,
                                    return_exceptions=True)
    assert sum(not isinstance(r, Exception) for r in results) == 60
    samples = settled_scrape(port, queue_name, answered=61)
    names = {family.name for family in text_string_to_metric_families(
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())}
    assert names >= DOCUMENTED, DOCUMENTED - names
    q = {"queue": queue_name}
    assert only(samples, "tokenq_requests_total", outcome="ok", **q) == 60
    assert only(samples, "tokenq_requests_total", outcome="inference_failed", **q) == 1
    batches = only(samples, "tokenq_batches_total", **q)
    logged = worker.batches()
    assert batches == len(logged) >= 1
    assert only(samples, "tokenq_batch_rows_count", **q) == batches
    assert only(samples, "tokenq_batch_rows_sum", **q) == sum(b["rows"] for b in logged)
    assert only(samples, "tokenq_tokens_total", **q) == sum(b["tokens"] for b in logged)
    assert only(samples, "tokenq_padded_tokens_total", **q) == sum(
        b["padded_tokens"] for b in logged)
    assert only(samples, "tokenq_queue_wait_seconds_count", **q) == 61
    assert 0 <= only(samples, "tokenq_queue_wait_seconds_sum", **q) < 61 * 30
    assert only(samples, "tokenq_inference_seconds_count", **q) == batches
    efficiency = only(samples, "tokenq_batch_padding_efficiency_sum", **q) / batches
    assert 0 < efficiency <= 1
    assert only(samples, "tokenq_batch_budget_tokens", **q) == 8192
    assert only(samples, "tokenq_oom_splits_total", **q) == 0
    assert only(samples, "tokenq_reclaimed_total", **q) == 0
    assert only(samples, "tokenq_dead_lettered_total", **q) == 0
    assert only(samples, "tokenq_worker_info", consumer=worker.name, backend="sim", **q) == 1


def test_worker_registries_do_not_collide():
    first, second = metrics.Metrics("a"), metrics.Metrics("b")
    record = BatchRecord(worker="w", rows=2, tokens=30, padded_tokens=40, cost=40,
                         max_batch_tokens=100, max_batch_size=8, sealed=True, device_ms=5.0,
                         failed=0, oom_splits=1)
    first.batch(record, [b"1000-0", b"bad-id"], started_epoch_ms=3000, budget=90)
    first.answered([Answer(b"1-0", "k", b"x", ok=True),
                    error_answer(b"2-0", "r", "k", ErrorCode.TOO_LONG, "long"),
                    Answer(b"3-0", None, b"", ok=False)])
    first.reclaimed(3)
    first.dead_lettered(2)
    text = first.text()
    assert 'tokenq_batches_total{queue="a"} 1.0' in text
    assert 'tokenq_requests_total{outcome="ok",queue="a"} 1.0' in text
    assert 'tokenq_requests_total{outcome="too_long",queue="a"} 1.0' in text
    assert 'tokenq_oom_splits_total{queue="a"} 1.0' in text
    assert 'tokenq_reclaimed_total{queue="a"} 3.0' in text
    assert 'tokenq_dead_lettered_total{queue="a"} 2.0' in text
    assert 'tokenq_batch_budget_tokens{queue="a"} 90.0' in text
    assert 'tokenq_queue_wait_seconds_sum{queue="a"} 2.0' in text  # bad id skipped
    assert 'tokenq_batches_total{queue="b"} 0.0' in second.text()


def test_metrics_are_off_by_default_and_a_taken_port_is_a_config_error():
    assert not metrics.create(WorkerSettings()).enabled
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = WorkerSettings(metrics_port=taken.getsockname()[1], metrics_host="127.0.0.1")
        with pytest.raises(ConfigError, match="cannot serve metrics"):
            metrics.create(settings)
    null = metrics.NullMetrics()
    null.batch(None, [], started_epoch_ms=0, budget=1)  # type: ignore[arg-type]
    null.answered([])
    null.reclaimed(1)
    null.dead_lettered(1)
    null.close()


def test_worker_logs_json_lines_with_startup_and_batch_lines(sim_worker, redis_url, queue_name):
    worker = sim_worker("--log-json", "--log-level", "DEBUG")
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.infer("log me", timeout_s=20)
    worker.terminate()
    records = [json.loads(line) for line in worker.output().splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    messages = [(r["level"], r["message"]) for r in records]
    assert any(level == "INFO" and "budget=" in m and worker.name in m for level, m in messages)
    assert any(level == "DEBUG" and m.startswith("batch rows=1 ") for level, m in messages)
    assert any(level == "INFO" and m.startswith("stopped:") for level, m in messages)
