"""Suite ``shards``: one queue over Redis Cluster nodes, and what each node pays per request.

A queue of K shards lives on the streams ``{q:0}`` … ``{q:K-1}`` plus the
plain ``{q}`` (where producers learn K), and in a Redis Cluster each shard's
slot may sit on its own master. This suite runs the same load on a local
3-master/3-replica cluster (``tests/redis_cluster.py``) for K = 1 and K = 3:
separate queues on the same cluster, the K = 3 one named so that its three
shards land on three different masters. Workers run the null backend
(``null_backend:factory``: zeros, no compute), so what a request costs is
Redis and tokenq, not a model.

Load: N requests split over 3 producer threads, each with its own
``Client`` at tokenq's defaults (round-robin shards, dedupe on, queue limit
100,000), enqueuing with ``submit_many`` in calls of 100 and then collecting
every reply with ``results()`` in calls of 1,000; 2 workers ``--shards K``.
Clients and workers are connected and ready before the window opens and
still running when it closes.

Measured on every master, as deltas over that window:

* INFO commandstats: commands per request, in total and per node (per
  request of the whole run, so the nodes add up to the total), and round
  trips per request (classified below);
* INFO cpu (``used_cpu_sys + used_cpu_user``): Redis CPU per request, and
  requests per Redis CPU-second: the requests a node's lanes carried over
  the CPU it spent. ``capacity_per_s`` is the run's requests over the
  busiest node's CPU: the queue's rate once that node fills one core.

The replicas' CPU is read too, and only summed (``replica_cpu_us_per_request``
of the all-masters rows): it is real work, but on cores of its own.

Why CPU and not requests/s: on a machine with fewer cores than busy
processes (producers, workers and six redis-servers here) the wall-clock
rate says how the cores were shared; a node's CPU per request is what it
costs wherever it runs, and one core over it is what one node can carry.

Round trips. INFO counts each command a Lua script or a MULTI runs under
its own name, so a trip is counted as one per command that tokenq never
nests:

* nested (not a trip): whatever tokenq's Lua scripts call, read from its
  ``*.lua`` as the overhead suite does (XLEN, XADD, GET, SET, LINDEX,
  XPENDING, RPUSH, PEXPIRE, XACK, XDEL, …), except EXISTS and TIME; and
  MULTI and HSET, which (with SET and HDEL, also in scripts) tokenq sends
  outside a script only inside its heartbeat and config transactions
  (EXEC is their trip);
* a trip: FCALL (EVALSHA before Redis 7; one per script call) and all else: XREADGROUP,
  XCLAIM, BLMOVE, LRANGE, LTRIM, DEL, HGETALL, HKEYS, EXISTS, EXEC, TIME,
  PING, XINFO, SCRIPT LOAD, CLIENT, HELLO, CLUSTER, WAIT, and COMMAND
  GETKEYS (redis-py's cluster client asking a node where a command with
  "movable" keys, such as XREADGROUP, sends them), …;
* not counted at all: INFO (this suite's own reads) and REPLCONF (the
  replicas' acknowledgements to their masters).

EXISTS and TIME are trips because the scripts run them only off this run's
path (dropping a consumer at exit, timestamping a dead letter), while the
worker sends them on its own (liveness checks, clock sync at each
heartbeat). XPENDING is nested because publish.lua runs it for every
answer; the few the worker's recovery scan sends on its own are missed.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import redis
from suite_overhead import NULL_FLAGS, script_commands
from texts import uniform_mix

from tokenq.producer import Client
from tokenq.shared import keys

# The cluster launcher is the cluster tests' own (tests/ is not installed);
# run.py puts only this folder on sys.path, so add the repository root.
sys.path.insert(0, str(harness.REPO_ROOT))
from tests.redis_cluster import LocalCluster, start_cluster

SIZES = {"tiny": 600, "small": 3000, "full": 30_000}
"""Requests per shard count (each K gets its own queue and its own N)."""
SHARD_COUNTS = (1, 3)
PRODUCERS = 3
WORKERS = 2
SUBMIT_BATCH = 100
RESULTS_BATCH = 1000
REPLY_TIMEOUT_S = 300.0
GPU_RATES = (2_000, 10_000)
"""Illustrative requests/s of one GPU worker, for the capacity arithmetic (not measured)."""
OFF_PATH = frozenset({"exists", "time"})
IN_MULTI = frozenset({"multi", "set", "hset", "hdel"})
NOT_OURS = frozenset({"info", "replconf"})
"""This suite's own INFO reads, and the replicas' REPLCONF ACKs (once a second, not tokenq's)."""
COLUMNS = [
    "setting", "lanes", "requests", "seconds", "requests_per_s", "commands_per_request",
    "round_trips_per_request", "redis_cpu_us_per_request", "requests_per_redis_cpu_s",
    "capacity_per_s",
]


# ------------------------------------------------------------------ readings


@dataclass(frozen=True, slots=True)
class Reading:
    """One node's counters at one moment: calls per command, CPU seconds."""

    commands: dict[str, int]
    cpu_s: float


def read(client: redis.Redis) -> Reading:
    """INFO commandstats and INFO cpu of one node."""
    cpu = client.info("cpu")
    used = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
    return Reading(harness.commandstats(client), used)


def read_all(nodes: dict[int, redis.Redis]) -> dict[int, Reading]:
    return {port: read(client) for port, client in nodes.items()}


def nested_commands() -> frozenset[str]:
    """Commands INFO counts that ride inside another's round trip (module docstring)."""
    return frozenset((script_commands() - OFF_PATH) | IN_MULTI)


def counts(commands: dict[str, int], nested: frozenset[str]) -> tuple[int, int]:
    """(commands, round trips) in a commandstats delta, INFO left out."""
    ours = {name: n for name, n in commands.items() if name not in NOT_OURS}
    return sum(ours.values()), sum(n for name, n in ours.items() if name not in nested)


# ----------------------------------------------------------------- placement


def spread_queue(cluster: LocalCluster, shards: int) -> str:
    """A fresh queue name whose shards' request streams sit on ``shards`` different masters."""
    for _ in range(500):
        name = harness.new_queue(f"k{shards}")
        lanes = keys.shards_of(keys.QueueRef(name), shards)
        if len({cluster.master_for_key(keys.requests(lane)) for lane in lanes}) == shards:
            return name
    raise RuntimeError(f"no queue name spreads {shards} shards over the masters")


def lanes_by_node(cluster: LocalCluster, queue: str, shards: int) -> dict[int, list[keys.QueueRef]]:
    """Master port -> the queue's lanes (shards, and the plain ``{q}``) its slots hold."""
    placed: dict[int, list[keys.QueueRef]] = {port: [] for port in cluster.masters()}
    for lane in keys.lanes_of(keys.QueueRef(queue), shards):
        placed[cluster.master_for_key(keys.requests(lane))].append(lane)
    return placed


def lane_label(lane: keys.QueueRef) -> str:
    return "{q}" if lane.shard is None else f"{{q:{lane.shard}}}"


def requests_by_node(ids: Sequence[str], placed: dict[int, list[keys.QueueRef]]) -> Counter[int]:
    """How many of ``ids`` each node's lanes took (a request id names its shard)."""
    node_of = {lane.shard: port for port, lanes in placed.items() for lane in lanes}
    return Counter(node_of[keys.shard_in_id(rid)] for rid in ids)


# ---------------------------------------------------------------------- load


@contextmanager
def producers(url: str, queue: str) -> Iterator[list[Client]]:
    """PRODUCERS clients, connected and holding the queue's config (so K) before the clock."""
    with ExitStack() as stack:
        clients = [
            stack.enter_context(Client(redis_url=url, queue=queue, timeout_s=60.0))
            for _ in range(PRODUCERS)
        ]
        for client in clients:
            client.config()
        yield clients


def produce(client: Client, texts: Sequence[str]) -> list[str]:
    """One producer thread: enqueue in calls of 100, then wait for every reply; the ids."""
    ids: list[str] = []
    for start in range(0, len(texts), SUBMIT_BATCH):
        ids += client.submit_many(texts[start:start + SUBMIT_BATCH])
    for start in range(0, len(ids), RESULTS_BATCH):
        client.results(ids[start:start + RESULTS_BATCH], REPLY_TIMEOUT_S)  # raises on any error
    return ids


@dataclass(frozen=True, slots=True)
class Window:
    """What one K's run measured: the ids, its wall time, every node's counters."""

    ids: list[str]
    seconds: float
    before: dict[int, Reading]
    after: dict[int, Reading]


def measured_load(url: str, queue: str, texts: Sequence[str], nodes: dict[int, redis.Redis],
                  ) -> Window:
    """Every text through the queue from PRODUCERS threads, between two readings of every node."""
    parts = [texts[i::PRODUCERS] for i in range(PRODUCERS)]
    with producers(url, queue) as clients, ThreadPoolExecutor(PRODUCERS) as pool:
        before = read_all(nodes)
        started = time.perf_counter()
        ids = [rid for got in pool.map(produce, clients, parts) for rid in got]
        seconds = time.perf_counter() - started
        after = read_all(nodes)
    return Window(ids, seconds, before, after)


def run_shards(cluster: LocalCluster, workdir: Path, shards: int, texts: Sequence[str],
               nodes: dict[int, redis.Redis]) -> list[dict[str, Any]]:
    """One queue of ``shards`` shards under the load: a row for all masters, then one each."""
    queue = spread_queue(cluster, shards)
    placed = lanes_by_node(cluster, queue, shards)
    flags = [*NULL_FLAGS, "--shards", str(shards)]
    workers = [
        harness.start_tokenq(cluster, queue, workdir, f"k{shards}-{i}", flags)
        for i in range(WORKERS)
    ]
    with harness.running(workers, cluster.url):
        window = measured_load(cluster.url, queue, texts, nodes)
    return rows_for(shards, window, placed)


# ---------------------------------------------------------------------- rows


@dataclass(frozen=True, slots=True)
class Use:
    """What one node did in a window."""

    commands: dict[str, int]
    cpu_s: float


def use_of(window: Window, port: int) -> Use:
    before, after = window.before[port], window.after[port]
    return Use(harness.commands_delta(before.commands, after.commands), after.cpu_s - before.cpu_s)


def rows_for(shards: int, window: Window, placed: dict[int, list[keys.QueueRef]]
             ) -> list[dict[str, Any]]:
    """The all-masters row, then one row per master (replicas only in the first, as CPU)."""
    uses = {port: use_of(window, port) for port in window.before}
    served = requests_by_node(window.ids, placed)
    masters = sorted(placed)
    nodes = [
        node_row(f"K={shards}, node {port}", placed[port], served[port], uses[port], window)
        for port in masters
    ]
    total = Use(
        sum((Counter(uses[port].commands) for port in masters), Counter()),
        sum(uses[port].cpu_s for port in masters),
    )
    lanes = [lane for port in masters for lane in placed[port]]
    row = node_row(f"K={shards}, all masters", lanes, len(window.ids), total, window)
    row["capacity_per_s"] = round(len(window.ids) / max(uses[p].cpu_s for p in masters))
    replica_cpu = sum(use.cpu_s for port, use in uses.items() if port not in placed)
    row["replica_cpu_us_per_request"] = round(replica_cpu / len(window.ids) * 1e6, 1)
    row["shards"] = shards
    return [row, *nodes]


def node_row(setting: str, lanes: Sequence[keys.QueueRef], served: int, use: Use,
             window: Window) -> dict[str, Any]:
    """Figures of one node (or of all masters together); see the module docstring."""
    requests = len(window.ids)
    commands, trips = counts(use.commands, nested_commands())
    return {
        "setting": setting,
        "lanes": ",".join(lane_label(lane) for lane in lanes) or "-",
        "requests": served,
        "seconds": round(window.seconds, 2),
        "requests_per_s": round(served / window.seconds),
        "commands_per_request": round(commands / requests, 3),
        "round_trips_per_request": round(trips / requests, 4),
        "redis_cpu_us_per_request": round(use.cpu_s / requests * 1e6, 1),
        "requests_per_redis_cpu_s": round(served / use.cpu_s) if served and use.cpu_s else None,
        "commands": use.commands,
    }


def classified(rows: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
    """Every command the runs sent, by how it was counted (nested, round trip, not counted)."""
    seen = {name for row in rows for name in row["commands"]}
    nested = nested_commands()
    return {
        "nested": sorted(seen & nested - NOT_OURS),
        "round_trip": sorted(seen - nested - NOT_OURS),
        "not_counted": sorted(seen & NOT_OURS),
    }


# --------------------------------------------------------------------- notes


def node_rows(rows: Sequence[dict[str, Any]], shards: int) -> list[dict[str, Any]]:
    return [row for row in rows if row["setting"].startswith(f"K={shards}, node")]


def gpus(requests_per_s: float) -> str:
    """How many GPU workers ``requests_per_s`` feeds, at each illustrative GPU rate."""
    return " or ".join(f"{requests_per_s / rate:.1f}" for rate in GPU_RATES)


def capacity_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What one node (one core) carries at the measured cost, and what K nodes carry."""
    few, many = SHARD_COUNTS
    one, spread = (next(r for r in rows if r.get("shards") == k) for k in (few, many))
    (busy,) = [row for row in node_rows(rows, few) if row["requests"]]
    per_node, ceiling = one["capacity_per_s"], spread["capacity_per_s"]
    nodes = node_rows(rows, many)
    shares = " / ".join(str(row["commands_per_request"]) for row in nodes)
    cpus = " / ".join(str(row["redis_cpu_us_per_request"]) for row in nodes)
    rates = " or ".join(f"{rate:,}" for rate in GPU_RATES)
    return [
        f"K={few}: one master carries every request, at {busy['redis_cpu_us_per_request']} us "
        f"of Redis CPU each, so one core carries ~{per_node:,} requests/s; at an illustrative "
        f"(not measured) {rates} requests/s per GPU worker that feeds {gpus(per_node)} GPUs",
        f"K={many}: commands per request by node {shares} (of "
        f"{spread['commands_per_request']}), Redis CPU us per request by node {cpus} (of "
        f"{spread['redis_cpu_us_per_request']}); the busiest node fills one core at "
        f"~{ceiling:,} requests/s, x{ceiling / per_node:.2f} of K={few} (ideal x{many}): "
        f"K shards on K nodes multiply what one node feeds, {gpus(ceiling)} GPUs at those rates",
        f"replicas (not in the table) spent {one['replica_cpu_us_per_request']} (K={few}) and "
        f"{spread['replica_cpu_us_per_request']} (K={many}) us of CPU per request applying "
        "the masters' writes, on cores of their own in a real deployment",
        "requests_per_s is wall-clock on this machine's shared cores (clients, workers and six "
        "redis-servers compete); per-node CPU per request is the figure to carry elsewhere",
    ]


def run(size: str) -> dict[str, Any]:
    texts = uniform_mix(SIZES[size], 8, 40).texts
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tokenq-shards-") as tmp, \
            start_cluster(Path(tmp) / "cluster") as cluster:
        nodes = {port: redis.Redis(port=port) for port in cluster.ports}
        try:
            for shards in SHARD_COUNTS:
                rows += run_shards(cluster, Path(tmp), shards, texts, nodes)
        finally:
            for client in nodes.values():
                client.close()
    return {
        "columns": COLUMNS,
        "rows": rows,
        "config": {
            "cluster": "3 masters + 3 replicas on loopback (tests/redis_cluster.py)",
            "requests_per_k": len(texts),
            "request_tokens": "8-40 (words)",
            "backend": "null_backend:factory (zeros, no compute)",
            "workers": WORKERS,
            "producers": f"{PRODUCERS} threads, submit_many x{SUBMIT_BATCH}, "
                         f"then results() x{RESULTS_BATCH}",
            "commands_seen": classified(rows),
            "gpu_rates_illustrative": list(GPU_RATES),
        },
        "notes": capacity_notes(rows),
    }
