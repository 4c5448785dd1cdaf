"""Suite ``mixed-latency``: what short queries wait behind long passages, with and without priority.

The seed scenario (half ~20-token queries, half ~1,500-token passages, the
seed suite's simulated GPU) as a service sees it rather than as a backlog: a
CLOSED loop of 32 callers, each an asyncio task sharing one
:class:`~tokenq.producer.AsyncClient`, each sending one request, waiting for
its reply and sending the next, for a fixed time. Each caller picks its next
request's class at random (seeded, 50/50), so about 16 passages and 16
queries are in flight at any moment. A passage costs the device ~75 times a
query, so in arrival order a query mostly waits for the passage batches
ahead of it; that wait, not its own few microseconds of device time, is its
latency.

Two settings, each a fresh tokenq worker process on the same device model
as the seed suite (2 ms per batch + 1 us per padded token, 16,384 tokens of
4,096 bytes), ``--max-batch-tokens 8192`` and the default linger:

* ``no-priority``: every request priority 0 (arrival order);
* ``priority``: queries ``priority=1``, passages 0. A query then stands in
  line as if it had come ``aging_ms`` earlier, so it goes ahead of the
  passages that came less than that before it, while a passage at the head
  of the line passed over for ``aging_ms`` goes next (the aging bound), so
  passages slow down but do not starve.

Each setting gives a row per class (query, passage) and one for all
requests: replies per second and useful (sim) tokens per second over the
run's span, and latency from the ``infer`` call to its return
(``time.perf_counter`` in this process, so it includes the producer's own
work), the first ``WARMUP`` of each class's requests left out of the
percentiles. The closed loop fixes the concurrency rather than the rate: a
setting that answers queries sooner also gets more queries to answer. The
``all`` row's ``query_over_passage_p50`` is the queries' p50 over the passages'
in the same run, the figure that drifts least with the machine's load.

With ``run.py mixed-latency --runtime onnx`` (``BENCH_RUNTIME=onnx``) two
more settings run the same closed loop on the real model instead of the
sim: ``hf-torch`` and ``hf-onnx``, one ``--backend hf`` worker (the bundled
all-MiniLM-L6-v2 on the CPU, ``HF_THREADS`` threads, inputs cut at 256
tokens) on ``--runtime torch`` and ``--runtime onnx``, every request
priority 0; the notes give onnx/torch requests per second, the same load in
the same run. ``--dtype bf16-mixed`` compares ``hf-bf16-mixed`` with
``hf-torch`` (fp32) the same way.

``BENCH_SETTINGS`` (a comma-separated list of setting names) runs only those
settings, e.g. ``BENCH_RUNTIME=onnx BENCH_SETTINGS=hf-torch`` the closed loop
on the real model alone; the notes then compare only what ran.

The suite also runs on an older tokenq whose producer has no ``priority``
keyword (``run.py mixed-latency --baseline REV`` runs this file on REV's
package): then the ``priority`` setting is sent without it, the same load
as ``no-priority``, and its rows and the config say ``priority_supported:
false``.
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
from harness import RedisServer
from suite_seed import CAPACITY_TOKENS, SIM
from texts import seed_mix

from tokenq.producer import AsyncClient

CALLERS = 32
SECONDS = {"tiny": 1.0, "small": 8.0, "full": 25.0}
POOL = 256
"""Distinct texts to draw from (half of each class); callers pick among them at random."""
BUDGET = 8192
WARMUP = 0.05
"""Fraction of each class's first requests (by send time) left out of its percentiles."""
TIMEOUT_S = 30.0
SEED = 5
PASSAGE_MIN = 100
"""Sim length above which a text of the seed mix is a passage (they are 1,350-1,650)."""
SETTINGS = {"no-priority": {"query": 0, "passage": 0}, "priority": {"query": 1, "passage": 0}}
CLASSES = ("query", "passage")
COLUMNS = [
    "setting", "requests", "requests_per_s", "useful_tokens_per_s", "p50_ms", "p99_ms",
    "max_ms", "failed",
]


def priority_supported() -> bool:
    """Whether the tokenq imported here takes ``priority=`` on ``infer``."""
    try:
        from tokenq.producer import call_options as options
    except ImportError:
        try:  # a --baseline checkout from before the module's rename
            from tokenq.producer import options  # type: ignore[no-redef]
        except ImportError:
            return False
    declared = getattr(getattr(options, "RequestOptions", None), "__optional_keys__", ())
    return "priority" in declared


def worker_default(name: str) -> float | None:
    """A worker setting's default in the tokenq imported here (None: it has no such setting)."""
    try:
        try:
            from tokenq.worker.settings import WorkerSettings
        except ImportError:  # a --baseline checkout from before the settings moved
            from tokenq.shared.settings import WorkerSettings  # type: ignore[no-redef]

        return float(WorkerSettings.model_fields[name].default)
    except (ImportError, AttributeError, KeyError, TypeError, ValueError):
        return None


@dataclass(slots=True)
class Call:
    """One request as its caller saw it."""

    cls: str
    tokens: int
    sent: float
    done: float
    ok: bool
    error: str | None = None


def pools(seed: int = 21) -> dict[str, list[tuple[str, int]]]:
    """The seed mix's texts by class, each with its exact sim length."""
    mix = seed_mix(POOL, seed=seed)
    out: dict[str, list[tuple[str, int]]] = {cls: [] for cls in CLASSES}
    for text, length in zip(mix.texts, mix.lengths, strict=True):
        out["passage" if length > PASSAGE_MIN else "query"].append((text, length))
    return out


async def closed_loop(
    redis_url: str, queue: str, texts: dict[str, list[tuple[str, int]]],
    priorities: dict[str, int] | None, seconds: float, seed: int,
) -> tuple[list[Call], float, float]:
    """``CALLERS`` tasks on one AsyncClient for ``seconds``; every call, the clock's start and end.

    ``priorities`` None: send no ``priority`` keyword at all (an older tokenq).
    """
    calls: list[Call] = []
    async with AsyncClient(redis_url=redis_url, queue=queue, max_queue_length=0) as client:
        await client.config()  # load the queue's config before the clock starts
        start = time.perf_counter()
        stop = start + seconds

        async def caller(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.perf_counter() < stop:
                cls = rng.choice(CLASSES)
                text, tokens = rng.choice(texts[cls])
                options = {} if priorities is None else {"priority": priorities[cls]}
                sent = time.perf_counter()
                try:
                    await client.infer(text, timeout_s=TIMEOUT_S, **options)
                except Exception as exc:  # a failed request is a figure, not a crash
                    calls.append(Call(cls, tokens, sent, time.perf_counter(), False,
                                      type(exc).__name__))
                else:
                    calls.append(Call(cls, tokens, sent, time.perf_counter(), True))

        await asyncio.gather(*(caller(i) for i in range(CALLERS)))
    end = max((call.done for call in calls), default=start)
    return calls, start, end


def class_row(name: str, calls: list[Call], span: float) -> dict[str, Any]:
    """Figures of some calls (one class, or all), warm-up left out of the percentiles."""
    kept: list[Call] = []
    for cls in CLASSES:
        mine = sorted((c for c in calls if c.cls == cls), key=lambda c: c.sent)
        kept += mine[int(len(mine) * WARMUP):]
    latencies = sorted((c.done - c.sent) * 1000.0 for c in kept if c.ok)
    ok = [c for c in calls if c.ok]
    return {
        "setting": name,
        "requests": len(calls),
        "requests_per_s": round(len(ok) / span, 1) if span > 0 else None,
        "useful_tokens_per_s": round(sum(c.tokens for c in ok) / span, 0) if span > 0 else None,
        "p50_ms": _round(harness.percentile(latencies, 50)),
        "p99_ms": _round(harness.percentile(latencies, 99)),
        "max_ms": _round(latencies[-1] if latencies else None),
        "failed": len(calls) - len(ok),
        "errors": sorted({c.error for c in calls if c.error}),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


SETTINGS_ENV = "BENCH_SETTINGS"
"""Names of the settings to run, comma-separated (unset: every one)."""
HF_THREADS = int(os.environ.get("BENCH_THREADS", "1"))
"""Threads of the hf worker (``OMP_NUM_THREADS``), as suite ``real`` runs it."""
SIM_FLAGS = ["--backend", "sim_probe:factory", *harness.sim_flags(SIM)]


def hf_flags(runtime: str) -> list[str]:
    """A ``--backend hf`` worker on ``runtime`` (no flag for torch: an older tokenq has none)."""
    return ["--backend", "hf", *harness.variant_flags(runtime)]


def run_setting(
    server: RedisServer, workdir: Path, setting: str, size: str,
    texts: dict[str, list[tuple[str, int]]], supported: bool,
    backend_flags: list[str] = SIM_FLAGS,
) -> list[dict[str, Any]]:
    """A fresh worker, one closed-loop run; a row per class and one for all."""
    queue = harness.new_queue(setting)
    flags = [*backend_flags, "--max-batch-tokens", str(BUDGET)]
    env = None
    if backend_flags is not SIM_FLAGS:
        env = {"OMP_NUM_THREADS": str(HF_THREADS), "MKL_NUM_THREADS": str(HF_THREADS)}
    worker = harness.start_tokenq(server, queue, workdir, setting, flags, env=env)
    priorities = SETTINGS.get(setting, SETTINGS["no-priority"]) if supported else None
    with harness.running([worker], server.url):
        # The same seed in every setting: caller k's n-th request is of the same class.
        calls, start, end = asyncio.run(
            closed_loop(server.url, queue, texts, priorities, SECONDS[size], seed=SEED)
        )
    span = end - start
    totals = harness.batch_totals(worker.batches())
    device = worker.sim_stats() or {}
    rows = []
    for cls in (*CLASSES, "all"):
        mine = calls if cls == "all" else [c for c in calls if c.cls == cls]
        row = class_row(f"{setting} {cls}", mine, span)
        row.update({"mode": setting, "class": cls}, priority_supported=supported)
        rows.append(row)
    query, passage = rows[0]["p50_ms"], rows[1]["p50_ms"]
    rows[-1].update(
        query_over_passage_p50=round(query / passage, 3) if query and passage else None,
        seconds=round(span, 3),
        batches=totals["batches"],
        mean_rows=totals["mean_rows"],
        mean_batch_ms=totals["mean_batch_ms"],
        padding_efficiency=totals["padding_efficiency"],
        oom_events=device.get("oom_events"),
        device_busy=round(device.get("busy_s", 0.0) / span, 3) if span > 0 else None,
    )
    return rows


def chosen(names: list[str]) -> list[str]:
    """``names`` cut to those ``BENCH_SETTINGS`` lists (all of them when it is unset)."""
    wanted = os.environ.get(SETTINGS_ENV, "").strip()
    if not wanted:
        return names
    picked = {name.strip() for name in wanted.split(",") if name.strip()}
    if unknown := picked - set(names):
        raise SystemExit(f"{SETTINGS_ENV}: no setting {', '.join(sorted(unknown))} in this run "
                         f"(it has {', '.join(names)})")
    return [name for name in names if name in picked]


def run(size: str) -> dict[str, Any]:
    texts = pools()
    supported = priority_supported()
    rows: list[dict[str, Any]] = []
    runtime = harness.bench_runtime()
    hf_settings = {} if runtime == "torch" else {"hf-torch": "torch", f"hf-{runtime}": runtime}
    names = chosen([*SETTINGS, *hf_settings])
    with harness.private_redis() as server, tempfile.TemporaryDirectory() as tmp:
        for setting in names:
            backend = SIM_FLAGS if setting in SETTINGS else hf_flags(hf_settings[setting])
            rows += run_setting(server, Path(tmp), setting, size, texts, supported, backend)
    by = {row["setting"]: row for row in rows}
    notes = []
    if f"hf-{runtime} all" in by and "hf-torch all" in by:
        mine, torch_all = by[f"hf-{runtime} all"], by["hf-torch all"]
        if mine["requests_per_s"] and torch_all["requests_per_s"]:
            notes.append(
                f"hf {runtime} / hf torch requests/s, same run: "
                f"x{mine['requests_per_s'] / torch_all['requests_per_s']:.2f} "
                f"({mine['requests_per_s']} vs {torch_all['requests_per_s']})"
            )
    for setting in names:
        if ratio := by[f"{setting} all"]["query_over_passage_p50"]:
            notes.append(f"{setting}: query p50 / passage p50 x{ratio:.2f} "
                         f"({by[f'{setting} query']['p50_ms']:.1f} vs "
                         f"{by[f'{setting} passage']['p50_ms']:.1f} ms)")
    if "no-priority" in names and "priority" in names:
        for cls in CLASSES:
            base, prio = by[f"no-priority {cls}"]["p50_ms"], by[f"priority {cls}"]["p50_ms"]
            if base and prio:
                notes.append(f"{cls} p50, priority / no-priority: x{prio / base:.2f} "
                             f"({prio:.1f} vs {base:.1f} ms)")
        base_all = by["no-priority all"]["requests_per_s"]
        prio_all = by["priority all"]["requests_per_s"]
        if base_all and prio_all:
            notes.append(f"all requests/s, priority / no-priority: x{prio_all / base_all:.2f}")
    if not supported:
        notes.append("this tokenq has no priority keyword: the priority setting ran without it")
    return {
        "columns": COLUMNS,
        "rows": rows,
        "config": {
            "callers": CALLERS,
            "seconds_per_setting": SECONDS[size],
            "mix": "50/50 random per request: queries 12-28 tokens, passages 1,350-1,650",
            "pool": {cls: len(group) for cls, group in texts.items()},
            "settings": names,
            "priorities": SETTINGS,
            "priority_supported": supported,
            "runtime": runtime,
            "hf_threads": HF_THREADS if hf_settings else None,
            "aging_ms": worker_default("aging_ms"),
            "sim": SIM,
            "capacity_tokens": CAPACITY_TOKENS,
            "max_batch_tokens": BUDGET,
            "linger_ms": worker_default("linger_ms"),
            "warmup_fraction": WARMUP,
            "timeout_s": TIMEOUT_S,
            "load": "closed loop: each caller sends its next request when its last returns",
            "latency": "AsyncClient.infer call to its return (time.perf_counter)",
        },
        "notes": notes,
    }
