"""The main job on one machine: ``tokenq up`` + ``tokenq embed`` on real text.

Runs ``tokenq up`` (a private redis-server with AOF on a free loopback port,
plus N workers serving the bundled all-MiniLM-L6-v2, offline), then
``tokenq embed`` over the bundled sample of English and Chinese text of mixed
lengths (scripts/data/sample.jsonl) into a .npy file, which prints its
summary (requests/s, tokens/s, batches, padding efficiency). Then it looks up
the nearest sample text for a few queries, to show the vectors mean
something, and stops everything it started.

    python scripts/demo.py [--workers 2] [--backend hf|sim] [--output DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tokenq.producer import Client

SAMPLE = Path(__file__).resolve().parent / "data" / "sample.jsonl"
QUEUE = "demo"
QUERIES = [
    "How do computers represent the meaning of words?",
    "怎样做一道好吃的家常菜？",
    "What caused the decline of ancient empires?",
]


def tokenq(*args: str) -> list[str]:
    """The ``tokenq`` console script of this interpreter's environment."""
    return [sys.executable, "-m", "tokenq.shared.cli", *args]


def start_stack(workers: int, backend: str) -> tuple[subprocess.Popen[str], str]:
    """``tokenq up``; returns the process and the Redis URL it prints once workers are ready."""
    up = subprocess.Popen(
        tokenq("up", "--workers", str(workers), "--backend", backend, "--queue", QUEUE),
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    assert up.stdout is not None
    url = None
    for line in up.stdout:
        print(line.rstrip())
        if line.startswith("tokenq up: enqueue to "):
            url = line.split()[4]
        if "workers ready" in line:
            break
    if url is None or up.poll() is not None:
        raise SystemExit("tokenq up did not start; see its output above")
    return up, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backend", default="hf", help="hf (bundled MiniLM) or sim")
    parser.add_argument("--output", type=Path, default=None, help="keep sample.npy here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tokenq-demo-") as tmp:
        output = (args.output or Path(tmp)) / "sample.npy"
        output.parent.mkdir(parents=True, exist_ok=True)
        up, url = start_stack(args.workers, args.backend)
        try:
            embed = subprocess.run(
                tokenq("embed", str(SAMPLE), "--field", "text", "--output", str(output),
                       "--redis-url", url, "--queue", QUEUE, "--restart"),
                check=False,
            )
            if embed.returncode == 0:
                show_neighbours(url, np.load(output))
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)
    return embed.returncode


def show_neighbours(url: str, vectors: np.ndarray) -> None:
    """The sample line nearest to each query, by cosine similarity."""
    import json

    texts = [json.loads(line)["text"] for line in SAMPLE.read_text("utf-8").splitlines() if line]
    with Client(redis_url=url, queue=QUEUE) as client:
        queries = np.array([list(r.embedding) for r in client.infer_many(QUERIES, timeout_s=60)])
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    scores = (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ unit.T
    print("\nnearest sample text to a few queries (cosine)")
    for query, row in zip(QUERIES, scores, strict=True):
        best = int(row.argmax())
        text = texts[best].replace("\n", " ")
        print(f"  {query}\n    {row[best]:.3f}  {text[:90]}{'…' if len(text) > 90 else ''}")


if __name__ == "__main__":
    sys.exit(main())
