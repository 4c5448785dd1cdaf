"""Suite ``latency``: latency under open-loop Poisson load, at fractions of measured capacity.

One tokenq worker on the sim backend. First its capacity is measured: the
requests/s it sustains on a backlog (everything opened at once). Then, for
each load (10%, 50%, 70%, 90% of that), requests arrive at Poisson times
whether or not earlier ones have been answered (open loop: a real web
backend does not wait for one user before serving the next), and each
request's latency runs from its *scheduled* arrival to its reply landing at
the producer, so a sender that falls behind cannot hide queueing delay.

Requests are 20 to 400 tokens. The simulated device is ten times slower per
token than the seed suite's (5 ms per batch + 10 us per padded token), so
that the device, not this machine's two CPU cores, is what saturates; the
shape of the curve (linger at low load, fuller and longer batches at high
load) is the same at any speed.

Reported with each load: the linger setting (how long an idle device waits
to fill a batch that is not full), the mean device time of a batch and its
mean rows, which together explain the latency: at low load a request waits
the linger and one short batch; near capacity it waits for the batch ahead
of it too, and batches grow.

Last, the ``alone`` row: requests sent one at a time (``Client.infer``, each
waiting for its answer), so every request finds the device idle and rides in
a batch of its own. Its ``beyond_ms`` is, per request, latency minus the
linger minus its own batch's device time (from the batch log), at the
median: what tokenq itself adds to a lone request (Redis hops, read, pack,
publish, the reply's way back). At 10 % load a request still finds the
device busy a quarter of the time, which moves that level's p50 by more
than tokenq's own cost does; the alone row takes that out.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from texts import uniform_mix

from tokenq.producer import Client

LOADS = {"tiny": (0.1, 0.5), "small": (0.1, 0.5, 0.9), "full": (0.1, 0.5, 0.7, 0.9)}
SECONDS = {"tiny": 1.5, "small": 6.0, "full": 20.0}
CAPACITY_REQUESTS = {"tiny": 150, "small": 1000, "full": 3000}
ALONE_REQUESTS = {"tiny": 20, "small": 100, "full": 300}
BUDGET = 8192
LINGER_MS = 2.0
WARMUP = 0.05
"""Fraction of each level's first requests left out of its percentiles."""
SIM: dict[str, Any] = {
    "dim": 32,
    "max_input_tokens": 512,
    "batch_ms": 5.0,
    "token_us": 10.0,
}
COLUMNS = [
    "load", "offered_per_s", "requests_per_s", "p50_ms", "p99_ms", "linger_ms",
    "mean_batch_ms", "mean_rows", "sender_behind_p99_ms", "beyond_ms",
]


def run(size: str) -> dict[str, Any]:
    flags = [
        "--backend", "sim_probe:factory", *harness.sim_flags(SIM),
        "--max-batch-tokens", str(BUDGET), "--linger-ms", str(LINGER_MS),
    ]
    rows: list[dict[str, Any]] = []
    with harness.private_redis() as server, tempfile.TemporaryDirectory() as tmp:
        queue = harness.new_queue("latency")
        worker = harness.start_tokenq(server, queue, Path(tmp), "latency", flags)
        with harness.running([worker], server.url):
            backlog = uniform_mix(CAPACITY_REQUESTS[size], 20, 400, seed=12).texts
            measured = harness.burst(
                server.url, queue, backlog, workers=[worker]
            ).summary()
            capacity = measured["requests_per_s"]
            done = len(worker.batches())
            for index, load in enumerate(LOADS[size]):
                rate = capacity * load
                count = max(20, int(rate * SECONDS[size]))
                texts = uniform_mix(count, 20, 400, seed=13 + index).texts
                run = harness.open_loop(
                    server.url, queue, texts, rate, seed=index, workers=[worker]
                )
                records = worker.batches()[done:]
                done += len(records)
                rows.append(level_row(load, rate, run, records))
            alone = uniform_mix(ALONE_REQUESTS[size], 20, 400, seed=99).texts
            rows.append(alone_row(server.url, queue, worker, alone, done))
    return {
        "columns": COLUMNS,
        "rows": rows,
        "config": {
            "sim": SIM,
            "max_batch_tokens": BUDGET,
            "linger_ms": LINGER_MS,
            "request_tokens": "20-400",
            "capacity_per_s": capacity,
            "capacity_run": measured,
            "seconds_per_level": SECONDS[size],
            "load": "open loop, Poisson arrivals; latency from scheduled arrival to reply",
        },
        "notes": [f"capacity (backlog throughput): {capacity} requests/s"],
    }


def alone_row(
    redis_url: str, queue: str, worker: harness.WorkerProc, texts: list[str], done: int
) -> dict[str, Any]:
    """One request at a time: its latency, and what it spent beyond linger and its batch."""
    latencies: list[float] = []
    with Client(redis_url=redis_url, queue=queue) as client:
        client.infer(texts[0], timeout_s=30)  # connections and the config read, off the clock
        done += 1
        for text in texts:
            started = time.perf_counter()
            client.infer(text, timeout_s=30)
            latencies.append((time.perf_counter() - started) * 1000.0)
    records = _settled_records(worker, done, len(texts))
    if len(records) != len(texts) or any(record["rows"] != 1 for record in records):
        raise RuntimeError(f"alone: expected {len(texts)} one-row batches, got "
                           f"{[record['rows'] for record in records][:20]}")
    beyond = sorted(
        latency - LINGER_MS - record["device_ms"]
        for latency, record in zip(latencies, records, strict=True)
    )
    totals = harness.batch_totals(records)
    return {
        "load": "alone",
        "offered_per_s": None,
        "requests_per_s": round(len(latencies) / (sum(latencies) / 1000.0), 1),
        "failed_requests": 0,
        "p50_ms": round(harness.percentile(sorted(latencies), 50) or 0.0, 2),
        "p99_ms": round(harness.percentile(sorted(latencies), 99) or 0.0, 2),
        "linger_ms": LINGER_MS,
        "mean_batch_ms": totals["mean_batch_ms"],
        "mean_rows": totals["mean_rows"],
        "padding_efficiency": totals["padding_efficiency"],
        "beyond_ms": round(harness.percentile(beyond, 50) or 0.0, 2),
    }


def _settled_records(worker: harness.WorkerProc, done: int, count: int) -> list[dict[str, Any]]:
    """The ``count`` batch records after the first ``done``; the log is written after the reply."""
    deadline = time.monotonic() + 10.0
    while True:
        records = worker.batches()[done:]
        if len(records) >= count or time.monotonic() > deadline:
            return records[:count]
        time.sleep(0.05)


def level_row(
    load: float, rate: float, run: harness.Run, records: list[dict[str, Any]]
) -> dict[str, Any]:
    """Figures of one load level, its first ``WARMUP`` requests left out of the percentiles."""
    order = sorted(run.sent, key=run.sent.__getitem__)
    kept = set(order[int(len(order) * WARMUP):])
    latencies = sorted(
        (got.at - run.sent[rid]) * 1000.0
        for rid, got in run.received.items() if got.ok and rid in kept
    )
    totals = harness.batch_totals(records)
    behind = sorted(run.behind_ms)
    span = run.makespan_s
    return {
        "load": load,
        "offered_per_s": round(rate, 1),
        "requests_per_s": round(len(run.ok) / span, 1),
        "failed_requests": run.failed,
        "p50_ms": round(harness.percentile(latencies, 50) or 0.0, 2),
        "p99_ms": round(harness.percentile(latencies, 99) or 0.0, 2),
        "linger_ms": LINGER_MS,
        "mean_batch_ms": totals["mean_batch_ms"],
        "mean_rows": totals["mean_rows"],
        "padding_efficiency": totals["padding_efficiency"],
        "sender_behind_p99_ms": round(
            harness.percentile(behind + [0.0] * (run.requests - len(behind)), 99) or 0.0, 2
        ) if behind else 0.0,
    }
