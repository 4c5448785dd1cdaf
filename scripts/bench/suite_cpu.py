"""Suite ``cpu``: CPU per request of the producer, the worker and redis-server, each alone.

Why CPU per request rather than requests/s: on this machine's two cores,
requests/s end to end says how producer, worker and Redis shared the cores;
CPU per request says what each one costs, whatever the core count. The
``overhead`` suite has the same two rows among many short phases; this suite
does only these, longer and repeated, so a neighbour's burst moves a figure
less:

* ``producer``: ``Client.submit_many`` enqueues a backlog of short texts
  (``uniform_mix`` of 10–40 characters, 250 a call) with no worker;
  the producer's own ``time.process_time`` and redis-server's ``INFO cpu``
  over the enqueue;
* ``worker``: one worker with the null backend (nothing to compute) drains
  that backlog; its CPU from ``/proc/<pid>/stat`` and redis-server's, from
  the worker's first heartbeat to the last reply on the reply list (this
  process polls ``LLEN`` every 10 ms and runs nothing else meanwhile);
* ``worker floor``: what no worker in Python on redis-py can skip, in this
  process: the same backlog read by ``XREADGROUP`` (1,024 a read, as the
  worker reads), each entry decoded (``wire.decode_fields``), its reply
  packed (``wire.encode_embedding_reply``) and the read answered by one
  ``publish.lua`` call, one step after another with no batching, packing,
  tokenizing, threads or metrics. The worker row can come near it, never
  below it: it is the floor the worker's figure is judged against.

Each size runs ``REPEATS`` backlogs on one private redis-server and reports
the median and the lowest of each figure: interference from other work only
adds CPU, so the lowest is the steadiest figure on a shared machine, and
``--baseline`` compares both. ``redis_both_us`` is redis-server's CPU per
request for the enqueue and the drain together.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import redis
import redis.asyncio as aioredis
from texts import uniform_mix

from tokenq.producer import Client
from tokenq.shared import keys, wire
from tokenq.worker.loop.publish import Publisher, Target
from tokenq.worker.pipeline.jobs import Answer

SIZES = {"tiny": 1000, "small": 10_000, "full": 20_000}
REPEATS = {"tiny": 1, "small": 3, "full": 5}
NULL_FLAGS = ["--backend", "null_backend:factory"]
FLOOR_READ = 1024
"""Entries per read of the floor: the worker's own most (``reader.MAX_READ_COUNT``)."""
FLOOR_DIM = 8
"""The floor's reply vector: the null backend's dimension, so the replies weigh the same."""
COLUMNS = [
    "setting", "cpu_us_per_request", "lowest_cpu_us", "redis_cpu_us_per_request",
    "lowest_redis_cpu_us", "requests_per_s",
]


def enqueue(url: str, queue: str, reply_key: str, texts: list[str]) -> tuple[float, float, float]:
    """(producer CPU s, redis-server CPU s, wall s) of enqueueing ``texts``."""
    client = redis.Redis.from_url(url)
    with Client(redis_url=url, queue=queue, max_queue_length=0) as producer:
        producer.submit_many(texts[:1], reply_to=reply_key)  # connect and load, off the clock
        started = time.perf_counter()
        own, server = time.process_time(), harness.redis_cpu_seconds(client)
        harness.submit_in_chunks(producer, texts[1:], reply_to=reply_key)
        result = (time.process_time() - own, harness.redis_cpu_seconds(client) - server,
                  time.perf_counter() - started)
    client.close()
    return result


def drain(server: Any, workdir: Path, queue: str, name: str, reply_key: str,
          requests: int) -> tuple[float, float, float]:
    """(worker CPU s, redis-server CPU s, wall s) of one null worker answering the backlog."""
    client = redis.Redis.from_url(server.url)
    worker = harness.start_tokenq(server, queue, workdir, name, NULL_FLAGS)
    try:
        worker.wait_ready(client, poll_s=0.005)
        started = time.perf_counter()
        own, redis_cpu = harness.cpu_seconds(worker.process.pid), harness.redis_cpu_seconds(client)
        worker.wait_replies(client, reply_key, requests)
        return (harness.cpu_seconds(worker.process.pid) - own,
                harness.redis_cpu_seconds(client) - redis_cpu, time.perf_counter() - started)
    finally:
        worker.stop()
        client.close()


def has_floor() -> bool:
    """Whether the tokenq measured has the floor's steps (``--baseline`` runs this suite on
    trees older than it: one without the bytes decoder gets no floor row)."""
    try:  # worker/loop/reader.py is newer than 3ca6105
        from tokenq.worker.loop.reader import stream_entries  # noqa: F401
    except ImportError:
        return False
    return hasattr(wire, "decode_fields") and hasattr(wire, "encode_embedding_reply")


def floor(url: str, queue: str, requests: int) -> tuple[float, float, float]:
    """(this process's CPU s, redis-server CPU s, wall s) of the least a worker does."""
    return asyncio.run(_floor(url, queue, requests))


async def _floor(url: str, queue: str, requests: int) -> tuple[float, float, float]:
    from tokenq.worker.loop.reader import stream_entries  # here: has_floor() said it exists

    ref = keys.QueueRef(queue)
    stream = keys.requests(ref)
    client = aioredis.Redis.from_url(url)
    server = redis.Redis.from_url(url)
    try:
        await client.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
        publisher = Publisher(
            client, Target(stream, keys.dead(ref), keys.GROUP, "floor"),
            reply_ttl_ms=600_000, dead_max_len=1000, dead_max_letter_bytes=1000,
        )
        vector = bytes(4 * FLOOR_DIM)
        started = time.perf_counter()
        own, redis_cpu = time.process_time(), harness.redis_cpu_seconds(server)
        answered = 0
        while answered < requests:
            reply = await client.xreadgroup(keys.GROUP, "floor", {stream: ">"}, count=FLOOR_READ)
            answers = []
            for entry_id, fields in stream_entries(reply):
                request = wire.decode_fields(fields)
                payload = wire.encode_embedding_reply(request.id, vector, FLOOR_DIM, tokens=3)
                answers.append(Answer(entry_id, request.reply_to, payload, True,
                                      counted=request.counted))
            answered += await publisher.publish(answers)
        return (time.process_time() - own, harness.redis_cpu_seconds(server) - redis_cpu,
                time.perf_counter() - started)
    finally:
        await client.aclose()
        server.close()


def row(setting: str, runs: list[tuple[float, float, float]], requests: int) -> dict[str, Any]:
    """One side's figures over its runs, in µs per request."""
    own = [run[0] / requests * 1e6 for run in runs]
    server = [run[1] / requests * 1e6 for run in runs]
    return {
        "setting": setting,
        "cpu_us_per_request": round(statistics.median(own), 1),
        "lowest_cpu_us": round(min(own), 1),
        "redis_cpu_us_per_request": round(statistics.median(server), 1),
        "lowest_redis_cpu_us": round(min(server), 1),
        "requests_per_s": round(requests / statistics.median(run[2] for run in runs), 1),
    }


def run(size: str) -> dict[str, Any]:
    requests = SIZES[size]
    texts = uniform_mix(requests, 10, 40).texts
    produced: list[tuple[float, float, float]] = []
    drained: list[tuple[float, float, float]] = []
    floors: list[tuple[float, float, float]] = []
    with harness.private_redis() as server, tempfile.TemporaryDirectory() as directory:
        for repeat in range(REPEATS[size]):
            queue = harness.new_queue(f"cpu{repeat}")
            reply_key = harness.reply_key_for(queue)
            produced.append(enqueue(server.url, queue, reply_key, texts))
            drained.append(drain(server, Path(directory), queue, f"drain{repeat}", reply_key,
                                 requests))
            redis.Redis.from_url(server.url).flushall()
            if has_floor():
                queue = harness.new_queue(f"floor{repeat}")
                enqueue(server.url, queue, harness.reply_key_for(queue), texts)
                floors.append(floor(server.url, queue, requests))
                redis.Redis.from_url(server.url).flushall()
    rows = [row("producer", produced, requests - 1), row("worker", drained, requests)]
    if floors:
        rows.append(row("worker floor", floors, requests))
    both = [p[1] + d[1] for p, d in zip(produced, drained, strict=True)]
    rows.append({
        "setting": "redis-server, both sides",
        "redis_cpu_us_per_request": round(statistics.median(both) / requests * 1e6, 1),
        "lowest_redis_cpu_us": round(min(both) / requests * 1e6, 1),
    })
    return {
        "columns": COLUMNS,
        "rows": rows,
        "notes": [f"{requests:,} requests of 10-40 characters, {REPEATS[size]} backlogs; "
                  "median and lowest of each figure"],
    }
