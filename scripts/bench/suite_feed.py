"""Suite ``feed``: what a worker spends around the model's forward, against the Rust
tokenizer alone over the same whole texts.

The hf worker runs all-MiniLM-L6-v2 with its forward skipped (``TOKENQ_BENCH_SKIP_FORWARD=1``:
zeros of the model's shape, answered at once), so its CPU per request is everything a
GPU worker's host does: read, tokenize, pack, pad, publish. The tokenizer row is
``tokenizers.Tokenizer.encode_batch`` over the same texts, whole and untruncated, in this
process. Three mixes: the seed scenario (~1,500-word passages, half queries), gpu_seed's
(280-330-word passages, half queries) and short queries (12-28 words). Each mix meets a
fresh worker with its whole backlog waiting; at ``--size tiny`` (a smoke run) one worker,
started once, answers the three mixes in turn, each sent once it waits.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import redis
from texts import seed_mix, uniform_mix

from tokenq.producer import Client

SKIP_FORWARD = "TOKENQ_BENCH_SKIP_FORWARD"
SIZES = {"tiny": 48, "small": 2000, "full": 6000}
REPEATS = {"tiny": 1, "small": 3, "full": 3}
MIXES = {
    "seed": lambda n: seed_mix(n).texts,
    "gpu_seed": lambda n: seed_mix(n, passages=(280, 330)).texts,
    "queries": lambda n: uniform_mix(n, 12, 28).texts,
}
ONE_WORKER = frozenset({"tiny"})
"""Sizes whose mixes one worker answers in turn (a worker's start costs more than a tiny mix)."""
COLUMNS = ["mix", "worker_cpu_us", "tokenizer_cpu_us", "worker_over_tokenizer", "requests_per_s"]


def skips_forward() -> bool:
    """Whether the tokenq measured has the switch (an older baseline runs its forward)."""
    from tokenq.worker.backends.hf import backend

    return getattr(backend, "SKIP_FORWARD_ENV", None) == SKIP_FORWARD


def tokenizer_cpu(texts: list[str]) -> float:
    """CPU seconds of the Rust tokenizer over ``texts``, whole (its threads included)."""
    from tokenizers import Tokenizer

    from tokenq.worker.backends.hf.load import bundled_model_dir

    tokenizer = Tokenizer.from_file(str(bundled_model_dir() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    tokenizer.encode_batch(texts[:64])  # its thread pool started, off the clock
    started = time.process_time()
    tokenizer.encode_batch(texts)
    return time.process_time() - started


def submit(producer: Client, texts: list[str], reply_key: str) -> None:
    for start in range(0, len(texts), harness.SUBMIT_CHUNK):
        producer.submit_many(texts[start:start + harness.SUBMIT_CHUNK], reply_to=reply_key)


def start_worker(server: Any, queue: str, workdir: Path, tag: str) -> harness.WorkerProc:
    return harness.start_tokenq(server, queue, workdir, tag, ["--backend", "hf"],
                                env={SKIP_FORWARD: "1"})


def worker_cpu(server: Any, workdir: Path, texts: list[str], tag: str) -> tuple[float, float]:
    """(worker CPU s, wall s) of one hf worker, forward skipped, answering ``texts``."""
    queue = harness.new_queue(tag)
    reply_key = harness.reply_key_for(queue)
    with Client(redis_url=server.url, queue=queue, max_queue_length=0) as producer:
        submit(producer, texts, reply_key)
    client = redis.Redis.from_url(server.url)
    worker = start_worker(server, queue, workdir, tag)
    try:
        worker.wait_ready(client, poll_s=0.005)
        started = time.perf_counter()
        own = harness.cpu_seconds(worker.process.pid)
        worker.wait_replies(client, reply_key, len(texts))
        return harness.cpu_seconds(worker.process.pid) - own, time.perf_counter() - started
    finally:
        worker.stop()
        client.close()


def one_worker_cpu(
    server: Any, workdir: Path, mixes: dict[str, list[str]],
) -> dict[str, tuple[float, float]]:
    """Each mix's (worker CPU s, wall s), one hf worker (forward skipped) answering them in
    turn, each mix sent once the worker waits (its clock from the first submit)."""
    queue = harness.new_queue("feed")
    client = redis.Redis.from_url(server.url)
    worker = start_worker(server, queue, workdir, "feed")
    spent: dict[str, tuple[float, float]] = {}
    try:
        worker.wait_ready(client)
        with Client(redis_url=server.url, queue=queue, max_queue_length=0) as producer:
            producer.config()  # the queue's config (and tokenizer) loaded off the clock
            for mix, texts in mixes.items():
                reply_key = harness.reply_key_for(queue)
                started = time.perf_counter()
                own = harness.cpu_seconds(worker.process.pid)
                submit(producer, texts, reply_key)
                worker.wait_replies(client, reply_key, len(texts))
                spent[mix] = (harness.cpu_seconds(worker.process.pid) - own,
                              time.perf_counter() - started)
        return spent
    finally:
        worker.stop()
        client.close()


def run(size: str) -> dict[str, Any]:
    requests = SIZES[size]
    rows = []
    skipped = skips_forward()
    mixes = {mix: make(requests) for mix, make in MIXES.items()}
    with harness.private_redis() as server, tempfile.TemporaryDirectory() as directory:
        shared: dict[str, tuple[float, float]] = {}
        if skipped and size in ONE_WORKER:
            shared = one_worker_cpu(server, Path(directory), mixes)
        for mix, texts in mixes.items():
            tokenizer = statistics.median(tokenizer_cpu(texts) for _ in range(REPEATS[size]))
            if mix in shared:
                runs = [shared[mix]]
            else:
                runs = [worker_cpu(server, Path(directory), texts, f"{mix.replace('_', '')}{i}")
                        for i in range(REPEATS[size])] if skipped else []
            row: dict[str, Any] = {
                "mix": mix,
                "tokenizer_cpu_us": round(tokenizer / requests * 1e6, 1),
            }
            if runs:
                worker = statistics.median(run[0] for run in runs)
                row |= {
                    "worker_cpu_us": round(worker / requests * 1e6, 1),
                    "worker_over_tokenizer": round(worker / tokenizer, 3),
                    "requests_per_s": round(requests / statistics.median(r[1] for r in runs), 1),
                }
            rows.append(row)
            redis.Redis.from_url(server.url).flushall()
    notes = [f"{requests:,} requests a mix, median of {REPEATS[size]}; all-MiniLM-L6-v2 "
             "(256 tokens), forward skipped"]
    if not skipped:
        notes.append("this tokenq has no forward switch: worker rows left out")
    return {"columns": COLUMNS, "rows": rows, "notes": notes}
