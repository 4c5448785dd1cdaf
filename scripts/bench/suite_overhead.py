"""Suite ``overhead``: what tokenq itself costs per request, with a backend that costs nothing.

Workers run ``null_backend:factory`` (zeros, no compute), so every second of
a run is tokenq's: the producer's enqueue script, Redis, the worker's read,
decode, pack and publish, and the reply's way back. Measured in one run, on
one private redis-server:

* ``redis-benchmark`` ceilings of that server for XADD and RPUSH, one
  command per round trip (``-P 1``) and pipelined (``-P 16``), 50 clients:
  the most requests/s any queue on this server could hope for;
* ``producer only``: the tokenq Client enqueuing a burst with no worker;
* ``worker only``: a worker draining that backlog (clock from its start);
* ``end to end``: producer and 1 (then 2) workers together, a burst of
  short requests, every reply collected;
* ``infer, one at a time``: ``Client.infer`` in a loop with an idle worker:
  the floor of a single request's latency, with the default 2 ms linger
  (an idle device waits that long for company) and with none.

The two split rows also give CPU per request: the producer's own (this
process, ``time.process_time``), the worker process's (``/proc/<pid>/stat``)
and redis-server's during each phase (``INFO cpu``, to the microsecond). On a
machine with fewer cores than busy processes (this one has two, shared by
producer, worker and Redis end to end) requests/s says how the
cores were shared; CPU per request says what each side costs, and their sum
over the core count bounds what end to end can reach.

Redis commands per request come from INFO commandstats deltas. Commands
queued in a MULTI and commands a Lua script calls are counted there one by
one, so round trips are counted as one per command *outside* a transaction
or script, where EXEC stands for its whole transaction and FCALL (EVALSHA before
Redis 7) for its script. Which commands tokenq runs inside scripts is read from its own
``*.lua`` files (every quoted upper-case word that is a command name);
inside MULTI it runs only the heartbeat's and deregistration's SET, HSET,
DEL and HDEL. A command tokenq also issues on its own (XPENDING at exit)
is thereby counted as nested; those are a handful per run, not per request.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import harness
import redis
from harness import RedisServer
from texts import uniform_mix

from tokenq.producer import Client

SIZES = {"tiny": 600, "small": 5000, "full": 20000}
INFER_LOOPS = {"tiny": 30, "small": 200, "full": 500}
BENCH_N = {"tiny": 5000, "small": 50_000, "full": 200_000}
IN_MULTI = {"multi", "set", "hset", "hdel", "del"}
NOT_OURS = {"info"}
LUA_WORD = re.compile(r'"([A-Z]+)"')


def script_commands() -> set[str]:
    """Lower-case names of the commands tokenq's Lua scripts may call."""
    words: set[str] = set()
    for package in ("tokenq.producer", "tokenq.worker", "tokenq.shared"):
        for folder in (resources.files(package), resources.files(package).joinpath("lua")):
            if not folder.is_dir():
                continue
            for entry in folder.iterdir():
                if entry.name.endswith(".lua"):
                    words |= set(LUA_WORD.findall(entry.read_text()))
    return {word.lower() for word in words}
# No length limit, as the producer enqueues: its backlog (up to 200,000) is not written
# around the limit, and the workers would otherwise refuse what lies past theirs.
NULL_FLAGS = ["--backend", "null_backend:factory", "--max-queue-length", "0"]
COLUMNS = [
    "setting", "requests_per_s", "commands_per_request", "round_trips_per_request",
    "p50_ms", "p99_ms", "vs_xadd_pipelined", "cpu_us_per_request", "redis_cpu_us_per_request",
]


def redis_benchmark(server: RedisServer, n: int, pipeline: int, command: list[str]) -> float:
    """Requests/s redis-benchmark reaches for one command against the server."""
    args = [
        "redis-benchmark", "-h", "127.0.0.1", "-p", str(server.port), "-n", str(n),
        "-c", "50", "-P", str(pipeline), "--csv", *command,
    ]
    output = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    rows = list(csv.DictReader(io.StringIO(output)))
    return float(rows[-1]["rps"])


def ceilings(server: RedisServer, n: int) -> list[dict[str, Any]]:
    """redis-benchmark's XADD and RPUSH rates on this server (none if it is not installed)."""
    if shutil.which("redis-benchmark") is None:
        return []
    rows = []
    client = redis.Redis.from_url(server.url)
    for name, command in (("XADD", ["XADD", "bench:stream", "*", "f", "v"]),
                          ("RPUSH", ["-t", "rpush"])):
        for pipeline in (1, 16):
            rps = redis_benchmark(server, n if pipeline > 1 else n // 4, pipeline, command)
            rows.append({
                "setting": f"redis-benchmark {name} -P {pipeline}",
                "requests_per_s": round(rps, 0),
                "commands_per_request": 1.0,
                "round_trips_per_request": round(1 / pipeline, 4),
            })
            client.delete("bench:stream", "mylist")
    client.close()
    return rows


def per_request(commands: dict[str, int], requests: int) -> tuple[float, float]:
    """Commands per request, and round trips per request (see module docstring)."""
    ours = {name: count for name, count in commands.items() if name not in NOT_OURS}
    total = sum(ours.values())
    nested = IN_MULTI | script_commands()
    trips = sum(count for name, count in ours.items() if name not in nested)
    return round(total / requests, 3), round(trips / requests, 4)


def end_to_end(
    server: RedisServer, workdir: Path, texts: list[str], workers: int
) -> dict[str, Any]:
    queue = harness.new_queue(f"e2e{workers}")
    procs = [
        harness.start_tokenq(server, queue, workdir, f"null{workers}-{i}", NULL_FLAGS)
        for i in range(workers)
    ]
    client = redis.Redis.from_url(server.url)
    with harness.running(procs, server.url):
        before = harness.commandstats(client)
        run = harness.burst(server.url, queue, texts, workers=procs)
        commands = harness.commands_delta(before, harness.commandstats(client))
    client.close()
    summary = run.summary()
    cpr, rtpr = per_request(commands, len(texts))
    return {
        "setting": f"end to end, {workers} worker{'s' if workers > 1 else ''}",
        **summary,
        "commands_per_request": cpr,
        "round_trips_per_request": rtpr,
        "commands": commands,
    }


def producer_then_worker(server: RedisServer, workdir: Path, texts: list[str]) -> list[dict]:
    """Enqueue a backlog with no worker, then let one worker drain it: each side alone."""
    queue = harness.new_queue("split")
    reply_key = harness.reply_key_for(queue)
    client = redis.Redis.from_url(server.url)
    before = harness.commandstats(client)
    with Client(redis_url=server.url, queue=queue, max_queue_length=0) as producer:
        started = time.perf_counter()
        own_cpu, server_cpu = time.process_time(), harness.redis_cpu_seconds(client)
        harness.submit_in_chunks(producer, texts, reply_to=reply_key)
        enqueue_s = time.perf_counter() - started
        enqueue_cpu = (
            time.process_time() - own_cpu, harness.redis_cpu_seconds(client) - server_cpu
        )
    middle = harness.commandstats(client)
    worker = harness.start_tokenq(server, queue, workdir, "drain", NULL_FLAGS)
    collector = harness.Collector(server.url, reply_key, len(texts), 600.0, workers=[worker])
    worker.wait_ready(client, poll_s=0.005)
    started = time.perf_counter()
    worker_cpu = harness.cpu_seconds(worker.process.pid)
    server_cpu = harness.redis_cpu_seconds(client)
    collector.start()
    collector.join()
    drain_cpu = (
        harness.cpu_seconds(worker.process.pid) - worker_cpu,
        harness.redis_cpu_seconds(client) - server_cpu,
    )
    harness.check_alive(collector)
    drain_s = max(got.at for got in collector.received.values()) - started
    after = harness.commandstats(client)
    worker.stop()
    client.close()
    produced = per_request(harness.commands_delta(before, middle), len(texts))
    drained = per_request(harness.commands_delta(middle, after), len(texts))
    return [
        {"setting": "producer only (enqueue)", "requests_per_s": round(len(texts) / enqueue_s, 1),
         "commands_per_request": produced[0], "round_trips_per_request": produced[1],
         **cpu_per_request(enqueue_cpu, len(texts))},
        {"setting": "worker only (drain backlog)",
         "requests_per_s": round(len(collector.received) / drain_s, 1),
         "commands_per_request": drained[0], "round_trips_per_request": drained[1],
         **cpu_per_request(drain_cpu, len(texts))},
    ]


def cpu_per_request(cpu: tuple[float, float], requests: int) -> dict[str, float]:
    """(side's CPU s, redis-server's CPU s) over a phase, as microseconds per request."""
    side, server = cpu
    return {
        "cpu_us_per_request": round(side / requests * 1e6, 1),
        "redis_cpu_us_per_request": round(server / requests * 1e6, 1),
    }


def infer_loop(
    server: RedisServer, workdir: Path, texts: list[str], loops: int, linger_ms: float
) -> dict:
    """Single requests, one after another: the latency floor through Redis and a worker."""
    queue = harness.new_queue("infer")
    flags = [*NULL_FLAGS, "--linger-ms", str(linger_ms)]
    worker = harness.start_tokenq(server, queue, workdir, f"single{linger_ms:g}", flags)
    latencies = []
    with harness.running([worker], server.url), Client(redis_url=server.url, queue=queue) as c:
        c.infer(texts[0], timeout_s=10)  # config read and connections, off the clock
        for text in texts[:loops]:
            started = time.perf_counter()
            c.infer(text, timeout_s=10)
            latencies.append((time.perf_counter() - started) * 1000.0)
    latencies.sort()
    return {
        "setting": f"infer, one at a time (linger {linger_ms:g} ms)",
        "requests_per_s": round(len(latencies) / (sum(latencies) / 1000.0), 1),
        "p50_ms": round(harness.percentile(latencies, 50) or 0, 2),
        "p99_ms": round(harness.percentile(latencies, 99) or 0, 2),
    }


def cpu_bound_note(rows: list[dict[str, Any]]) -> list[str]:
    """What the split rows' CPU per request allows end to end on this machine's cores."""
    split = [r for r in rows if "cpu_us_per_request" in r]
    total_us = sum(r["cpu_us_per_request"] + r["redis_cpu_us_per_request"] for r in split)
    if len(split) != 2 or total_us <= 0:
        return []
    cores = os.cpu_count() or 1
    return [
        f"CPU per request, producer + worker + redis-server for both: {total_us:.1f} us; "
        f"{cores} cores allow at most {cores / total_us * 1e6:,.0f} requests/s end to end"
    ]


def run(size: str) -> dict[str, Any]:
    texts = uniform_mix(SIZES[size], 8, 40).texts
    with harness.private_redis() as server, tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        rows = ceilings(server, BENCH_N[size])
        rows += producer_then_worker(server, workdir, texts)
        rows.append(end_to_end(server, workdir, texts, 1))
        rows.append(end_to_end(server, workdir, texts, 2))
        for linger_ms in (2.0, 0.0):
            rows.append(infer_loop(server, workdir, texts, INFER_LOOPS[size], linger_ms))
    xadd = next(
        (r["requests_per_s"] for r in rows if r["setting"] == "redis-benchmark XADD -P 16"), None
    )
    for row in rows:
        row["vs_xadd_pipelined"] = round(row["requests_per_s"] / xadd, 4) if xadd else None
    e2e = next(r for r in rows if r["setting"] == "end to end, 1 worker")
    ceiling = (
        f"{e2e['vs_xadd_pipelined']:.1%} of the server's pipelined XADD ceiling" if xadd
        else "no redis-benchmark on PATH, so no ceiling to compare with"
    )
    return {
        "columns": COLUMNS,
        "rows": rows,
        "config": {
            "requests": len(texts),
            "request_tokens": "8-40 (words)",
            "backend": "null_backend:factory (zeros, no compute)",
            "load": "all requests opened at once (chunked submit_many); latency is time in "
                    "the backlog",
            "round_trips": "commands outside MULTI/EXEC and Lua scripts (see suite docstring)",
        },
        "notes": [
            f"end to end, 1 worker: {e2e['requests_per_s']} requests/s = {ceiling}",
            *cpu_bound_note(rows),
        ],
    }
