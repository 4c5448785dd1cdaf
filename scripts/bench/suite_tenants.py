"""Suite ``tenants``: two tenants on one queue, at one priority, on the simulated GPU.

* ``b alone`` / ``b beside a's flood``: tenant B runs a closed loop of ``CALLERS`` short queries
  (the seed mix's, 12-28 tokens), first alone, then while tenant A's 2,000 long passages
  (1,350-1,650 tokens) wait in the queue; ``b_p50_ratio`` is B's p50 beside the flood over its
  p50 alone (fair share reads B's query at once, so it waits for the batch on the device, not
  for A's backlog, and that batch is a short one while B is active); ``a_per_s`` is A's
  passages answered a second meanwhile, what those short batches cost A; ``capped``, the share
  of the batches packed under less than the budget (that cap).
* ``equal`` / ``3to1``: both tenants saturate the worker (A long passages, B short queries);
  each one's share of the tokens processed over the window (entries answered, gone from its
  stream, times their sim length), with equal weights and with A weighted 3 to B's 1.
* ``cap``: a client of ``max_queue_length`` CAP: A writes past it and is refused (QueueFull
  naming A); ``refused_other_tenant`` counts B's writes refused meanwhile (0: B flows).

The saturation phases run the sim at ``token_us`` 20 (a slower device), so 20-token queries
keep it busy without the producer becoming the bottleneck.

``run.py tenants --runtime torch`` (or ``onnx``) runs every phase on the real model instead: one
``--backend hf`` worker (the bundled all-MiniLM-L6-v2, its inputs cut at 256 tokens, on
``BENCH_THREADS`` threads), the same figures; shares count each entry's tokens as the model's
tokenizer does. The model's speed is measured first (:func:`real_plan`): the budget, the windows
and A's flood follow from it, so a window holds many of A's batches on any CPU.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import harness
from suite_mixed_latency import HF_THREADS, hf_flags, pools
from suite_seed import SIM

from tokenq.producer import AsyncClient, Client, QueueFull
from tokenq.shared import keys
from tokenq.worker.backends.sim import count_tokens

CALLERS = 4
SECONDS = {"tiny": 2.0, "small": 6.0, "full": 20.0}
FLOOD = 2000
BUDGET = 8192
SLOW_SIM = {**SIM, "token_us": 20.0}
CAP = 100
TIMEOUT_S = 120.0
"""A query's reply wait: long, since on the real model B's first waits for a full batch of A's."""
REAL_BUDGET = 1024
"""On the real model (a CPU): suite ``real``'s best budget there, the most it is given."""
REAL_BATCH_S = 0.25
"""On the real model: the budget is what it runs in about this long (one passage at least)."""
REAL_BATCHES = 40
"""On the real model: a window is at least this many budgets' batches long."""
COLUMNS = ["setting", "b_p50_ms", "a_per_s", "capped", "a_share", "b_share", "b_requests",
           "refused"]


class Plan(NamedTuple):
    """How long each window is, A's flood, the budget, and more tokens a second than the device
    runs (both tenants stay backlogged through a share window)."""

    seconds: float
    flood: int
    budget: int
    tokens_per_s: float


def runtime() -> str | None:
    """The hf runtime ``run.py tenants --runtime`` names (None: the sim)."""
    return os.environ.get(harness.RUNTIME_ENV)


def start_worker(server: Any, queue: str, workdir: Path, name: str,
                 sim: dict[str, Any], budget: int) -> Any:
    """A worker on the sim as ``sim`` sets it, or on the real model (:func:`runtime`)."""
    flags = ["--heartbeat-s", "0.5", "--max-batch-tokens", str(budget)]
    real = runtime()
    if real is None:
        return harness.start_tokenq(server, queue, workdir, name, [
            "--backend", "sim_probe:factory", *harness.sim_flags(sim), *flags])
    threads = {"OMP_NUM_THREADS": str(HF_THREADS), "MKL_NUM_THREADS": str(HF_THREADS)}
    return harness.start_tokenq(server, queue, workdir, name, [*hf_flags(real), *flags],
                                env=threads)


def real_plan(size: str, passage: str, query: str) -> tuple[Plan, float, float]:
    """The real model's plan from its speed on a batch of four passages (timed after a warm-up,
    on the worker's threads), and the tokens of the passage's and the query's :func:`distinct`
    copies as it counts them (a mean: the copies' numbers are tokens too)."""
    import torch
    from suite_real import lengths_of

    from tokenq.worker.backends.base import TextInput
    from tokenq.worker.backends.hf.backend import HFBackend, HFOptions

    backend = HFBackend.load(
        HFOptions(device="cpu", **harness.variant_options(runtime() or "torch")))
    passage_tokens, query_tokens = (statistics.mean(lengths_of(backend, distinct(text, 2000)[::50]))
                                    for text in (passage, query))
    batch = backend.tokenize([TextInput(passage)] * 4, backend.info.max_input_tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(HF_THREADS)
    try:
        backend.run(batch)
        started = time.perf_counter()
        backend.run(batch)
        per_s = 4 * passage_tokens / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
        backend.close()
    budget = max(int(passage_tokens), min(REAL_BUDGET, int(per_s * REAL_BATCH_S)))
    seconds = max(SECONDS[size], REAL_BATCHES * budget / per_s)
    flood = int(2 * (seconds + 3) * per_s / passage_tokens)
    return Plan(round(seconds, 1), flood, budget, 2 * per_s), passage_tokens, query_tokens


def submit(url: str, queue: str, tenant: str, texts: list[str]) -> None:
    with Client(redis_url=url, queue=queue, max_queue_length=0) as client:
        for start in range(0, len(texts), 500):
            client.submit_many(texts[start:start + 500], tenant=tenant)


def distinct(text: str, count: int, salt: int = 0) -> list[str]:
    """``count`` texts of ``text``'s sim token count, each its own: identical requests in
    flight run as one row, which would hide the load."""
    head, _, rest = text.partition(" ")
    assert count_tokens(f"{salt}x{count} {rest}") == count_tokens(text), head
    return [f"{salt}x{i} {rest}" for i in range(count)]


async def b_loop(url: str, queue: str, queries: list[str], seconds: float) -> list[float]:
    """Tenant B's closed loop: each caller's latencies in ms (the first call, which waits for the
    workers to find B's stream, left out)."""
    latencies: list[float] = []
    async with AsyncClient(redis_url=url, queue=queue, max_queue_length=0) as client:
        await client.infer(queries[0], tenant="b", timeout_s=TIMEOUT_S)
        stop = time.perf_counter() + seconds

        async def caller(index: int) -> None:
            n = index
            while time.perf_counter() < stop:
                sent = time.perf_counter()
                await client.infer(queries[n % len(queries)], tenant="b", timeout_s=TIMEOUT_S)
                latencies.append((time.perf_counter() - sent) * 1000)
                n += CALLERS

        await asyncio.gather(*(caller(i) for i in range(CALLERS)))
    return latencies


def latency_row(server: Any, workdir: Path, setting: str, plan: Plan, flood: list[str],
                queries: list[str]) -> dict[str, Any]:
    """B's closed loop, beside A's ``flood`` if any; ``capped``: the share of the batches
    packed under less than the budget (the cap while B is active)."""
    queue = harness.new_queue(setting.split()[-1])
    worker = start_worker(server, queue, workdir, setting.replace(" ", "-"), SIM, plan.budget)
    stream = keys.tenant_requests(keys.QueueRef(queue), "a")
    client = harness.connect(server.url)
    with harness.running([worker], server.url):
        if flood:
            submit(server.url, queue, "a", flood)
        before, started = client.xlen(stream), time.perf_counter()
        latencies = sorted(asyncio.run(b_loop(server.url, queue, queries, plan.seconds)))
        a_per_s = (before - client.xlen(stream)) / (time.perf_counter() - started)
    client.close()
    batches = worker.batches()
    row = {"setting": setting, "b_p50_ms": round(harness.percentile(latencies, 50), 2),
           "b_requests": len(latencies), "capped": round(sum(
               batch["max_batch_tokens"] < plan.budget for batch in batches) / len(batches), 3)}
    return {**row, "a_per_s": round(a_per_s, 1)} if flood else row


def share_row(server: Any, workdir: Path, setting: str, plan: Plan, weights: dict[str, str],
              a: tuple[str, float], b: tuple[str, float]) -> dict[str, Any]:
    """Both tenants backlogged; each one's share of the tokens processed over the window."""
    queue = harness.new_queue(setting)
    q = keys.QueueRef(queue)
    window = plan.seconds
    capacity = (window + 3) * plan.tokens_per_s  # both backlogged even were one served alone
    submit(server.url, queue, "a", distinct(a[0], int(capacity / a[1])))
    submit(server.url, queue, "b", distinct(b[0], int(capacity / b[1])))
    client = harness.connect(server.url)
    if weights:
        client.hset(keys.weights(q), mapping=weights)
    streams = {"a": keys.tenant_requests(q, "a"), "b": keys.tenant_requests(q, "b")}
    worker = start_worker(server, queue, workdir, setting, SLOW_SIM, plan.budget)
    with harness.running([worker], server.url):
        time.sleep(1.0)  # the worker finds both streams and fills its read-ahead
        before = {t: client.xlen(stream) for t, stream in streams.items()}
        time.sleep(window)
        after = {t: client.xlen(stream) for t, stream in streams.items()}
    client.close()
    done = {"a": (before["a"] - after["a"]) * a[1], "b": (before["b"] - after["b"]) * b[1]}
    total = sum(done.values()) or 1
    return {"setting": setting, "a_share": round(done["a"] / total, 3),
            "b_share": round(done["b"] / total, 3), "backlogged": all(after.values())}


def cap_row(server: Any) -> dict[str, Any]:
    """A over its cap is refused, naming A; B's writes meanwhile."""
    queue = harness.new_queue("cap")
    refused = {"a": 0, "b": 0}
    named = False
    with Client(redis_url=server.url, queue=queue, max_queue_length=CAP,
                refuse_early=False) as client:
        for _ in range(2 * CAP // 10):
            for tenant in ("a", "a", "b"):  # A writes twice as fast and passes its cap
                try:
                    client.submit_many(["x"] * 5, tenant=tenant)
                except QueueFull as exc:
                    refused[tenant] += 1
                    named = named or "tenant 'a'" in str(exc)
    return {"setting": "cap", "refused": refused["a"] + refused["b"],
            "a_refused": refused["a"], "refused_other_tenant": refused["b"],
            "refusal_names_tenant": named}


def run(size: str) -> dict[str, Any]:
    texts = pools()
    queries = [text for text, _ in texts["query"]]
    passage = texts["passage"][0]
    query = texts["query"][0]
    plan = Plan(SECONDS[size], FLOOD, BUDGET, 1e6 / SLOW_SIM["token_us"])
    if runtime():
        plan, passage_tokens, query_tokens = real_plan(size, passage[0], query[0])
        passage, query = (passage[0], passage_tokens), (query[0], query_tokens)
    flood = [text for n, (passage_text, _) in enumerate(texts["passage"])
             for text in distinct(passage_text, plan.flood // len(texts["passage"]) + 1, n)]
    with harness.private_redis() as server, tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        rows = [latency_row(server, workdir, "b alone", plan, [], queries),
                latency_row(server, workdir, "b beside a's flood", plan, flood[:plan.flood],
                            queries),
                share_row(server, workdir, "equal", plan, {}, passage, query),
                share_row(server, workdir, "3to1", plan, {"a": "3", "b": "1"}, passage, query),
                cap_row(server)]
    by = {row["setting"]: row for row in rows}
    alone, beside = by["b alone"]["b_p50_ms"], by["b beside a's flood"]["b_p50_ms"]
    summary = {
        "setting": "summary",
        "b_p50_ratio": round(beside / alone, 2) if alone else None,
        "share_equal_a": by["equal"]["a_share"], "share_equal_b": by["equal"]["b_share"],
        "share_3to1_a": by["3to1"]["a_share"],
        "refused_other_tenant": by["cap"]["refused_other_tenant"],
    }
    rows.append(summary)
    notes = [f"B's p50 beside A's flood / alone: x{summary['b_p50_ratio']} "
             f"({beside} vs {alone} ms; want <= 1.5)",
             f"equal weights: A {summary['share_equal_a']}, B {summary['share_equal_b']} of the "
             "tokens processed (want 0.45-0.55)",
             f"weights 3:1: A {summary['share_3to1_a']} (want 0.675-0.825)",
             f"over its cap A was refused {by['cap']['a_refused']} times, B "
             f"{summary['refused_other_tenant']} (want 0)"]
    return {
        "columns": COLUMNS,
        "rows": rows,
        "config": {"backend": f"hf-{runtime()}" if runtime() else "sim",
                   "callers": CALLERS, "seconds": plan.seconds, "flood": plan.flood,
                   "max_batch_tokens": plan.budget, "sim": SIM,
                   "saturation_sim": SLOW_SIM,
                   "passage_tokens": passage[1], "query_tokens": query[1], "cap": CAP},
        "notes": notes,
    }
