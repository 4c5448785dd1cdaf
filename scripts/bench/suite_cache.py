"""Suite ``cache``: the result cache and coalescing of identical requests in flight.

Four rows, each on a private redis-server and sim workers:

- ``re-embed``: a corpus in which half the texts repeat, half of the repeats
  in the same call as their first, half in a later call, sent call after call
  (``infer_many``, 48 texts a call) twice: to a worker without a cache, every
  request ``cache: false`` (nothing shared), then to one with ``--cache-bytes``.
  ``device_tokens_ratio`` is the tokens the second sent to the device over the
  first's (0.5 is every repeat free); ``identical_vectors`` whether every reply's
  vector is byte for byte the first run's.
- ``64 identical``: 64 concurrent ``AsyncClient.infer`` calls of one text, read
  by two workers; ``forward_rows_64_identical`` is the rows their devices ran for
  them, together (1: the worker that did not claim the text waited for its answer).
- ``budget``: far more distinct texts than the cache's budget holds;
  ``cache_bytes_over_budget`` is Redis's own ``MEMORY USAGE`` of the cache's three
  keys past the budget (0: within it).
- ``maxmemory``: the queue's Redis at ``maxmemory`` a few MiB above its empty
  use, ``noeviction``, under a cache whose budget is larger than that;
  ``queue_refused_at_maxmemory`` counts the enqueues Redis refused (the cache
  must leave the queue room), ``used_over_maxmemory`` whether Redis's used memory
  ever passed its maxmemory at the samples taken after each call.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import numpy as np
from texts import uniform_mix

from tokenq.producer import AsyncClient, BrokerOutOfMemory, Client, QueueFull
from tokenq.shared import keys
from tokenq.shared.settings import ClientSettings

UNIQUE = {"tiny": 192, "small": 960, "full": 3840}
CALL = 48
"""Texts a call: 32 first seen, 16 repeated in the same call."""
SIM: dict[str, Any] = {"dim": 64, "max_input_tokens": 512, "batch_ms": 2.0, "token_us": 2.0}
BUDGET = 256 * 1024
BIG_BUDGET = 64 * 1024 * 1024
HEADROOM = 4 * 1024 * 1024
FILL = 4096
"""Distinct texts sent at maxmemory: their cached replies (1 KiB vectors) would take ~6 MiB."""
COLUMNS = ["setting", "requests", "device_tokens", "device_tokens_ratio", "identical_vectors",
           "forward_rows_64_identical", "cache_bytes", "cache_bytes_over_budget",
           "queue_refused_at_maxmemory", "used_over_maxmemory"]


def calls_of(unique: list[str]) -> list[list[str]]:
    """Calls of 32 new texts and 16 of them again; then calls of the other 16 of each, again."""
    firsts, laters = [], []
    for start in range(0, len(unique), 32):
        group = unique[start:start + 32]
        firsts.append(group + group[:16])
        laters += group[16:]
    return firsts + [laters[start:start + CALL] for start in range(0, len(laters), CALL)]


def flags(cache_bytes: int, dim: int = SIM["dim"]) -> list[str]:
    return ["--backend", "sim", *harness.sim_flags({**SIM, "dim": dim}),
            "--max-batch-tokens", "4096", "--cache-bytes", str(cache_bytes)]


def send(url: str, queue: str, calls: list[list[str]], **options: Any) -> list[bytes]:
    """Each call's texts in one ``infer_many``, call after call; every reply's vector bytes."""
    vectors = []
    with Client(redis_url=url, queue=queue) as client:
        for call in calls:
            vectors += [np.asarray(result.embedding, dtype="<f4").tobytes()
                        for result in client.infer_many(call, timeout_s=120, **options)]
    return vectors


def device_tokens(worker: harness.WorkerProc) -> tuple[int, int]:
    batches = worker.batches()
    return sum(b["tokens"] for b in batches), sum(b["rows"] for b in batches)


def re_embed(server: harness.RedisServer, workdir: Path, size: str) -> dict[str, Any]:
    calls = calls_of(uniform_mix(UNIQUE[size], 20, 200).texts)
    runs = []
    for name, cache_bytes, options in (("off", 0, {"cache": False}), ("on", BIG_BUDGET, {})):
        queue = harness.new_queue(f"cache-{name}")
        worker = harness.start_tokenq(server, queue, workdir, f"re-{name}", flags(cache_bytes))
        with harness.running([worker], server.url):
            vectors = send(server.url, queue, calls, **options)
        runs.append((vectors, device_tokens(worker)[0]))
    (off, off_tokens), (on, on_tokens) = runs
    return {"setting": "re-embed, half the texts repeat", "requests": len(off),
            "device_tokens": on_tokens, "device_tokens_ratio": round(on_tokens / off_tokens, 3),
            "identical_vectors": off == on}


def identical_64(server: harness.RedisServer, workdir: Path) -> dict[str, Any]:
    queue = harness.new_queue("same64")
    workers = [harness.start_tokenq(server, queue, workdir, f"same64-{i}", flags(BIG_BUDGET))
               for i in range(2)]

    async def burst() -> None:
        async with AsyncClient(redis_url=server.url, queue=queue) as client:
            await client.config()
            await asyncio.gather(*(client.infer("one question, asked 64 times", timeout_s=60)
                                   for _ in range(64)))

    with harness.running(workers, server.url):
        asyncio.run(burst())
    tokens, rows = map(sum, zip(*map(device_tokens, workers), strict=True))
    return {"setting": "64 identical, concurrent, 2 workers", "requests": 64,
            "device_tokens": tokens, "forward_rows_64_identical": rows}


def cache_usage(client: Any, queue: str) -> int:
    q = keys.QueueRef(queue)
    return sum(client.memory_usage(key, samples=0) or 0 for key in keys.cache(q))


def budget(server: harness.RedisServer, workdir: Path, size: str) -> dict[str, Any]:
    queue = harness.new_queue("budget")
    worker = harness.start_tokenq(server, queue, workdir, "budget", flags(BUDGET))
    texts = [f"distinct text {i} " + "word " * (i % 50) for i in range(4 * UNIQUE[size])]
    with harness.running([worker], server.url):
        send(server.url, queue, [texts[i:i + 256] for i in range(0, len(texts), 256)])
        client = harness.connect(server.url)
        wait(lambda: client.exists(keys.cache(keys.QueueRef(queue))[2]))
        used = cache_usage(client, queue)
    return {"setting": f"budget {BUDGET // 1024} KiB", "requests": len(texts),
            "cache_bytes": used, "cache_bytes_over_budget": max(0, used - BUDGET)}


def maxmemory(workdir: Path) -> dict[str, Any]:
    with harness.private_redis() as server:
        client = harness.connect(server.url)
        queue = harness.new_queue("full")
        worker = harness.start_tokenq(server, queue, workdir, "full", flags(BIG_BUDGET, 256))
        refused, over, sent = 0, False, 0
        with harness.running([worker], server.url):
            limit = int(client.info("memory")["used_memory"]) + HEADROOM
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", limit)
            texts = [f"a text never seen {i} " + "more " * (i % 40)
                     for i in range(FILL)]
            once = ClientSettings(redis_url=server.url, queue=queue, retries=0)
            with Client(settings=once) as producer:
                for start in range(0, len(texts), 128):
                    try:
                        producer.infer_many(texts[start:start + 128], timeout_s=120)
                        sent += 128
                    except (BrokerOutOfMemory, QueueFull):
                        refused += 1
                    over = over or int(client.info("memory")["used_memory"]) > limit
            cached = cache_usage(client, queue)
    return {"setting": f"maxmemory +{HEADROOM >> 20} MiB, cache budget {BIG_BUDGET >> 20} MiB",
            "requests": sent, "cache_bytes": cached, "queue_refused_at_maxmemory": refused,
            "used_over_maxmemory": over}


def wait(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)


def run(size: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tokenq-cache-") as folder:
        workdir = Path(folder)
        with harness.private_redis() as server:
            rows = [re_embed(server, workdir, size), identical_64(server, workdir),
                    budget(server, workdir, size)]
        rows.append(maxmemory(workdir))
    ratio, same = rows[0]["device_tokens_ratio"], rows[0]["identical_vectors"]
    return {
        "columns": COLUMNS,
        "rows": rows,
        "config": {"sim": SIM, "call": CALL, "budget": BUDGET, "headroom": HEADROOM},
        "notes": [f"re-embedding with half the texts repeated sends {ratio}x the tokens to "
                  f"the device (vectors identical: {same}); 64 identical requests ran as "
                  f"{rows[1]['forward_rows_64_identical']} row(s)"],
    }
