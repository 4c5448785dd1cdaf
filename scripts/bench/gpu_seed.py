"""The seed scenario with all-MiniLM-L6-v2 on a CUDA GPU, end to end through Redis.

Suite ``seed`` runs its mix (half long passages, half ~20-token queries,
shuffled, every request opened at once) on a simulated device;
this runs the same mix on a real one: one ``tokenq worker --backend hf
--device cuda`` per setting (fp16 by default), a private redis-server, the
producer in this process. Passages run past the model's 256 tokens and are
cut there, so the mix is the model's longest input against its short ones.

Per setting it prints requests/s and useful tokens/s end to end, device busy
(the worker's summed forward time over the makespan: how much of the run the
GPU was given work), mean rows and padding per batch, and the CPU each
process spent per request (worker, this producer, redis-server). Those
answer the question to ask of a GPU: are short queries waiting on
Python? A busy figure well under 1 says the device waited for the worker.
Busy counts each batch's wall time in the worker's device thread, waits for
the interpreter lock included, so a mean batch time well above the forward
timed alone says the same from the other side (docs/BENCHMARKS.md, "gpu").

Then the forward alone on the same batches: each setting's batches, as its batch log
shapes them (rows, longest, real tokens), run again through the backend's own pad and
forward in this process, with nothing around them (``forward_alone_tokens_per_s``);
``end_to_end_over_forward`` is the run's useful tokens/s over that: what the queue, the
tokenizer and the worker's Python leave of the device's rate.

``--processes 1 2`` runs each setting with one worker and with two on the one device (what
``--processes-per-device 2`` starts; their forwards overlap, so end to end can pass the
forward alone, replayed one batch at a time); ``--mix queries`` sends 12-28-word queries only.

Without a CUDA device it prints "no CUDA device; skipped" and exits 0, like
``scripts/gpu_check.py``. Run it where ``python -m tokenq.worker`` works::

    python scripts/bench/gpu_seed.py [--requests 20000] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness
import numpy as np
from texts import SEED_QUERIES, seed_mix, uniform_mix

from tokenq.producer.config import EstimatorMode

PASSAGE_WORDS = (280, 330)
"""A passage's length in sample words: past the model's 256 tokens, so each is cut there.

Why not suite seed's own 1,500-word passages: the model reads 256 tokens of
them, and counting the rest only costs the producer more.
"""
MIXES = {
    "seed": lambda n: seed_mix(n, passages=PASSAGE_WORDS).texts,
    "queries": lambda n: uniform_mix(n, *SEED_QUERIES).texts,
}
SETTINGS = ("16384", "65536", "auto")
"""--max-batch-tokens per run: the worker's default, four times it, and calibrated."""
WARM_UP = 256
COLUMNS = [
    "mix", "setting", "failed_requests", "requests_per_s", "useful_tokens_per_s", "device_busy",
    "mean_rows", "padding_efficiency", "mean_batch_ms", "worker_cpu_us", "producer_cpu_us",
    "redis_cpu_us", "p50_ms", "p99_ms", "forward_alone_tokens_per_s", "end_to_end_over_forward",
]
REPLAY_WARM_UP = 3
"""Batches replayed off the clock first (the first forwards of a shape plan its kernels)."""


def shaped_like(record: dict[str, Any]) -> list[Any]:
    """A batch of the logged shape: ``rows`` rows, the first ``longest`` tokens long, the rest
    sharing the real tokens left (the forward's cost is its padded shape, not the ids)."""
    from tokenq.worker.backends.hf.encoding import HFEncoding

    rows, longest = record["rows"], record["padded_tokens"] // record["rows"]
    lengths = [longest] + [0] * (rows - 1)
    left = max(rows - 1, record["tokens"] - longest)
    for row in range(1, rows):
        lengths[row] = min(longest, max(1, left // (rows - row)))
        left -= lengths[row]
    return [HFEncoding(np.full(length, 1000, dtype=np.int64)) for length in lengths]


def forward_alone_s(backend: Any, records: Sequence[dict[str, Any]]) -> float:
    """Seconds the backend's pad and forward take over batches shaped as ``records``."""
    batches = [shaped_like(record) for record in records]
    for batch in batches[:REPLAY_WARM_UP]:
        backend.run(batch)
    started = time.perf_counter()
    for batch in batches:
        backend.run(batch)  # its rows come back to the host: each forward has finished
    return time.perf_counter() - started


def one_setting(
    texts: Sequence[str], budget: str, dtype: str, flags: Sequence[str], workdir: Path,
    estimator: EstimatorMode, processes: int = 1,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``processes`` workers with this budget on one queue (one device): warmed up, then the
    whole burst, timed; the CPU and device time of all of them."""
    with harness.private_redis() as server:
        queue = harness.new_queue("gpu")
        workers = [harness.start_tokenq(
            server, queue, workdir, f"gpu-{budget}-{processes}-{index}",
            ["--backend", "hf", "--max-batch-tokens", budget, "--dtype", dtype, *flags],
        ) for index in range(processes)]
        client = harness.connect(server.url)
        with harness.running(workers, server.url):
            harness.burst(server.url, queue, texts[:WARM_UP], workers=workers,
                          estimator=estimator)
            warm = [len(worker.batches()) for worker in workers]
            worker_cpu = sum(harness.cpu_seconds(worker.process.pid) for worker in workers)
            producer_cpu = time.process_time()
            redis_cpu = harness.redis_cpu_seconds(client)
            run = harness.burst(server.url, queue, texts, workers=workers, estimator=estimator)
            worker_cpu = sum(harness.cpu_seconds(w.process.pid) for w in workers) - worker_cpu
            producer_cpu = time.process_time() - producer_cpu
            redis_cpu = harness.redis_cpu_seconds(client) - redis_cpu
        client.close()
        records = [record for worker, skip in zip(workers, warm, strict=True)
                   for record in worker.batches()[skip:]]
        totals = harness.batch_totals(records)
    summary = run.summary()
    per_request = 1e6 / max(1, run.requests)
    return ({
        "setting": f"{dtype} {budget}" + (f" x{processes}" if processes > 1 else ""),
        **summary,
        **totals,
        # Over the processes: two forwards at once count twice.
        "device_busy": round(totals["device_ms"] / 1000 / summary["seconds"] / processes, 3),
        "worker_cpu_us": round(worker_cpu * per_request, 1),
        "producer_cpu_us": round(producer_cpu * per_request, 1),
        "redis_cpu_us": round(redis_cpu * per_request, 1),
    }, records)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000, help="requests per setting")
    parser.add_argument("--model", help="model dir or id (default: the bundled MiniLM)")
    parser.add_argument("--dtype", default="fp16", help="worker --dtype (default fp16)")
    parser.add_argument("--device", default="cuda",
                        help="worker --device (default cuda; cpu only to try the script out)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS),
                        help="--max-batch-tokens values to run (default: %(default)s)")
    parser.add_argument("--estimator", default="heuristic", choices=["heuristic", "exact"],
                        help="the producer's token count (default heuristic: a web backend "
                        "without a tokenizer; exact costs this process ~0.7 ms a passage)")
    parser.add_argument("--processes", type=int, nargs="+", default=[1],
                        help="workers on the one device, each setting run with each (default 1)")
    parser.add_argument("--mix", choices=sorted(MIXES), default="seed",
                        help="seed: half passages, half queries; queries: 12-28 words each")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.requests < 1 or min(args.processes) < 1:
        parser.error("--requests and each --processes must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_seed: no CUDA device; skipped")
        return 0
    flags = ["--device", args.device]
    if args.model:
        flags += ["--model", args.model]
    texts = MIXES[args.mix](args.requests)
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    print(f"gpu_seed: {where}, {args.requests} requests ({args.mix} mix), "
          f"{os.cpu_count()} CPUs", flush=True)
    rows, logs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for budget in args.settings:
            for processes in args.processes:
                row, records = one_setting(texts, budget, args.dtype, flags, Path(tmp),
                                           args.estimator, processes)
                rows.append({"mix": args.mix, "processes": processes, **row})
                logs.append(records)
                print(json.dumps(rows[-1]), flush=True)
    # After the workers are gone: the device is this process's alone.
    from tokenq.shared.errors import DeviceOutOfMemory
    from tokenq.worker.backends.hf.backend import HFBackend, HFOptions

    backend = HFBackend.load(HFOptions(device=args.device, dtype=args.dtype, model=args.model))
    for row, records in zip(rows, logs, strict=True):
        whole = [r for r in records if not r.get("oom_splits")]  # a split one ran as its parts
        try:
            seconds = forward_alone_s(backend, whole)
        except DeviceOutOfMemory as exc:  # this process's memory is not the worker's
            print(f"gpu_seed: the replay of {row['setting']} ran out of memory: {exc}")
            continue
        alone = sum(r["tokens"] for r in whole) / max(seconds, 1e-9)
        row["forward_alone_tokens_per_s"] = round(alone)
        row["end_to_end_over_forward"] = round(row["useful_tokens_per_s"] / alone, 3)
    backend.close()
    print(harness.format_table(rows, COLUMNS))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if any(row["failed_requests"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
