"""Suite ``feed``: what a GPU worker's host spends around the model's forward, against the
Rust tokenizer alone over the same whole texts.

The hf worker runs all-MiniLM-L6-v2 with its forward skipped (``TOKENQ_BENCH_SKIP_FORWARD=1``:
zeros of the model's shape, answered at once), so its CPU per request is everything a
GPU worker's host does: read, tokenize, pack, pad, publish. It packs under the budget a GPU
worker calibrates for this model (:data:`GPU_BUDGET`), not the CPU's default, under which a
batch's own costs are shared by a quarter as many requests (the ``cpu budget`` row).
The tokenizer is ``tokenizers.Tokenizer.encode_batch`` over the same texts, whole and
untruncated, in this process, measured just before and just after each worker round: the
machine's speed moves between rounds, and each round's ratios are read against its own.
The floor (:func:`floor_cpu`) is the least a Python worker on redis-py can do with the same
queue: one thread reading, decoding, tokenizing whole texts truncated (no prefix), packing,
padding, answering zeros and publishing, with none of tokenq's rules.
Three mixes: the seed scenario (~1,500-word passages, half queries), gpu_seed's (280-330-word
passages, half queries) and short queries (12-28 words). Each round meets a fresh worker with
its whole backlog waiting (at the tiny size, a smoke run, one worker per budget is kept).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import gpu_seed
import harness
import redis
from texts import seed_mix

from tokenq.producer import Client
from tokenq.shared import keys, wire
from tokenq.worker.backends.calibrate import CPU_DEFAULT_TOKENS

SKIP_FORWARD = "TOKENQ_BENCH_SKIP_FORWARD"
SIZES = {"tiny": 48, "small": 4000, "full": 12000}
ROUNDS = {"tiny": 1, "small": 5, "full": 5}
WARM = frozenset({"tiny"})
"""Sizes whose rows share one worker per budget (:class:`WarmWorker`)."""
GPU_BUDGET = 65536
"""What calibration picks on a GPU for all-MiniLM-L6-v2: its cap of 256 rows at the model's
256 tokens (the H200 run in docs/BENCHMARKS.md found 65,536)."""
MIXES = {"seed": lambda n: seed_mix(n).texts, "gpu_seed": gpu_seed.MIXES["seed"],
         "queries": gpu_seed.MIXES["queries"]}
SETTINGS = [("seed", "seed", GPU_BUDGET), ("gpu_seed", "gpu_seed", GPU_BUDGET),
            ("queries", "queries", GPU_BUDGET),
            ("gpu_seed, cpu budget", "gpu_seed", CPU_DEFAULT_TOKENS)]
"""(row, mix, budget) for every row."""
COLUMNS = ["mix", "budget", "worker_cpu_us", "tokenizer_cpu_us", "worker_over_tokenizer",
           "rounds", "floor_over_tokenizer", "requests_per_s"]
READ_COUNT = 1024
DIM, MAX_TOKENS = 384, 256  # all-MiniLM-L6-v2's vectors and input


def skips_forward() -> bool:
    """Whether the tokenq measured has the switch (an older baseline runs its forward)."""
    from tokenq.worker.backends.hf import backend

    return getattr(backend, "SKIP_FORWARD_ENV", None) == SKIP_FORWARD


@functools.cache
def rust_tokenizer(truncate: int | None = None) -> Any:
    """The bundled model's ``tokenizers.Tokenizer``, unpadded, cut at ``truncate`` tokens (read
    from disk once: every round times two calls)."""
    from tokenizers import Tokenizer

    from tokenq.worker.backends.hf.load import bundled_model_dir

    made = Tokenizer.from_file(str(bundled_model_dir() / "tokenizer.json"))
    made.no_padding()
    if truncate is None:
        made.no_truncation()
    else:
        made.enable_truncation(truncate)
    return made


def tokenizer_cpu(texts: list[str]) -> float:
    """CPU seconds of the Rust tokenizer over ``texts``, whole (its threads included)."""
    whole = rust_tokenizer()
    whole.encode_batch(texts[:64])  # its thread pool started, off the clock
    started = time.process_time()
    whole.encode_batch(texts)
    return time.process_time() - started


def enqueue(server: Any, texts: list[str], tag: str) -> tuple[str, str]:
    """``texts`` on a new queue, as tokenq's producer writes them; (queue, reply key)."""
    queue = harness.new_queue(tag)
    reply_key = harness.reply_key_for(queue)
    with Client(redis_url=server.url, queue=queue, max_queue_length=0) as producer:
        harness.submit_in_chunks(producer, texts, reply_to=reply_key)
    return queue, reply_key


def floor_cpu(server: Any, texts: list[str], budget: int, tag: str) -> float:
    """CPU seconds of this process answering ``texts`` from Redis the least a Python worker
    can: read, decode, tokenize what the model reads, pack sorted lengths under the padded
    budget, pad, answer zeros, publish (RPUSH, XACK, XDEL pipelined). One thread, no rules."""
    import numpy as np

    encode = rust_tokenizer(truncate=MAX_TOKENS).encode_batch_fast
    encode(texts[:64])  # its thread pool started, off the clock
    queue, reply_key = enqueue(server, texts, tag)
    stream = keys.requests(keys.QueueRef(queue))
    client = redis.Redis.from_url(server.url)
    client.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)  # a worker's first act
    started, answered = time.process_time(), 0
    while answered < len(texts):
        entries = client.xreadgroup(keys.GROUP, "floor", {stream: ">"}, count=READ_COUNT)[0][1]
        requests = [wire.decode_fields(fields) for _, fields in entries]
        rows = [encoding.ids for encoding in encode([r.text.lower() for r in requests])]
        lengths = np.array([len(row) for row in rows])
        order = np.argsort(lengths, kind="stable")
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and lengths[order[end]] * (end + 1 - start) <= budget:
                end += 1
            batch, start = order[start:end], end
            mask = np.arange(lengths[batch].max()) < lengths[batch][:, None]
            ids = np.zeros(mask.shape, np.int64)
            ids[mask] = np.concatenate([rows[i] for i in batch])
            vectors = np.zeros((len(batch), DIM), np.float32)
            replies = wire.encode_embedding_replies(
                [requests[i].id for i in batch], vectors.tobytes(), DIM, lengths[batch].tolist())
            done = [entries[i][0] for i in batch]
            pipe = client.pipeline(transaction=False)
            pipe.rpush(reply_key, *replies).xack(stream, keys.GROUP, *done).xdel(stream, *done)
            pipe.execute()
        answered += len(entries)
    spent = time.process_time() - started
    client.delete(stream, reply_key)
    client.close()
    return spent


def start_worker(server: Any, queue: str, workdir: Path, tag: str,
                 budget: int) -> harness.WorkerProc:
    return harness.start_tokenq(
        server, queue, workdir, tag, ["--backend", "hf", "--max-batch-tokens", str(budget)],
        env={SKIP_FORWARD: "1"})


def worker_cpu(
    server: Any, workdir: Path, texts: list[str], budget: int, tag: str,
) -> tuple[float, float]:
    """(worker CPU s, wall s) of a fresh hf worker, forward skipped, meeting ``texts`` waiting."""
    queue, reply_key = enqueue(server, texts, tag)
    client = redis.Redis.from_url(server.url)
    worker = start_worker(server, queue, workdir, tag, budget)
    try:
        worker.wait_ready(client, poll_s=0.005)
        started = time.perf_counter()
        own = harness.cpu_seconds(worker.process.pid)
        worker.wait_replies(client, reply_key, len(texts))
        return harness.cpu_seconds(worker.process.pid) - own, time.perf_counter() - started
    finally:
        worker.stop()
        client.delete(keys.requests(keys.QueueRef(queue)), reply_key)
        client.close()


class WarmWorker:
    """One hf worker (forward skipped) kept across rows at the tiny size, where its start
    costs more than a mix: each call sends the texts once it waits, clocked from the send."""

    def __init__(self, server: Any, workdir: Path, budget: int) -> None:
        self.queue = harness.new_queue(f"warm{budget}")
        self.client = redis.Redis.from_url(server.url)
        self.producer = Client(redis_url=server.url, queue=self.queue, max_queue_length=0)
        self.worker = start_worker(server, self.queue, workdir, f"warm{budget}", budget)
        try:
            self.worker.wait_ready(self.client)
            self.producer.config()  # the queue's config (and tokenizer) loaded off the clock
        except BaseException:
            self.close()  # a worker that never got ready is not left running
            raise

    def __call__(self, texts: list[str]) -> tuple[float, float]:
        reply_key = harness.reply_key_for(self.queue)
        started = time.perf_counter()
        own = harness.cpu_seconds(self.worker.process.pid)
        harness.submit_in_chunks(self.producer, texts, reply_to=reply_key)
        self.worker.wait_replies(self.client, reply_key, len(texts))
        spent = harness.cpu_seconds(self.worker.process.pid) - own
        self.client.delete(reply_key)
        return spent, time.perf_counter() - started

    def close(self) -> None:
        self.producer.close()
        self.worker.stop()
        self.client.close()

    def __enter__(self) -> WarmWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure(server: Any, workdir: Path, name: str, texts: list[str], budget: int,
            rounds: int, warm: WarmWorker | None = None) -> dict[str, Any]:
    """One row: each round the tokenizer, a fresh worker (or ``warm``), the floor, the
    tokenizer again."""
    requests = len(texts)
    tokenizer_runs: list[float] = []
    worker_runs: list[tuple[float, float]] = []
    ratios: list[float] = []
    floors: list[float] = []
    for i in range(rounds):
        tag = f"{name.split(',')[0]}{i}"
        before = tokenizer_cpu(texts)
        spent = warm(texts) if warm else worker_cpu(server, workdir, texts, budget, tag)
        floor = floor_cpu(server, texts, budget, f"{tag}floor")
        after = tokenizer_cpu(texts)
        tokenizer_runs += [before, after]
        worker_runs.append(spent)
        ratios.append(spent[0] / ((before + after) / 2))
        floors.append(floor / ((before + after) / 2))
    worker = statistics.median(cpu for cpu, _ in worker_runs)
    return {
        "mix": name,
        "budget": budget,
        "worker_cpu_us": round(worker / requests * 1e6, 1),
        "tokenizer_cpu_us": round(statistics.median(tokenizer_runs) / requests * 1e6, 1),
        "worker_over_tokenizer": round(statistics.median(ratios), 3),
        "rounds": ", ".join(f"{r:.2f}" for r in ratios),
        "floor_over_tokenizer": round(statistics.median(floors), 3),
        "requests_per_s": round(requests / statistics.median(w for _, w in worker_runs), 1),
    }


def run(size: str) -> dict[str, Any]:
    requests, rounds = SIZES[size], ROUNDS[size]
    texts = {mix: make(requests) for mix, make in MIXES.items()}
    notes = [f"{requests:,} requests a row, {rounds} rounds (ratio: the median round's, each "
             "against the tokenizer just before and after it); all-MiniLM-L6-v2 (256 tokens), "
             "forward skipped"]
    if not skips_forward():
        notes.append("this tokenq has no forward switch: no rows")
        return {"columns": COLUMNS, "rows": [], "notes": notes}
    with harness.private_redis() as server, tempfile.TemporaryDirectory() as directory, \
            contextlib.ExitStack() as stack:
        workdir = Path(directory)
        budgets = {budget for _, _, budget in SETTINGS} if size in WARM else set()
        warm = {budget: stack.enter_context(WarmWorker(server, workdir, budget))
                for budget in budgets}
        rows = [measure(server, workdir, name, texts[mix], budget, rounds, warm.get(budget))
                for name, mix, budget in SETTINGS]
    return {"columns": COLUMNS, "rows": rows, "notes": notes}
