"""The main job, end to end on one machine: Redis, workers, a producer, a summary.

Starts a private redis-server on a free loopback port, N worker processes
(the Hugging Face backend with the bundled all-MiniLM-L6-v2 by default), and
embeds the bundled sample of real English and Chinese text through the queue
with the sync client. Prints throughput, batching figures from the workers'
batch logs, and a few nearest-neighbour look-ups so the vectors can be seen
to mean something. Everything it started is stopped at the end.

    python scripts/demo.py [--workers 2] [--backend hf|sim] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenq.producer import Client
from tokenq.shared import keys
from tokenq.worker.embedded import RedisServer

SAMPLE = Path(__file__).resolve().parent / "data" / "sample.jsonl"
QUEUE = "demo"
QUERIES = [
    "How do computers represent the meaning of words?",
    "怎样做一道好吃的家常菜？",
    "What caused the decline of ancient empires?",
]


def load_sample() -> list[dict]:
    return [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines() if line]


def start_workers(url: str, count: int, backend: str, log_dir: Path) -> list[subprocess.Popen]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    workers = []
    for index in range(count):
        log = (log_dir / f"worker{index}.log").open("wb")
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "tokenq.worker", "--redis-url", url, "--queue", QUEUE,
             "--backend", backend, "--consumer", f"demo-{index}",
             "--batch-log", str(log_dir / f"worker{index}.batches.jsonl")],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        ))
    return workers


def wait_for_workers(client: Client, server_url: str, count: int, timeout: float = 120) -> None:
    import redis

    raw = redis.Redis.from_url(server_url)
    q = keys.QueueRef(QUEUE)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(raw.exists(keys.worker_alive(q, f"demo-{i}")) for i in range(count)) == count:
            return
        time.sleep(0.2)
    raise SystemExit("workers did not start; see their logs")


def cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backend", default="hf", help="hf (bundled MiniLM) or sim")
    parser.add_argument("--repeat", type=int, default=1, help="send the sample this many times")
    args = parser.parse_args()

    rows = load_sample()
    texts = [row["text"] for row in rows] * args.repeat
    with tempfile.TemporaryDirectory(prefix="tokenq-demo-") as tmp:
        tmp_path = Path(tmp)
        server = RedisServer(tmp_path / "redis", appendonly=True)
        server.start()
        print(f"redis-server on {server.url} (AOF on, noeviction)")
        workers = start_workers(server.url, args.workers, args.backend, tmp_path)
        try:
            with Client(redis_url=server.url, queue=QUEUE, max_queue_length=0) as client:
                wait_for_workers(client, server.url, args.workers)
                print(f"{args.workers} workers ready ({args.backend}); "
                      f"embedding {len(texts)} texts")
                started = time.perf_counter()
                results = client.infer_many(texts, timeout_s=600, return_exceptions=True)
                elapsed = time.perf_counter() - started
                vectors = {}
                for row, result in zip(rows, results, strict=False):
                    if not isinstance(result, Exception):
                        vectors[row["id"]] = list(result.embedding)
                query_results = client.infer_many(QUERIES, timeout_s=120)
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.wait(timeout=60)
            server.stop()
        summarize(texts, results, elapsed, tmp_path)
        show_neighbours(rows, vectors, query_results)
    failed = sum(isinstance(result, Exception) for result in results)
    return 1 if failed else 0


def summarize(texts: list[str], results: list, elapsed: float, log_dir: Path) -> None:
    ok = [result for result in results if not isinstance(result, Exception)]
    tokens = sum(result.tokens or 0 for result in ok)
    batches = [
        json.loads(line)
        for path in sorted(log_dir.glob("worker*.batches.jsonl"))
        for line in path.read_text().splitlines()
        if line
    ]
    real = sum(batch["tokens"] for batch in batches)
    padded = sum(batch["padded_tokens"] for batch in batches) or 1
    print()
    print("summary")
    print(f"  requests        {len(texts)} sent, {len(ok)} answered ok, "
          f"{len(texts) - len(ok)} failed")
    print(f"  wall time       {elapsed:.2f} s")
    print(f"  throughput      {len(ok) / elapsed:.1f} requests/s, {tokens / elapsed:.0f} tokens/s")
    print(f"  batches         {len(batches)} (mean {len(ok) / max(1, len(batches)):.1f} rows)")
    print(f"  padding eff.    {real / padded:.3f} (real / padded tokens)")
    if ok:
        print(f"  embedding dim   {ok[0].dim}")


def show_neighbours(rows: list[dict], vectors: dict[str, list[float]], queries: list) -> None:
    if not vectors:
        return
    by_id = {row["id"]: row for row in rows}
    print()
    print("nearest sample text to a few queries (cosine)")
    for query, result in zip(QUERIES, queries, strict=True):
        scored = sorted(
            ((cosine(result.embedding, vector), rid) for rid, vector in vectors.items()),
            reverse=True,
        )
        score, rid = scored[0]
        text = by_id[rid]["text"].replace("\n", " ")
        print(f"  {query}\n    {score:.3f}  {text[:90]}{'…' if len(text) > 90 else ''}")


if __name__ == "__main__":
    sys.exit(main())
