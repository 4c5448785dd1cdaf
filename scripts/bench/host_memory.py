"""A CPU hf worker's resident memory over many distinct batch shapes, bounded or not.

Token-budget packing gives the forward a new (rows, length) shape almost every
batch. This runs the bundled all-MiniLM-L6-v2 through ``HFBackend.run`` (the
worker's own forward path) over ``--shapes`` distinct shapes drawn from rows
1-32 x lengths 4-128 (every fourth length, every second past 1,024 shapes, every
one past 2,016), each in a fresh process, two ways per dtype:

* ``unbounded``: what tokenq did before ``worker/backends/hf/heap_trim.py``:
  oneDNN's caches at their 1,024-entry default and no heap trimming;
* ``bounded``: what the worker does now (caches at 256 entries, the heap
  trimmed when the process has grown by the slack).

It prints the growth of resident memory over the process's size after the
load at each quarter of the run, the seconds the forwards took and how many
trims ran (docs/BENCHMARKS.md, "host memory")::

    python scripts/bench/host_memory.py [--shapes 500] [--dtype fp32 bf16-mixed]
        [--modes unbounded bounded] [--out results/host_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness

RESULTS = Path(__file__).resolve().parent / "results" / "host_memory.json"
MODES = ("unbounded", "bounded")
ROWS = range(1, 33)


def shape_grid(shapes: int) -> list[tuple[int, int]]:
    """Rows x lengths 4-128, the length step the widest (4, 2, 1) that holds ``shapes``."""
    step = next((s for s in (4, 2) if len(ROWS) * len(range(4, 129, s)) >= shapes), 1)
    return [(rows, length) for rows in ROWS for length in range(4, 129, step)]


def child(dtype: str, mode: str, shapes: int) -> dict[str, Any]:
    """One process's run (called in a fresh interpreter: caches are process-wide)."""
    if mode == "unbounded":
        for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
            os.environ[name] = "1024"  # the libraries' defaults, before tokenq capped them
    import numpy as np
    import torch

    from tokenq.worker.backends.hf.backend import HFBackend, HFOptions
    from tokenq.worker.backends.hf.encoding import HFEncoding
    from tokenq.worker.backends.hf.heap_trim import resident_bytes

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    backend = HFBackend.load(HFOptions(device="cpu", dtype=dtype))
    if mode == "unbounded":
        backend._heap = None  # the benchmark's "before" side: no trimming
    rng = random.Random(3)
    grid = shape_grid(shapes)
    chosen = rng.sample(grid, min(shapes, len(grid)))
    loaded = resident_bytes() or 0
    growth, started = [], time.perf_counter()
    for done, (rows, length) in enumerate(chosen, 1):
        ids = np.array([rng.randrange(1000, 20000) for _ in range(length)])
        backend.run([HFEncoding(ids)] * rows)
        if done % max(1, len(chosen) // 4) == 0:
            growth.append(round(((resident_bytes() or 0) - loaded) / 2**20))
    heap = backend._heap
    return {
        "dtype": dtype, "mode": mode, "shapes": len(chosen),
        "loaded_mb": round(loaded / 2**20), "growth_mb": growth,
        "seconds": round(time.perf_counter() - started, 1),
        "trims": heap.trims if heap is not None else 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=500)
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16-mixed"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", nargs=2, metavar=("DTYPE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.shapes)))
        return 0
    rows = []
    for dtype in args.dtype:
        for mode in args.modes:
            completed = subprocess.run(
                [sys.executable, __file__, "--shapes", str(args.shapes), "--child", dtype, mode],
                capture_output=True, text=True, check=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            )
            rows.append(json.loads(completed.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print(harness.format_table(rows, ["dtype", "mode", "shapes", "loaded_mb", "growth_mb",
                                      "seconds", "trims"]))
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"machine": harness.machine_info(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
