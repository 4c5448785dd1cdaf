"""Suite ``scale``: does throughput grow with the number of workers?

N = 1, 2, 4, 8 worker processes share one queue, each with its own simulated
GPU. The device's cost is a sleep (20 ms per batch + 35 us per padded
token, so a full 4,096-token batch takes ~160 ms), which is to say the
device, not this machine's two CPU cores, is what N multiplies; the CPU
work per request (tokenize, decode, publish) stays a small fraction of the
device time even at N = 8. Each N gets ``per_worker x N`` requests of 100
to 300 tokens, all opened at once, so every run lasts about as long and
every worker has about the same backlog.

The figure to read is ``speedup`` (throughput over that of N = 1, measured
in the same run); ``ideal`` is N. ``device_busy`` is the summed busy time
of the N simulated devices over N x the run's wall time: below 1, a device
sat idle (waiting for input, or for a CPU).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import harness
from harness import RedisServer
from texts import uniform_mix

COUNTS = {"tiny": (1, 2), "small": (1, 2, 4), "full": (1, 2, 4, 8)}
PER_WORKER = {"tiny": 40, "small": 300, "full": 1000}
BUDGET = 4096
SIM: dict[str, Any] = {
    "dim": 32,
    "max_input_tokens": 512,
    "batch_ms": 20.0,
    "token_us": 35.0,
}
COLUMNS = [
    "workers", "requests", "requests_per_s", "speedup", "ideal", "device_busy",
    "padding_efficiency", "p50_ms", "p99_ms",
]


def run_count(server: RedisServer, workdir: Path, count: int, texts: list[str]) -> dict:
    queue = harness.new_queue(f"n{count}")
    flags = [
        "--backend", "sim_probe:factory", *harness.sim_flags(SIM),
        "--max-batch-tokens", str(BUDGET),
    ]
    workers = [
        harness.start_tokenq(server, queue, workdir, f"n{count}-{i}", flags) for i in range(count)
    ]
    with harness.running(workers, server.url):
        run = harness.burst(server.url, queue, texts, workers=workers)
    summary = run.summary()
    busy = sum((worker.sim_stats() or {}).get("busy_s", 0.0) for worker in workers)
    totals = harness.batch_totals([b for worker in workers for b in worker.batches()])
    per_worker = [len(worker.batches()) for worker in workers]
    return {
        "workers": count,
        **summary,
        "device_busy": round(busy / (count * summary["seconds"]), 3),
        "padding_efficiency": totals["padding_efficiency"],
        "batches_per_worker": per_worker,
        "mean_batch_ms": totals["mean_batch_ms"],
    }


def run(size: str) -> dict[str, Any]:
    counts = COUNTS[size]
    mix = uniform_mix(PER_WORKER[size] * max(counts), 100, 300)
    rows = []
    with harness.private_redis() as server, tempfile.TemporaryDirectory() as tmp:
        for count in counts:
            texts = mix.texts[: PER_WORKER[size] * count]
            rows.append(run_count(server, Path(tmp), count, texts))
    base = rows[0]["requests_per_s"]
    for row in rows:
        row["speedup"] = round(row["requests_per_s"] / base, 2)
        row["ideal"] = row["workers"]
    return {
        "columns": COLUMNS,
        "rows": rows,
        "config": {
            "sim": SIM,
            "max_batch_tokens": BUDGET,
            "requests_per_worker": PER_WORKER[size],
            "request_tokens": "100-300",
            "load": "all requests opened at once; N workers on one queue",
        },
        "notes": [
            f"N={row['workers']}: x{row['speedup']} of N=1 (ideal x{row['workers']})"
            for row in rows[1:]
        ],
    }
