"""Prometheus metrics: scraped from a real worker after a run, and the registry in isolation;
the queue-depth reading against a real Redis; the worker's exit line, as text and as JSON."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.error
import urllib.request

import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from tests.worker.test_dashboard import documented_metrics
from tokenq.producer import Client
from tokenq.shared import keys
from tokenq.shared.errors import ConfigError, ErrorCode
from tokenq.shared.queue_depth import Depth
from tokenq.worker import endpoint, metrics
from tokenq.worker.backends.sim import SIM_FAIL_MARKER
from tokenq.worker.batch_stats import BatchRecord, WorkerStats, exit_line
from tokenq.worker.health import Health
from tokenq.worker.loop import beat
from tokenq.worker.metrics import observe_many
from tokenq.worker.pipeline.jobs import Answer, error_answer
from tokenq.worker.settings import WorkerSettings
from tokenq.worker.tooling.embedded import free_port

pytest_plugins = ("tests.cli_fixtures",)

PROCESS = {"process_cpu_seconds_total", "process_resident_memory_bytes", "python_info",
           "python_gc_objects_collected_total"}
"""A few of the default collectors' series (process_* is Linux only)."""


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
    assert not [name for name in samples if name.endswith("_created")]
    assert set(samples) >= PROCESS, PROCESS - set(samples)
    missing = [name for name in documented_metrics()
               if name not in samples and f"{name}_count" not in samples]
    assert not missing, missing
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
    assert only(samples, "tokenq_request_duration_seconds_count", **q) == 61
    durations = only(samples, "tokenq_request_duration_seconds_sum", **q)
    assert only(samples, "tokenq_queue_wait_seconds_sum", **q) <= durations < 61 * 30
    assert only(samples, "tokenq_request_input_tokens_count", **q) == 61  # the poison ran too
    assert only(samples, "tokenq_request_input_tokens_sum", **q) == sum(
        b["tokens"] for b in logged)
    assert only(samples, "tokenq_tokenization_seconds_count", **q) >= 1
    efficiency = only(samples, "tokenq_batch_padding_efficiency_ratio_sum", **q) / batches
    assert 0 < efficiency <= 1
    assert only(samples, "tokenq_batch_budget_tokens", **q) == 8192
    assert only(samples, "tokenq_oom_splits_total", **q) == 0
    assert only(samples, "tokenq_reclaimed_total", **q) == 0
    assert only(samples, "tokenq_dead_lettered_total", **q) == 0
    assert only(samples, "tokenq_worker_info", consumer=worker.name, backend="sim", **q) == 1
    # Refreshed every heartbeat: everything answered, so the queue is empty.
    wait_for_depth = time.monotonic() + 10
    while only(scrape(port), "tokenq_queue_length", **q) and time.monotonic() < wait_for_depth:
        time.sleep(0.05)
    samples = scrape(port)
    assert [only(samples, f"tokenq_queue_{name}", **q) for name in ("length", "pending", "lag")
            ] == [0, 0, 0]


def scraped(worker: metrics.Metrics) -> str:
    """The exposition text of ``worker``'s registry, as a scrape would see it."""
    from prometheus_client import generate_latest

    return generate_latest(worker.registry).decode()


@pytest.mark.unit
def test_worker_registries_do_not_collide():
    first, second = metrics.Metrics("a"), metrics.Metrics("b")
    record = BatchRecord(worker="w", rows=2, tokens=30, padded_tokens=40, cost=40,
                         max_batch_tokens=100, max_batch_size=8, sealed=True, device_ms=5.0,
                         failed=0, oom_splits=1)
    first.batch(record, [b"1000-0", b"bad-id"], input_tokens=[10, 20], started_epoch_ms=3000,
                budget=90)
    first.answered([Answer(b"1000-0", "k", b"x", ok=True),
                    error_answer(b"2000-0", "r", "k", ErrorCode.TOO_LONG, "long"),
                    Answer(b"3-0", None, b"", ok=False)], now_epoch_ms=4000)
    first.tokenized(0.002)
    first.reclaimed(3)
    first.dead_lettered(2)
    first.queue_depth(length=7, pending=5, lag=2, tokens=840)
    text = scraped(first)
    assert 'tokenq_queue_pending_tokens{queue="a"} 840.0' in text
    assert 'tokenq_batches_total{queue="a"} 1.0' in text
    assert 'tokenq_requests_total{outcome="ok",queue="a"} 1.0' in text
    assert 'tokenq_requests_total{outcome="too_long",queue="a"} 1.0' in text
    assert 'tokenq_oom_splits_total{queue="a"} 1.0' in text
    assert 'tokenq_reclaimed_total{queue="a"} 3.0' in text
    assert 'tokenq_dead_lettered_total{queue="a"} 2.0' in text
    assert 'tokenq_batch_budget_tokens{queue="a"} 90.0' in text
    assert 'tokenq_queue_wait_seconds_sum{queue="a"} 2.0' in text  # bad id skipped
    assert 'tokenq_queue_wait_seconds_count{queue="a"} 1.0' in text
    assert 'tokenq_request_duration_seconds_sum{queue="a"} 5.0' in text  # 3 s + 2 s
    assert 'tokenq_request_duration_seconds_count{queue="a"} 2.0' in text  # unanswered: none
    assert 'tokenq_request_input_tokens_bucket{le="16.0",queue="a"} 1.0' in text
    assert 'tokenq_request_input_tokens_bucket{le="32.0",queue="a"} 2.0' in text
    assert 'tokenq_batch_padding_efficiency_ratio_sum{queue="a"} 0.75' in text
    assert 'tokenq_tokenization_seconds_count{queue="a"} 1.0' in text
    assert 'tokenq_queue_length{queue="a"} 7.0' in text
    assert 'tokenq_queue_pending{queue="a"} 5.0' in text
    assert 'tokenq_queue_lag{queue="a"} 2.0' in text
    assert 'tokenq_batches_total{queue="b"} 0.0' in scraped(second)
    assert "_created" not in text and "process_cpu_seconds_total" in text


@pytest.mark.unit
def test_a_batch_histogram_matches_the_librarys_buckets():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    values = [0.0, 1.0, 1.5, 2.0, 3.0, 1e9, -1.0]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    bulk = Histogram("h", "doc", ("queue",), buckets=(1.0, 2.0, 3.0), registry=ours)
    observe_many(bulk.labels("q"), values)
    reference = Histogram("h", "doc", ("queue",), buckets=(1.0, 2.0, 3.0), registry=theirs)
    for value in values:
        reference.labels("q").observe(value)

    def lines(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines()
                if "_created" not in line]

    assert lines(ours) == lines(theirs)


def measured(redis_url: str, q: keys.QueueRef) -> Depth:
    """What the beat's ``measure`` reads of ``q`` now."""
    async def measure() -> Depth:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await beat.measure(client, [q])
        finally:
            await client.aclose()

    return asyncio.run(measure())


def test_queue_depth_reads_length_pending_and_lag(r: redis.Redis, redis_url: str,
                                                  queue_name: str):
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    ids = [r.xadd(stream, {"n": str(i)}) for i in range(5)]
    r.xreadgroup(keys.GROUP, "c", {stream: ">"}, count=2)

    assert measured(redis_url, q) == Depth(length=5, pending=2, lag=3, lag_exact=True)
    r.xdel(stream, ids[3])  # an unread entry deleted: Redis can no longer count the lag
    r.hset(keys.pending(q), keys.PENDING_TOTAL, 1234)  # as enqueue.lua keeps it
    assert measured(redis_url, q) == Depth(length=4, pending=2, lag=2, lag_exact=False,
                                           tokens=1234)


def test_every_stream_of_the_queue_counts_in_its_length_depth_and_stats(
        r: redis.Redis, redis_url: str, queue_name: str, capsys: pytest.CaptureFixture[str]):
    """Tenants' entries count wherever the queue's depth is read: ``queue_length`` (/health),
    the worker's gauges and ``tokenq stats``, whose tenants' tokens add up to its total."""
    from tokenq.producer.ops.stats import main as stats_main

    q = keys.QueueRef(queue_name)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.submit_many(["one", "two"])
        client.submit_many(["three"], tenant="a")
        client.submit_many(["four", "five", "six"], tenant="b")
        assert client.queue_length() == 6
    b = keys.tenant_requests(q, "b")
    r.xgroup_create(b, keys.GROUP, id="0")
    r.xreadgroup(keys.GROUP, "c", {b: ">"}, count=2)
    found = measured(redis_url, q)
    assert (found.length, found.pending, found.lag) == (6, 2, 4), found  # no group: all lag
    assert sum(found.tenants.values()) == found.tokens > 0
    capsys.readouterr()
    stats_main(["--redis-url", redis_url, "--queue", queue_name, "--json"])
    [row] = json.loads(capsys.readouterr().out)["queues"]
    assert (row["length"], row["pending"], row["lag"]) == (6, 2, 4)
    assert sum(t["pending_tokens"] for t in row["tenants"]) == row["pending_tokens"], row


def test_queue_depth_skips_pending_fields_written_by_hand(r: redis.Redis, redis_url: str,
                                                           queue_name: str):
    """A hand-written value in the pending hash is skipped (keys.pending_count), not an error
    that leaves the depth gauges stale."""
    q = keys.QueueRef(queue_name)
    r.xgroup_create(keys.requests(q), keys.GROUP, id="0", mkstream=True)
    r.hset(keys.pending(q), mapping={"tokens": "\u0661\u0662", "tokens:a": "9" * 5000,
                                     "tokens:b": "7"})

    found = measured(redis_url, q)
    assert found.tokens == 0 and found.tenants == {keys.DEFAULT_TENANT: 0, "b": 7}


@pytest.mark.unit
def test_metrics_are_off_by_default_and_a_taken_port_is_a_config_error():
    assert not metrics.create(WorkerSettings()).enabled
    assert endpoint.serve("127.0.0.1", 0, Health(1.0), None) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="cannot serve metrics"):
            endpoint.serve("127.0.0.1", taken.getsockname()[1], Health(1.0), None)
    null = metrics.NullMetrics()
    null.batch(None, [], input_tokens=[], started_epoch_ms=0, budget=1)  # type: ignore[arg-type]
    null.answered([], now_epoch_ms=0)
    null.reclaimed(1)
    null.dead_lettered(1)
    assert null.wsgi_app() is None


def test_without_prometheus_client_only_metrics_is_missing():
    port = free_port()
    close = endpoint.serve("127.0.0.1", port, Health(1.0), None)
    assert close is not None
    try:
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert missing.value.code == 404
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=5) as live:
            assert live.status == 200
    finally:
        close()


@pytest.mark.parametrize("flags", [("--log-format", "json"), ("--log-json",)])
def test_worker_logs_json_lines_with_startup_batch_and_exit_lines(
    sim_worker, redis_url, queue_name, flags,
):
    worker = sim_worker(*flags, "--log-level", "DEBUG")
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.infer("log me", timeout_s=20)
    worker.terminate()
    records = [json.loads(line) for line in worker.output().splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    messages = [(r["level"], r["message"]) for r in records]
    assert any(level == "INFO" and "budget=" in m and worker.name in m for level, m in messages)
    assert any(level == "DEBUG" and m.startswith("batch rows=1 ") for level, m in messages)
    [stopped] = [r for r in records if r.get("event") == "worker_stopped"]
    assert re.match(rf"worker {worker.name} stopped after [0-9.]+s: 1 request ok, ",
                    stopped["message"]), stopped["message"]
    assert stopped["worker"] == worker.name
    assert (stopped["requests_ok"], stopped["requests_failed"], stopped["batches"]) == (1, 0, 1)
    assert stopped["tokens"] == worker.batches()[0]["tokens"] > 0
    assert stopped["uptime_s"] > 0 and 0 < stopped["padding_efficiency"] <= 1


def test_worker_exit_line_is_one_sentence(sim_worker, redis_url, queue_name):
    worker = sim_worker()
    with Client(redis_url=redis_url, queue=queue_name) as client:
        results = client.infer_many(["one", "two", "three", f"bad {SIM_FAIL_MARKER}"],
                                    timeout_s=20, return_exceptions=True)
    assert sum(isinstance(result, Exception) for result in results) == 1
    assert worker.terminate() == 0
    [line] = [line for line in worker.output().splitlines() if " stopped after " in line]
    assert re.search(
        rf"INFO tokenq.worker worker {worker.name} stopped after [0-9.]+s: 3 requests ok, "
        r"1 failed, [1-4] batches, \d+ tokens \(padding efficiency [01]\.\d\d\), "
        r"[0-9.]+s on the device, 0 OOM splits, 0 reclaimed, 0 dead-lettered$", line), line
    assert "{" not in line


@pytest.mark.unit
def test_exit_line_reads_large_numbers_with_separators():
    stats = WorkerStats(started_at=0.0, requests_ok=1204, requests_failed=3, batches=87,
                        tokens=1_234_567, padded_tokens=1_300_000, device_ms=12_345.0)
    fields = stats.exit_fields("w1", now=312.4)
    assert exit_line(fields) == (
        "worker w1 stopped after 5m12s: 1,204 requests ok, 3 failed, 87 batches, "
        "1,234,567 tokens (padding efficiency 0.95), 12.3s on the device, 0 OOM splits, "
        "0 reclaimed, 0 dead-lettered"
    )
    assert json.loads(json.dumps(fields))["device_s"] == 12.345
    one = WorkerStats(started_at=0.0, requests_ok=1, batches=1, tokens=1, padded_tokens=1,
                      oom_splits=1).exit_fields("w1", now=1.0)
    assert ": 1 request ok, 0 failed, 1 batch, 1 token " in exit_line(one)
    assert "1 OOM split," in exit_line(one)


def test_a_failing_depth_measure_is_logged_once_and_the_beat_goes_on(
        redis_url: str, queue_name: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from tokenq.worker.backends.sim import SimBackend
    from tokenq.worker.loop.worker import Worker

    calls = []

    async def broken(client: object, queues: object) -> Depth:
        calls.append(time.monotonic())
        raise RuntimeError("a bug in the depth measure")

    class On(metrics.NullMetrics):
        enabled = True

    monkeypatch.setattr(beat, "measure", broken)
    settings = WorkerSettings(redis_url=redis_url, queue=queue_name, backend="sim",
                              heartbeat_s=0.3, block_ms=100)

    async def main() -> None:
        worker = Worker(settings, SimBackend(), metrics=On())
        running = asyncio.create_task(worker.run())
        await asyncio.sleep(2.5)
        assert not running.done()  # the worker serves on
        worker.stop()
        await asyncio.wait_for(running, 30)

    asyncio.run(main())
    assert len(calls) >= 4, calls  # a beat each 0.3 s, not one beat and silence
    assert caplog.text.count("queue depth metrics unavailable") == 1, caplog.text
