"""What every suite measures with: a private Redis, worker subprocesses, a timing producer.

Why one module: the suites are only comparable if they time the same thing
the same way. Here that is always *enqueue to reply received by the
producer*, on one clock (``time.perf_counter`` in the benchmark process):

* the producer is tokenq's own :class:`~tokenq.producer.Client` (the Lua
  enqueue script, its token estimate), with every reply sent to one shared
  reply key, as ``infer_many`` does;
* a :class:`Collector` thread drains that key with BLPOP + LPOP and stamps
  each reply as it lands, so a reply's latency never includes time the
  producer spent doing something else;
* workers are real processes (``python -m tokenq.worker``, or the baseline
  in ``fifo_worker.py``), started and ready before the clock starts, and
  stopped with SIGTERM afterwards so they flush their batch logs and stats.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import redis
from redis.cluster import ClusterNode

from tokenq.producer import Client
from tokenq.producer.config import EstimatorMode
from tokenq.shared import keys, wire
from tokenq.shared.redis_url import parse_redis_url

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent.parent
# The private redis-server is the tests' own (tests/ is not installed): add the repository root.
sys.path.insert(0, str(REPO_ROOT))
from tests.redis_server import RedisServer  # noqa: E402

SUBMIT_CHUNK = 250
"""Requests per ``submit_many`` call in a burst (one Lua script call each)."""
RUNTIME_ENV = "BENCH_RUNTIME"
"""``run.py --runtime``: the hf runtime a suite compares with torch (``torch``: none)."""


# --------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    """What the figures were measured on; the load average says how busy it was."""
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory_gib = None
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    versions = {}
    for package in ("torch", "transformers", "sentence-transformers", "redis", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    try:
        redis_server = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, check=False
        ).stdout.split()[2].removeprefix("v=")
    except (OSError, IndexError):
        redis_server = None
    return {
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "cpu": cpu,
        "python": platform.python_version(),
        "redis_server": redis_server,
        "load_average_1m": round(os.getloadavg()[0], 2),
        **versions,
    }


# ----------------------------------------------------------------------- redis


@contextlib.contextmanager
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of our own (no persistence), so INFO counts only what we do."""
    with tempfile.TemporaryDirectory(prefix="tokenq-bench-") as directory:
        server = RedisServer(Path(directory) / "redis")
        server.start()
        try:
            yield server
        finally:
            server.stop()


class Reachable(Protocol):
    """Anything workers can be pointed at: a :class:`RedisServer`, or a local Redis Cluster."""

    @property
    def url(self) -> str: ...


def connect(url: str) -> redis.Redis | redis.RedisCluster:
    """The suite's own client for ``url`` (liveness checks, INFO).

    Why not ``redis.Redis.from_url``: it cannot read tokenq's
    ``redis+cluster://`` URLs, which the shards suite points workers at.
    """
    target = parse_redis_url(url)
    if target.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.nodes]
        return redis.RedisCluster(startup_nodes=nodes)
    return redis.Redis.from_url(url)


def new_queue(tag: str) -> str:
    """A queue name no earlier run in the same server used."""
    return f"bench-{tag}-{secrets.token_hex(3)}"


def cpu_seconds(pid: int) -> float:
    """CPU a live process has used so far, all its threads (Linux; 0.0 elsewhere).

    Why: on a machine with fewer cores than busy processes, requests/s says
    how the cores were shared as much as what each side costs; CPU per
    request says what each side costs.

    Read from the process's own CPU-time clock (what ``clock_getcpuclockid``
    names: ``~pid << 3 | 2``, the scheduler's count, to the nanosecond), not
    from ``/proc/<pid>/stat``, which counts in clock ticks of 10 ms: a tiny
    run's drain takes less than one, and read 0.0.
    """
    try:
        return time.clock_gettime((~pid << 3) | _CPUCLOCK_SCHED)
    except (OSError, AttributeError):
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_CPUCLOCK_SCHED = 2
"""Linux's clock id kind for a process's whole CPU time (all threads, by the scheduler)."""


def peak_rss_bytes(pid: int) -> int | None:
    """The most resident memory a live process has held so far (Linux ``VmHWM``; None
    elsewhere or once it is gone).

    Why the kernel's high-water mark and not samples: a forward's peak lasts
    milliseconds, which a poll would miss; the kernel keeps the largest.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def redis_pid(client: redis.Redis) -> int:
    """The server's process id, from INFO."""
    return int(client.info("server")["process_id"])


def redis_cpu_seconds(client: redis.Redis) -> float:
    """redis-server's user + system CPU so far, from INFO cpu (``used_cpu_sys`` +
    ``used_cpu_user``).

    Why not :func:`cpu_seconds` on its pid: ``/proc`` counts in clock ticks
    (10 ms), which on a run of a few thousand requests is ±2 µs per request
    of a figure near 10; INFO reads getrusage, to the microsecond.
    """
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def commandstats(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the server started (INFO commandstats)."""
    stats = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if isinstance(value, dict)
    }


def commands_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Per-command call counts between two :func:`commandstats` snapshots."""
    delta = {name: after[name] - before.get(name, 0) for name in after}
    return {name: count for name, count in sorted(delta.items()) if count}


# --------------------------------------------------------------------- workers


class WorkerProc:
    """One worker subprocess (tokenq or the fixed-count baseline), logs to files."""

    def __init__(
        self,
        command: list[str],
        *,
        name: str,
        queue: str,
        redis_url: str,
        workdir: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.queue = queue
        self.log_path = workdir / f"{name}.log"
        self.batch_log = workdir / f"{name}.batches.jsonl"
        self.stats_path = workdir / f"{name}.sim.json"
        self.peak_rss_bytes: int | None = None
        """Its resident memory's high-water mark, read as it is asked to stop."""
        full_env = dict(os.environ)
        full_env.update(
            TOKENQ_REDIS_URL=redis_url,
            TOKENQ_QUEUE=queue,
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            BENCH_SIM_STATS=str(self.stats_path),
            PYTHONPATH=os.pathsep.join(
                [str(BENCH_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        )
        full_env.update(env or {})
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            command, env=full_env, cwd=BENCH_DIR, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(
        self, client: redis.Redis | redis.RedisCluster, timeout: float = 120.0,
        poll_s: float = 0.05,
    ) -> None:
        """Block until the worker's liveness key exists (it has joined the group); a suite
        that times a backlog's drain from here polls finely (it starts reading at once)."""
        alive = keys.worker_alive(keys.QueueRef(self.queue), self.name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if client.exists(alive):
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited early:\n{self.output()}")
            time.sleep(poll_s)
        raise RuntimeError(f"worker {self.name} not ready in {timeout}s:\n{self.output()}")

    def wait_replies(self, client: redis.Redis, reply_key: str, count: int,
                     timeout: float = 600.0) -> None:
        """Block until ``reply_key`` holds ``count`` replies; raise if the worker stops first."""
        deadline = time.monotonic() + timeout
        while client.llen(reply_key) < count:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.name} stopped answering:\n{self.output()}")
            time.sleep(0.01)

    def stop(self, timeout: float = 60.0) -> bool:
        """SIGTERM (the worker answers what it holds and flushes its logs), then reap;
        False when it had to be killed (its batch log and counters may be incomplete)."""
        clean = True
        if self.process.poll() is None:
            self.peak_rss_bytes = peak_rss_bytes(self.process.pid)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                clean = False
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()
        return clean

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def batches(self) -> list[dict[str, Any]]:
        """The worker's batch log: one record per batch it ran."""
        if not self.batch_log.exists():
            return []
        lines = self.batch_log.read_text().splitlines()
        return [json.loads(line) for line in lines if line]

    def sim_stats(self) -> dict[str, Any] | None:
        """What its simulated device counted (written at exit by ``sim_probe``)."""
        if not self.stats_path.exists():
            return None
        return json.loads(self.stats_path.read_text())


def sim_flags(sim: dict[str, Any]) -> list[str]:
    """``--sim-*`` flags for a sim parameter dict such as ``{"batch_ms": 2}``."""
    flags: list[str] = []
    for name, value in sim.items():
        flags += [f"--sim-{name.replace('_', '-')}", str(value)]
    return flags


VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "torch": ((), {}),
    "onnx": (("--runtime", "onnx"), {"runtime": "onnx"}),
    "bf16-mixed": (("--dtype", "bf16-mixed"), {"dtype": "bf16-mixed"}),
}
"""What an hf worker is compared with torch fp32 on: its ``tokenq worker`` flags and
``HFOptions`` fields (``run.py --runtime onnx`` or ``--dtype bf16-mixed``). Torch has no
flag, so an older tokenq (``--baseline``) runs it."""


def bench_runtime() -> str:
    """The variant ``run.py --runtime``/``--dtype`` asked the suite to compare with torch."""
    runtime = os.environ.get(RUNTIME_ENV, "torch")
    if runtime not in VARIANTS:
        raise SystemExit(f"{RUNTIME_ENV}={runtime!r}: expected one of {', '.join(VARIANTS)}")
    return runtime


def variant_flags(variant: str) -> list[str]:
    """``tokenq worker`` flags of a :data:`VARIANTS` entry."""
    return list(VARIANTS[variant][0])


def variant_options(variant: str) -> dict[str, str]:
    """``HFOptions`` fields of a :data:`VARIANTS` entry."""
    return dict(VARIANTS[variant][1])


def start_tokenq(
    server: Reachable, queue: str, workdir: Path, name: str, flags: Sequence[str],
    env: dict[str, str] | None = None,
) -> WorkerProc:
    """``python -m tokenq.worker`` with a batch log, as an operator would run it."""
    command = [
        sys.executable, "-m", "tokenq.worker", "--consumer", name,
        "--batch-log", str(workdir / f"{name}.batches.jsonl"), *flags,
    ]
    return WorkerProc(
        command, name=name, queue=queue, redis_url=server.url, workdir=workdir, env=env
    )


def start_fifo(
    server: RedisServer, queue: str, workdir: Path, name: str, batch_size: int,
    sim: dict[str, Any],
) -> WorkerProc:
    """The classic fixed-count micro-batcher of ``fifo_worker.py``."""
    command = [
        sys.executable, str(BENCH_DIR / "fifo_worker.py"), "--consumer", name,
        "--batch-size", str(batch_size),
        "--batch-log", str(workdir / f"{name}.batches.jsonl"), *sim_flags(sim),
    ]
    return WorkerProc(command, name=name, queue=queue, redis_url=server.url, workdir=workdir)


@contextlib.contextmanager
def running(workers: list[WorkerProc], redis_url: str) -> Iterator[list[WorkerProc]]:
    """Wait until every worker is ready; stop them all on the way out."""
    client = connect(redis_url)
    try:
        for worker in workers:
            worker.wait_ready(client)
        yield workers
    finally:
        killed = [worker for worker in workers if not worker.stop()]
        client.close()
    if killed:  # a figure read from a killed worker would be missing or partial
        raise RuntimeError("workers ignored SIGTERM and were killed; their logs:\n" + "\n".join(
            f"{worker.name}:\n{worker.output()[-2000:]}" for worker in killed))


# -------------------------------------------------------------------- producer


@dataclass(slots=True)
class Received:
    """One reply as the producer saw it: when it landed and what it said."""

    at: float
    ok: bool
    tokens: int
    error: str | None
    embedding: bytes | None = None


class Collector(threading.Thread):
    """Drains one shared reply key and stamps every reply the moment it lands."""

    def __init__(
        self, redis_url: str, reply_key: str, expected: int, timeout_s: float,
        *, keep_vectors: bool = False, workers: Sequence[WorkerProc] = (),
    ) -> None:
        super().__init__(daemon=True, name="bench-collector")
        self.keep_vectors = keep_vectors
        self.reply_key = reply_key
        self.expected = expected
        self.deadline = time.monotonic() + timeout_s
        self.received: dict[str, Received] = {}
        self.workers = list(workers)
        self.dead: WorkerProc | None = None
        """A worker that exited while replies were still owed (the run is void)."""
        self._client = redis.Redis.from_url(redis_url)

    def run(self) -> None:
        client = self._client
        while len(self.received) < self.expected and time.monotonic() < self.deadline:
            popped = client.blpop([self.reply_key], timeout=0.5)
            if popped is None:
                self.dead = next((w for w in self.workers if w.process.poll() is not None), None)
                if self.dead is not None:
                    break
                continue
            raws = [popped[1], *(client.lpop(self.reply_key, 1000) or [])]
            now = time.perf_counter()
            for raw in raws:
                reply = wire.decode_reply(raw)
                error = None if reply.error is None else reply.error.code
                vector = reply.embedding if self.keep_vectors else None
                self.received[reply.id] = Received(now, reply.ok, reply.tokens or 0, error, vector)
        client.close()


@dataclass(slots=True)
class Run:
    """When each request was sent (or was due) and when its reply came back."""

    sent: dict[str, float] = field(default_factory=dict)
    received: dict[str, Received] = field(default_factory=dict)
    behind_ms: list[float] = field(default_factory=list)
    """Open loop only: how late each submit was against its Poisson schedule."""
    order: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.sent)

    @property
    def ok(self) -> list[str]:
        return [rid for rid, got in self.received.items() if got.ok]

    @property
    def failed(self) -> int:
        """Requests answered with an error, or not answered at all."""
        return self.requests - len(self.ok)

    @property
    def makespan_s(self) -> float:
        """First request sent to last reply received."""
        if not self.received:
            return math.nan
        return max(got.at for got in self.received.values()) - min(self.sent.values())

    def latencies_ms(self) -> list[float]:
        """Enqueue (or due time) to reply received, successful requests only."""
        return sorted(
            (self.received[rid].at - self.sent[rid]) * 1000.0 for rid in self.ok
        )

    def useful_tokens(self) -> int:
        return sum(self.received[rid].tokens for rid in self.ok)

    def summary(self) -> dict[str, Any]:
        """The figures every suite reports about a run."""
        latencies = self.latencies_ms()
        span = self.makespan_s
        return {
            "requests": self.requests,
            "failed_requests": self.failed,
            "seconds": round(span, 3),
            "requests_per_s": round(len(self.ok) / span, 1) if span > 0 else None,
            "useful_tokens_per_s": round(self.useful_tokens() / span, 0) if span > 0 else None,
            "p50_ms": _round(percentile(latencies, 50)),
            "p99_ms": _round(percentile(latencies, 99)),
        }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def reply_key_for(queue: str) -> str:
    """A reply key under the queue's own hash tag, as ``infer_many`` would make."""
    return keys.reply(keys.QueueRef(queue), f"bench-{secrets.token_hex(4)}")


def submit_in_chunks(producer: Client, texts: Sequence[str], **options: Any) -> None:
    """Enqueue ``texts`` with ``producer``, :data:`SUBMIT_CHUNK` a ``submit_many`` call."""
    for start in range(0, len(texts), SUBMIT_CHUNK):
        producer.submit_many(texts[start:start + SUBMIT_CHUNK], **options)


def burst(
    redis_url: str, queue: str, texts: Sequence[str], *, timeout_s: float = 600.0,
    keep_vectors: bool = False, workers: Sequence[WorkerProc] = (),
    estimator: EstimatorMode = "auto",
) -> Run:
    """Open every request at once (chunked ``submit_many``), collect every reply.

    ``Run.order`` lists the request ids in the order of ``texts``. ``estimator``
    is the client's (``"heuristic"`` keeps a tokenizer out of the producer).
    """
    reply_key = reply_key_for(queue)
    collector = Collector(
        redis_url, reply_key, len(texts), timeout_s, keep_vectors=keep_vectors, workers=workers
    )
    collector.start()
    run = Run()
    with Client(
        redis_url=redis_url, queue=queue, max_queue_length=0, estimator=estimator
    ) as client:
        client.config()  # load the queue's config (and tokenizer) before the clock starts
        for start in range(0, len(texts), SUBMIT_CHUNK):
            sent_at = time.perf_counter()
            ids = client.submit_many(texts[start:start + SUBMIT_CHUNK], reply_to=reply_key)
            run.sent.update(dict.fromkeys(ids, sent_at))
            run.order += ids
    collector.join()
    check_alive(collector)
    run.received = collector.received
    return run


def open_loop(
    redis_url: str, queue: str, texts: Sequence[str], rate_per_s: float, *,
    seed: int = 11, timeout_s: float = 600.0, workers: Sequence[WorkerProc] = (),
) -> Run:
    """Send at Poisson arrival times whatever the replies do (open loop).

    A request's latency is measured from its *scheduled* time, so a sender
    that fell behind does not hide queueing delay (no coordinated omission);
    ``behind_ms`` says how far behind it fell.
    """
    rng = random.Random(seed)
    reply_key = reply_key_for(queue)
    collector = Collector(redis_url, reply_key, len(texts), timeout_s, workers=workers)
    collector.start()
    run = Run()
    with Client(redis_url=redis_url, queue=queue, max_queue_length=0) as client:
        client.config()  # load the queue's config before the clock starts
        due = time.perf_counter()
        for text in texts:
            due += rng.expovariate(rate_per_s)
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            else:
                run.behind_ms.append(-wait * 1000.0)
            request_id = client.submit(text, reply_to=reply_key)
            run.sent[request_id] = due
    collector.join()
    check_alive(collector)
    run.received = collector.received
    return run


def check_alive(collector: Collector) -> None:
    """A worker that died mid-run voids the figures: fail loudly with its log."""
    if collector.dead is not None:
        tail = "\n".join(collector.dead.output().splitlines()[-30:])
        raise RuntimeError(
            f"worker {collector.dead.name} exited with {collector.dead.process.returncode} "
            f"while {collector.expected - len(collector.received)} replies were owed:\n{tail}"
        )


# ------------------------------------------------------------------ arithmetic


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile of sorted ``values`` (linear interpolation), None when empty."""
    if not values:
        return None
    position = (len(values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def batch_totals(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Totals over batch-log records (every batch handed to the device)."""
    batches = len(records)
    tokens = sum(r["tokens"] for r in records)
    padded = sum(r["padded_tokens"] for r in records)
    device_ms = sum(r["device_ms"] for r in records)
    rows = sum(r["rows"] for r in records)
    return {
        "batches": batches,
        "mean_rows": round(rows / batches, 2) if batches else None,
        "padding_efficiency": round(tokens / padded, 4) if padded else None,
        "mean_batch_ms": round(device_ms / batches, 3) if batches else None,
        "device_ms": round(device_ms, 1),
        "oom_splits": sum(r.get("oom_splits", 0) for r in records),
    }


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain fixed-width table (what each suite prints)."""
    cells = [[_cell(row.get(column)) for column in columns] for row in rows]
    widths = [
        max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)
    ]
    lines = ["  ".join(column.rjust(width) for column, width in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * width for width in widths))
    for line in cells:
        lines.append("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)))
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, int) and abs(value) >= 10000:
        return f"{value:,}"
    return str(value)
