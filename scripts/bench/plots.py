"""Draw docs/img/*.png from the suites' JSON results (``run.py plots``).

Why from JSON rather than inside each suite: a figure must show the numbers
the docs quote, so the plots read the very files the docs were written
from, and redrawing them costs no benchmark time. Each plot is skipped,
with a message, when its suite's JSON is missing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

TOKENQ = "#2b6cb0"
OTHER = "#a0aec0"
BAD = "#c53030"
BOUND = "#e2e8f0"


def _colour(setting: str) -> str:
    if setting.startswith("tokenq"):
        return TOKENQ
    if setting == "bound" or setting.startswith("ideal"):
        return BOUND
    return OTHER


def seed(result: dict[str, Any], out: Path) -> None:
    """Padding efficiency and useful tokens/s per setting, failures marked."""
    rows = result["rows"]
    names = [row["setting"] for row in rows]
    colours = [_colour(name) for name in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(names, [row["padding_efficiency"] or 0 for row in rows], color=colours,
             edgecolor="black", linewidth=0.5)
    left.set_ylim(0, 1.05)
    left.set_title("padding efficiency (real / padded tokens)")
    right.bar(names, [(row["useful_tokens_per_s"] or 0) / 1000 for row in rows], color=colours,
              edgecolor="black", linewidth=0.5)
    right.set_title("useful tokens/s (thousands)")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=20)
    for index, row in enumerate(rows):
        if row["failed_requests"]:
            right.annotate(f"{row['failed_requests']:,} failed\n(out of memory)", (index, 0),
                           xytext=(0, 12), textcoords="offset points", ha="center",
                           color=BAD, fontsize=8)
    config = result["config"]
    fig.suptitle(
        f"seed: {config['requests']:,} requests, half ~1,500-token passages, half ~20-token "
        f"queries; device holds {config['capacity_tokens']:,} padded tokens", fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def latency(result: dict[str, Any], out: Path) -> None:
    """p50/p99 latency against offered load, with the mean batch time beside them."""
    rows = result["rows"]
    loads = [row["load"] * 100 for row in rows]
    fig, axis = plt.subplots(figsize=(6.5, 4))
    axis.plot(loads, [row["p50_ms"] for row in rows], "o-", color=TOKENQ, label="p50")
    axis.plot(loads, [row["p99_ms"] for row in rows], "s--", color=TOKENQ, label="p99")
    axis.plot(loads, [row["mean_batch_ms"] for row in rows], "^:", color=OTHER,
              label="mean batch time")
    axis.axhline(result["config"]["linger_ms"], color=BAD, linewidth=0.8,
                 label=f"linger ({result['config']['linger_ms']:g} ms)")
    axis.set_yscale("log")
    axis.set_xlabel("offered load, % of measured capacity "
                    f"({result['config']['capacity_per_s']:.0f} requests/s)")
    axis.set_ylabel("ms (log scale)")
    axis.set_title("latency under open-loop Poisson load (1 worker, sim)")
    axis.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def scale(result: dict[str, Any], out: Path) -> None:
    """Throughput over that of one worker, against the number of workers."""
    rows = result["rows"]
    workers = [row["workers"] for row in rows]
    fig, axis = plt.subplots(figsize=(5.5, 4))
    axis.plot(workers, workers, ":", color=OTHER, label="ideal (x N)")
    axis.plot(workers, [row["speedup"] for row in rows], "o-", color=TOKENQ, label="tokenq")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log", base=2)
    axis.set_xticks(workers, [str(n) for n in workers])
    axis.set_yticks(workers, [str(n) for n in workers])
    axis.set_xlabel("workers (one simulated GPU each)")
    axis.set_ylabel("throughput / throughput with 1 worker")
    axis.set_title("scaling out on one queue")
    axis.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def real(result: dict[str, Any], out: Path) -> None:
    """Texts/s per method on the real model (CPU)."""
    rows = result["rows"]
    names = [row["method"] for row in rows]
    fig, axis = plt.subplots(figsize=(8, 3.8))
    axis.barh(names, [row["texts_per_s"] for row in rows], color=[_colour(n) for n in names],
              edgecolor="black", linewidth=0.5)
    axis.invert_yaxis()
    axis.set_xlabel("texts/s")
    config = result["config"]
    axis.set_title(f"all-MiniLM-L6-v2 on CPU, {config['torch_threads']} torch thread(s), "
                   f"{config['texts']} texts")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


PLOTS: dict[str, tuple[str, Callable[[dict[str, Any], Path], None]]] = {
    "seed": ("seed.png", seed),
    "latency": ("latency.png", latency),
    "scale": ("scale.png", scale),
    "real": ("real.png", real),
}


def draw_all(results: Path, images: Path) -> list[Path]:
    """Draw every plot whose suite result exists; returns the files written."""
    images.mkdir(parents=True, exist_ok=True)
    written = []
    for suite, (name, draw) in PLOTS.items():
        source = results / f"{suite}.json"
        if not source.exists():
            print(f"skipped {name}: no {source}")
            continue
        draw(json.loads(source.read_text()), images / name)
        written.append(images / name)
    return written
