"""tokenq's benchmarks: ``python scripts/bench/run.py SUITE [--size SIZE] [--json PATH]``.

Suites (docs/BENCHMARKS.md has the latest figures and how to read them):

  seed      passages + queries on the simulated GPU: fixed-count FIFO batching vs tokenq
  real      all-MiniLM-L6-v2 on CPU: tokenq vs sentence-transformers vs naive vs ideal
  overhead  null backend: tokenq's own cost per request vs redis-benchmark ceilings
  scale     1, 2, 4, 8 sim workers with a sleep-bound device: throughput vs N
  latency   open-loop Poisson load at fractions of measured capacity: p50/p99
  producer  the producer's own cost on the seed mix: estimate per text, submit_many rate
  mixed-latency  closed loop of 32 callers on the seed mix: query/passage latency, priority on/off
  shards    one queue of 1 vs 3 shards on a local Redis Cluster: commands and Redis CPU per node
  cpu       null backend: CPU per request of producer, worker and redis-server, each alone
  feed      hf worker, forward skipped: its CPU per request against the Rust tokenizer's
  cache     the result cache and coalescing: device tokens re-embedding repeats, the budget
  tenants   two tenants on one queue: B's latency beside A's flood, token shares by weight, caps
  plots     draw docs/img/*.png from the JSON results (--results DIR)
  all       every suite above, JSON into --results DIR, then the plots

Against a baseline commit, ``--baseline REV [--rounds N]`` (default 2) runs
the suite on a temporary git worktree of REV and on this working tree,
interleaved (base, current, base, current …), and prints, for each numeric
figure of each row, the median of each side and current/baseline; ``--json``
then writes both sides' raw runs and the ratios. scripts/bench/compare.py says
how the baseline is imported without being installed.

``--runtime onnx`` (suites ``real`` and ``mixed-latency``) also runs the hf
worker with ``--runtime onnx`` beside the torch one, in the same run, and
reports onnx/torch; ``tenants --runtime torch`` (or ``onnx``) runs that suite on
the real model instead of the sim. It reaches the suite as ``BENCH_RUNTIME``, so a
``--baseline`` run passes it to both sides. ``--dtype bf16-mixed`` does the
same for the hf worker with ``--dtype bf16-mixed`` (a CPU with bf16
instructions) against fp32.

Why one entry point: every suite starts its own redis-server and workers and
tears them down, so one command is all a reader needs to reproduce a figure.
Each suite prints a table; ``--json`` also writes everything it measured.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import compare  # noqa: E402  (the folder is not a package; see module docstring)
import harness  # noqa: E402

SUITES = (
    "seed", "real", "overhead", "scale", "latency", "producer", "mixed-latency", "shards", "cpu",
    "feed", "cache", "tenants",
)
RUNTIME_SUITES = ("real", "mixed-latency", "tenants")
"""Suites that take ``--runtime``: the ones that run the hf backend."""
DEFAULT_RESULTS = BENCH_DIR / "results"
DEFAULT_IMAGES = BENCH_DIR.parent.parent / "docs" / "img"


def run_suite(name: str, size: str) -> dict[str, Any]:
    """Run one suite and wrap its figures with when, where and how long."""
    module = importlib.import_module(f"suite_{name.replace('-', '_')}")  # mixed-latency
    started = time.perf_counter()
    machine = harness.machine_info()
    result = module.run(size)
    return {
        "suite": name,
        "size": size,
        "command": f"python scripts/bench/run.py {name} --size {size}" + runtime_flag(),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": machine,
        **result,
    }


def runtime_flag() -> str:
    """`` --runtime onnx`` or `` --dtype bf16-mixed`` when the suite compares one with torch."""
    return "".join(f" {flag}" for flag in harness.variant_flags(harness.bench_runtime()))


def report(result: dict[str, Any]) -> str:
    """The suite's table and its headline notes, as printed."""
    lines = [f"== {result['suite']} ({result['size']}, {result['wall_s']} s)"]
    lines.append(harness.format_table(result["rows"], result["columns"]))
    for note in result.get("notes", []):
        lines.append(f"  {note}")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("suite", choices=[*SUITES, "plots", "all"])
    parser.add_argument(
        "--size", choices=["tiny", "small", "full"], default="small",
        help="tiny: seconds (smoke test); small: a quick look; full: the published figures",
    )
    parser.add_argument("--json", type=Path, help="write the suite's results to this file")
    parser.add_argument(
        "--results", type=Path, default=DEFAULT_RESULTS,
        help="plots/all: folder of <suite>.json results (default: scripts/bench/results)",
    )
    parser.add_argument(
        "--images", type=Path, default=DEFAULT_IMAGES,
        help="plots/all: where the PNGs go (default: docs/img)",
    )
    parser.add_argument(
        "--baseline", metavar="REV",
        help="also run the suite on a worktree of this commit, interleaved; print ratios",
    )
    parser.add_argument(
        "--rounds", type=int,
        help=f"--baseline: runs of each side (default {compare.DEFAULT_ROUNDS}); medians compared",
    )
    parser.add_argument(
        "--runtime", choices=["torch", "onnx"],
        help=f"{', '.join(RUNTIME_SUITES)}: also run the hf worker on this runtime and "
        "compare it with torch in the same run (tenants: run the suite on the real model)",
    )
    parser.add_argument(
        "--dtype", choices=["bf16-mixed"],
        help=f"{', '.join(RUNTIME_SUITES)}: also run the hf worker with this --dtype and "
        "compare it with torch fp32 in the same run",
    )
    args = parser.parse_args(argv)
    if args.runtime is not None and args.dtype is not None:
        parser.error("--runtime and --dtype: compare one of them with torch fp32 at a time")
    variant = args.dtype or args.runtime
    if variant is not None:
        if args.suite not in RUNTIME_SUITES:
            parser.error(f"--runtime/--dtype apply to {', '.join(RUNTIME_SUITES)}, "
                         f"not {args.suite!r}")
        os.environ[harness.RUNTIME_ENV] = variant  # read by the suite, here and in --baseline
    if args.baseline is None and args.rounds is not None:
        parser.error("--rounds needs --baseline")
    if args.baseline is not None:
        if args.suite not in SUITES:
            parser.error(f"--baseline compares one suite, not {args.suite!r}")
        rounds = compare.DEFAULT_ROUNDS if args.rounds is None else args.rounds
        return compare.main(args.suite, args.baseline, rounds, args.size, args.json)
    if args.suite == "plots":
        for path in importlib.import_module("plots").draw_all(args.results, args.images):
            print(f"wrote {path}")
        return 0
    names = SUITES if args.suite == "all" else (args.suite,)
    for name in names:
        result = run_suite(name, args.size)
        print(report(result), flush=True)
        if args.json and args.suite != "all":
            write_json(result, args.json)
        if args.suite == "all":
            write_json(result, args.results / f"{name}.json")
    if args.suite == "all":
        for path in importlib.import_module("plots").draw_all(args.results, args.images):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
