"""Suite ``seed``: the scenario tokenq exists for, on the simulated GPU through real Redis.

Half the requests are ~1,500-token passages and half ~20-token queries, in
random order, all opened at once (a backlog, as after a traffic spike or in
a batch job). The simulated device holds 16,384 padded tokens, so a batch of
32 rows that contains one passage (almost every batch of 32 here) cannot
fit. Four settings, each one worker process on the same device model:

* ``fifo-32``: the classic micro-batcher, next 32 in arrival order;
* ``fifo-N``: the same with the largest count that cannot run out of memory
  on this mix (``capacity // longest request``; a FIFO batch of N always
  fits, N+1 passages would not);
* ``tokenq-4096`` / ``tokenq-8192`` / ``tokenq-16384``: tokenq workers with
  that token budget (16,384 is the whole device: what ``--max-batch-tokens
  auto`` would find on it).

A last row, ``bound``, is not a run: it is the device time of the same
requests sorted by length and packed into full batches of the device's whole
capacity, i.e. what a perfect batcher with perfect knowledge of the backlog
would need. Nothing that runs online can beat it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import harness
from harness import RedisServer
from texts import Mix, seed_mix

SIZES = {"tiny": 120, "small": 1000, "full": 5000}
BYTES_PER_TOKEN = 4096
CAPACITY_TOKENS = 16_384
SIM: dict[str, Any] = {
    "dim": 32,
    "max_input_tokens": 2048,
    "batch_ms": 2.0,
    "token_us": 1.0,
    "bytes_per_token": BYTES_PER_TOKEN,
    "capacity_bytes": CAPACITY_TOKENS * BYTES_PER_TOKEN,
}
BUDGETS = (4096, 8192, 16384)
COLUMNS = [
    "setting", "failed_requests", "padding_efficiency", "useful_tokens_per_s",
    "requests_per_s", "p50_ms", "p99_ms", "peak_memory_bytes", "mean_rows", "device_busy",
]


def largest_safe_count(mix: Mix, capacity_tokens: int) -> tuple[int, int]:
    """The largest fixed count that never OOMs on this mix, and the FIFO-order one.

    The first is order-free: ``capacity // longest``, since some batch of the
    next N may hold the longest passage. The second checks only the
    consecutive chunks of the order the requests are sent in; it can be
    larger by luck, and a reader that ever returns a short batch shifts the
    chunks, so the benchmark runs the first.
    """
    safe = capacity_tokens // mix.longest
    lucky = safe
    for count in range(safe + 1, 65):
        chunks = [mix.lengths[i:i + count] for i in range(0, len(mix.lengths), count)]
        if any(len(chunk) * max(chunk) > capacity_tokens for chunk in chunks):
            break
        lucky = count
    return safe, lucky


def device_bound(mix: Mix, budget: int = CAPACITY_TOKENS) -> dict[str, Any]:
    """Device time of the mix sorted by length in batches of ``budget`` padded tokens."""
    seconds, padded, rows, longest = 0.0, 0, 0, 0
    batches = 0

    def seal() -> None:
        nonlocal seconds, padded, rows, longest, batches
        if rows:
            seconds += (SIM["batch_ms"] * 1e3 + SIM["token_us"] * rows * longest) / 1e6
            padded += rows * longest
            batches += 1
        rows, longest = 0, 0

    for length in sorted(mix.lengths):
        if (rows + 1) * length > budget:
            seal()
        rows, longest = rows + 1, length
    seal()
    return {
        "setting": "bound",
        "failed_requests": 0,
        "padding_efficiency": round(mix.tokens / padded, 4),
        "useful_tokens_per_s": round(mix.tokens / seconds, 0),
        "requests_per_s": round(len(mix.lengths) / seconds, 1),
        "p50_ms": None,
        "p99_ms": None,
        "peak_memory_bytes": budget * BYTES_PER_TOKEN,
        "mean_rows": round(len(mix.lengths) / batches, 2),
        "device_busy": 1.0,
        "seconds": round(seconds, 3),
    }


def run_setting(
    server: RedisServer, workdir: Path, setting: str, mix: Mix
) -> dict[str, Any]:
    """One worker process for ``setting``, one burst of the whole mix, its figures."""
    queue = harness.new_queue(setting)
    kind, value = setting.split("-")
    if kind == "fifo":
        worker = harness.start_fifo(server, queue, workdir, setting, int(value), SIM)
    else:
        flags = [
            "--backend", "sim_probe:factory", *harness.sim_flags(SIM),
            "--max-batch-tokens", value,
        ]
        worker = harness.start_tokenq(server, queue, workdir, setting, flags)
    with harness.running([worker], server.url):
        run = harness.burst(server.url, queue, mix.texts, workers=[worker])
    totals = harness.batch_totals(worker.batches())
    device = worker.sim_stats() or {}
    summary = run.summary()
    return {
        "setting": setting,
        **summary,
        "padding_efficiency": totals["padding_efficiency"],
        "peak_memory_bytes": device.get("peak_memory_bytes"),
        "oom_events": device.get("oom_events"),
        "batches": totals["batches"],
        "mean_rows": totals["mean_rows"],
        "mean_batch_ms": totals["mean_batch_ms"],
        "device_busy": round(device.get("busy_s", 0.0) / summary["seconds"], 3)
        if summary["seconds"] else None,
    }


def run(size: str) -> dict[str, Any]:
    mix = seed_mix(SIZES[size])
    safe, lucky = largest_safe_count(mix, CAPACITY_TOKENS)
    settings = ["fifo-32", f"fifo-{safe}", *(f"tokenq-{budget}" for budget in BUDGETS)]
    rows = []
    with harness.private_redis() as server, tempfile.TemporaryDirectory() as tmp:
        for setting in settings:
            rows.append(run_setting(server, Path(tmp), setting, mix))
    rows.append(device_bound(mix))
    # The same bound at each tokenq budget: what tokenq could reach with that
    # budget if nothing but the device took time (its overhead is the rest).
    at_budget = {b: device_bound(mix, b)["requests_per_s"] for b in BUDGETS}
    by = {row["setting"]: row for row in rows}
    fifo = by[f"fifo-{safe}"]["requests_per_s"]
    return {
        "columns": COLUMNS,
        "rows": rows,
        "config": {
            "requests": len(mix.lengths),
            "passages": sum(length > 100 for length in mix.lengths),
            "longest": mix.longest,
            "tokens": mix.tokens,
            "sim": SIM,
            "capacity_tokens": CAPACITY_TOKENS,
            "largest_safe_count": safe,
            "largest_count_lucky_in_this_order": lucky,
            "load": "all requests opened at once (chunked submit_many), one worker",
            "latency": "enqueue call to reply received by the producer",
            "bound_requests_per_s_at_budget": at_budget,
        },
        "notes": [
            f"tokenq-{b}: x{by[f'tokenq-{b}']['requests_per_s'] / fifo:.2f} the requests/s of "
            f"fifo-{safe}, {by[f'tokenq-{b}']['requests_per_s'] / at_budget[b]:.0%} of the "
            f"device-only bound at its budget ({at_budget[b]:.0f}/s)"
            for b in BUDGETS
        ] if fifo else [],
    }
