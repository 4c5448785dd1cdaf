"""Suite ``real``: all-MiniLM-L6-v2 on this machine's CPU, tokenq against its peers.

The same ~600 texts (the sample's 300 English and Chinese lines, mixed
lengths, repeated in shuffled order), the same model (the bundled
all-MiniLM-L6-v2, inputs cut at its 256 tokens), the same number of torch
threads everywhere (``THREADS``, set with ``torch.set_num_threads`` in this
process and ``OMP_NUM_THREADS`` in the worker's). Four ways to embed them:

* ``tokenq``: end to end through Redis with one ``--backend hf`` worker
  process, every request opened at once; the clock runs from the first
  enqueue to the last reply and includes the producer's own token counting;
* ``sentence-transformers``: ``SentenceTransformer.encode(batch_size=32)``
  offline, in this process (it sorts inputs by length itself, so it is the
  strong peer, not a strawman);
* ``naive fifo-32``: tokenq's own HF backend in this process, batches of the
  next 32 texts in arrival order (tokenize, pad, run);
* ``ideal``: the model's forward pass alone on batches prepared in advance:
  every text tokenized, sorted by length and packed into full batches under
  a token budget; only the forwards are timed. It is run at each budget in
  ``BUDGETS`` (1,024 and 16,384 tokens) and the best is *the*
  ideal, since on a CPU (unlike a GPU) a bigger batch is not faster per
  token: past a few thousand tokens it falls out of cache.

tokenq runs with the worker's default budget (16,384 tokens), with the
ideal's best budget, so that its distance from the ideal is not a choice
of setting, and with that budget and a read-ahead of 8 budgets instead of
2, since a small budget also shrinks the window the packer sorts in.

With ``run.py real --runtime onnx`` (``BENCH_RUNTIME=onnx``) the suite
also runs the best tokenq setting and the ideal at its best budget on
torch and on ONNX Runtime, paired (torch then onnx, ``PAIRED_ROUNDS``
times): rows ``tokenq torch, paired (...)``, ``tokenq onnx (...)``,
``ideal torch, paired (...)``, ``ideal onnx (...)``, the ratio
``onnx_over_torch`` (end to end, same setting, same run) and the lowest
cosine between the onnx worker's vectors and sentence-transformers'.
``run.py real --dtype bf16-mixed`` does the same for ``--dtype bf16-mixed``
against fp32 (both on torch). At ``--size tiny`` (a smoke run: its figures
are noise) the one round's torch side is the main table's tokenq and ideal
runs rather than fresh ones, which saves a worker process's start.

Why one thread by default: this machine has two cores shared with other
work; with the model on one, the other carries the producer, Redis and the
worker's event loop, which is the situation on a GPU host (the model on the
device, the CPUs free). ``BENCH_THREADS`` overrides it.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import compare
import harness
import numpy as np
from texts import real_texts

SIZES = {"tiny": 16, "small": 300, "full": 600}
THREADS = int(os.environ.get("BENCH_THREADS", "1"))
DEFAULT_BUDGET = 16384
"""The worker's default --max-batch-tokens."""
BUDGETS = {"tiny": (DEFAULT_BUDGET,), "small": (1024, DEFAULT_BUDGET),
           "full": (1024, DEFAULT_BUDGET)}
"""Budgets the ideal is tried at; the fastest is the ideal."""
WIDE_READ_AHEAD = 8
PAIRED_ROUNDS = {"tiny": 1, "small": 2, "full": 3}
"""``--runtime``: rounds of (torch, runtime) run back to back for the ratio, by size."""
REUSED_TORCH_ROUND = frozenset({"tiny"})
"""Sizes whose single paired round takes its torch side from the main table's runs."""
MAX_ROWS = 256
ST_BATCH = 32
COLUMNS = [
    "method", "texts_per_s", "tokens_per_s", "seconds", "batches", "padding_efficiency",
    "vs_tokenq", "vs_torch", "worker_peak_rss_mb",
]


@dataclass(frozen=True, slots=True)
class Timing:
    """How long one method took over all texts, in how many batches, how well padded."""

    seconds: float
    batches: int
    padding_efficiency: float
    peak_rss_mb: float | None = None
    """A tokenq worker process's resident high-water mark (None for in-process methods)."""


def padding(batches: list[list[int]]) -> float:
    """Real tokens over padded tokens (rows x longest) of batches given as lengths."""
    real = sum(sum(batch) for batch in batches)
    return round(real / sum(len(batch) * max(batch) for batch in batches if batch), 4)


def lengths_of(backend: Any, texts: list[str]) -> list[int]:
    from tokenq.worker.backends.base import TextInput

    encodings = backend.tokenize([TextInput(t) for t in texts], backend.info.max_input_tokens)
    return [encoding.length for encoding in encodings]


def sentence_transformers_run(texts: list[str], lengths: list[int]) -> tuple[Timing, np.ndarray]:
    from sentence_transformers import SentenceTransformer

    from tokenq.worker.backends.hf.load import bundled_model_dir

    model = SentenceTransformer(str(bundled_model_dir()), device="cpu")
    model.encode(texts[:ST_BATCH], batch_size=ST_BATCH)  # warm-up, off the clock
    started = time.perf_counter()
    vectors = model.encode(texts, batch_size=ST_BATCH, convert_to_numpy=True)
    seconds = time.perf_counter() - started
    # encode() sorts by text length in characters, longest first, then cuts batches.
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    batches = [[lengths[i] for i in order[s:s + ST_BATCH]] for s in range(0, len(order), ST_BATCH)]
    return Timing(seconds, len(batches), padding(batches)), vectors


def naive_fifo_run(backend: Any, texts: list[str], lengths: list[int], size: int = 32) -> Timing:
    from tokenq.worker.backends.base import TextInput

    limit = backend.info.max_input_tokens
    backend.run(backend.tokenize([TextInput(t) for t in texts[:size]], limit))  # warm-up
    started = time.perf_counter()
    for start in range(0, len(texts), size):
        chunk = [TextInput(t) for t in texts[start:start + size]]
        backend.run(backend.tokenize(chunk, limit))
    seconds = time.perf_counter() - started
    batches = [lengths[s:s + size] for s in range(0, len(lengths), size)]
    return Timing(seconds, len(batches), padding(batches))


def ideal_run(backend: Any, texts: list[str], budget: int) -> Timing:
    """Forwards only, over length-sorted batches packed full under ``budget``.

    Uses the backend's own padding and forward (``_pad``/``_forward``) so the
    ideal computes exactly what a tokenq batch computes, minus everything else.
    """
    from tokenq.worker.backends.base import TextInput

    encodings = sorted(
        backend.tokenize([TextInput(t) for t in texts], backend.info.max_input_tokens),
        key=lambda encoding: encoding.length,
    )
    batches: list[list[Any]] = [[]]
    for encoding in encodings:
        rows = len(batches[-1]) + 1
        if rows > MAX_ROWS or rows * encoding.length > budget:
            batches.append([])
        batches[-1].append(encoding)
    tensors = [backend._pad(batch) for batch in batches]
    backend._forward(*tensors[0])  # warm-up
    started = time.perf_counter()
    for padded in tensors:
        backend._forward(*padded)
    seconds = time.perf_counter() - started
    shapes = [[encoding.length for encoding in batch] for batch in batches]
    return Timing(seconds, len(batches), padding(shapes))


def tokenq_run(
    texts: list[str], budget: int, read_ahead: float, runtime: str = "torch",
) -> tuple[Timing, harness.Run]:
    """One hf worker process, warmed up on a few requests, then the whole burst."""
    flags = [
        "--backend", "hf", "--max-batch-tokens", str(budget),
        "--read-ahead-budgets", str(read_ahead),
    ]
    flags += harness.variant_flags(runtime)  # none for torch: an older tokenq has no --runtime
    env = {"OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    with harness.private_redis() as server, tempfile.TemporaryDirectory() as tmp:
        queue = harness.new_queue("real")
        worker = harness.start_tokenq(server, queue, Path(tmp), "hf", flags, env=env)
        with harness.running([worker], server.url):
            harness.burst(server.url, queue, texts[:32], workers=[worker])  # warm-up
            warm = len(worker.batches())
            run = harness.burst(server.url, queue, texts, keep_vectors=True, workers=[worker])
        timed = harness.batch_totals(worker.batches()[warm:])
    peak = None if worker.peak_rss_bytes is None else round(worker.peak_rss_bytes / 2**20, 1)
    return Timing(run.makespan_s, timed["batches"], timed["padding_efficiency"], peak), run


def min_cosine(run: harness.Run, reference: np.ndarray) -> float:
    """The lowest cosine between a run's vectors (unit length) and ``reference``'s rows."""
    vectors = np.stack([
        np.frombuffer(run.received[rid].embedding or b"", dtype="<f4") for rid in run.order
    ])
    return float(np.min(np.sum(vectors * reference, axis=1)))


def run(size: str) -> dict[str, Any]:
    import torch

    from tokenq.worker.backends.hf.backend import HFBackend, HFOptions

    torch.set_num_threads(THREADS)
    texts = real_texts(SIZES[size])
    backend = HFBackend.load(HFOptions(device="cpu"))
    lengths = lengths_of(backend, texts)
    ideal = {budget: ideal_run(backend, texts, budget) for budget in BUDGETS[size]}
    best = min(BUDGETS[size], key=lambda budget: ideal[budget].seconds)
    timings: dict[str, Timing] = {}
    timings["sentence-transformers"], st_vectors = sentence_transformers_run(texts, lengths)
    timings["naive fifo-32"] = naive_fifo_run(backend, texts, lengths)
    variants = [(DEFAULT_BUDGET, 2.0)]
    if best != DEFAULT_BUDGET:
        variants += [(best, 2.0), (best, WIDE_READ_AHEAD)]
    runs = {}
    setting_of: dict[str, tuple[int, float]] = {}
    for budget, read_ahead in variants:
        name = f"tokenq (budget {budget})"
        if read_ahead != 2.0:
            name = f"tokenq (budget {budget}, read-ahead {read_ahead:g})"
        timings[name], runs[name] = tokenq_run(texts, budget, read_ahead)
        setting_of[name] = (budget, read_ahead)
    for budget in BUDGETS[size]:
        timings[f"ideal (budget {budget})"] = ideal[budget]
    tokenq_name = min(runs, key=lambda name: timings[name].seconds)
    tokens = sum(lengths)
    rows = [
        {
            "method": method,
            "texts_per_s": round(len(texts) / timing.seconds, 1),
            "tokens_per_s": round(tokens / timing.seconds, 0),
            "seconds": round(timing.seconds, 3),
            "batches": timing.batches,
            "padding_efficiency": timing.padding_efficiency,
            "vs_tokenq": round(timings[tokenq_name].seconds / timing.seconds, 3),
            "worker_peak_rss_mb": timing.peak_rss_mb,
        }
        for method, timing in timings.items()
    ]
    speed = {row["method"]: row["texts_per_s"] for row in rows}
    ratios = {
        "tokenq_over_st": round(speed[tokenq_name] / speed["sentence-transformers"], 3),
        "tokenq_over_ideal": round(speed[tokenq_name] / speed[f"ideal (budget {best})"], 3),
        "tokenq_over_naive": round(speed[tokenq_name] / speed["naive fifo-32"], 3),
        "tokenq_default_over_ideal_same_budget": round(
            speed[f"tokenq (budget {DEFAULT_BUDGET})"] / speed[f"ideal (budget {DEFAULT_BUDGET})"],
            3,
        ),
    }
    agreement = min_cosine(runs[tokenq_name], st_vectors)
    notes = [
        f"{tokenq_name} / sentence-transformers = {ratios['tokenq_over_st']}",
        f"{tokenq_name} / ideal (budget {best}) = {ratios['tokenq_over_ideal']}",
        f"{tokenq_name} / naive fifo-32 = {ratios['tokenq_over_naive']}",
        f"lowest cosine between tokenq's and sentence-transformers' vectors: {agreement:.6f}",
    ]
    runtime = harness.bench_runtime()
    extra_config: dict[str, Any] = {}
    if runtime != "torch":
        torch_run = None
        if size in REUSED_TORCH_ROUND:
            torch_run = (timings[tokenq_name], ideal[best])
        extra_config, runtime_notes = runtime_rows(
            rows, runtime, texts, tokens, (tokenq_name, *setting_of[tokenq_name]), best,
            backend, st_vectors, PAIRED_ROUNDS[size], torch_run,
        )
        ratios[f"{runtime}_over_torch"] = extra_config[f"{runtime}_over_torch"]
        notes += runtime_notes
    return {
        "columns": COLUMNS,
        "rows": rows,
        "ratios": ratios,
        "config": {
            "texts": len(texts),
            "tokens": tokens,
            "torch_threads": THREADS,
            "ideal_budget": best,
            "tokenq": tokenq_name,
            "model": backend.info.model,
            "max_input_tokens": backend.info.max_input_tokens,
            "min_cosine_tokenq_vs_st": round(agreement, 6),
            "load": "tokenq: all requests opened at once, one worker; the others offline",
            **extra_config,
        },
        "notes": notes,
    }


def runtime_rows(
    rows: list[dict[str, Any]], runtime: str, texts: list[str], tokens: int,
    setting: tuple[str, int, float], best: int, torch_backend: Any, st_vectors: np.ndarray,
    rounds: int, torch_run: tuple[Timing, Timing] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The best tokenq setting and the ideal at its best budget, torch and ``runtime`` paired.

    Each of ``rounds`` rounds runs torch then ``runtime``, end to end
    and ideal, and the ratio is of the rounds' total times: on a shared
    machine, two measurements minutes apart differ by more than the runtimes
    do, so the torch figures of the main table are not reused, except as
    ``torch_run``: the first pass's torch (tokenq, ideal) timings, already
    measured (``--size tiny``, whose figures are noise anyway). Rows are
    appended to ``rows`` in place. ``setting``: the best torch tokenq row's
    (name, budget, read-ahead).
    """
    from tokenq.worker.backends.hf.backend import HFBackend, HFOptions

    tokenq_name, budget, read_ahead = setting
    backend = HFBackend.load(HFOptions(device="cpu", **harness.variant_options(runtime)))
    spent: dict[str, list[Timing]] = {"tokenq torch": [], "tokenq": [], "ideal torch": [],
                                      "ideal": []}
    runtime_run = None
    for round_ in range(rounds):
        reused = torch_run if round_ == 0 else None
        torch_timing = reused[0] if reused else tokenq_run(texts, budget, read_ahead)[0]
        spent["tokenq torch"].append(torch_timing)
        timing, runtime_run = tokenq_run(texts, budget, read_ahead, runtime)
        spent["tokenq"].append(timing)
        spent["ideal torch"].append(reused[1] if reused else ideal_run(torch_backend, texts, best))
        spent["ideal"].append(ideal_run(backend, texts, best))
    mean = {key: Timing(sum(t.seconds for t in got) / len(got), got[-1].batches,
                        got[-1].padding_efficiency, _largest_peak(got))
            for key, got in spent.items()}
    setting_name = tokenq_name.removeprefix("tokenq ")
    found = {
        f"tokenq torch, paired {setting_name}": (mean["tokenq torch"], mean["tokenq torch"]),
        f"tokenq {runtime} {setting_name}": (mean["tokenq"], mean["tokenq torch"]),
        f"ideal torch, paired (budget {best})": (mean["ideal torch"], mean["ideal torch"]),
        f"ideal {runtime} (budget {best})": (mean["ideal"], mean["ideal torch"]),
    }
    for method, (mine, theirs) in found.items():
        rows.append({
            "method": method,
            "texts_per_s": round(len(texts) / mine.seconds, 1),
            "tokens_per_s": round(tokens / mine.seconds, 0),
            "seconds": round(mine.seconds, 3),
            "batches": mine.batches,
            "padding_efficiency": mine.padding_efficiency,
            "vs_torch": round(theirs.seconds / mine.seconds, 3),
            "worker_peak_rss_mb": mine.peak_rss_mb,
        })
    over = round(mean["tokenq torch"].seconds / mean["tokenq"].seconds, 3)
    ideal_over = round(mean["ideal torch"].seconds / mean["ideal"].seconds, 3)
    each = [round(t.seconds / o.seconds, 3)
            for t, o in zip(spent["tokenq torch"], spent["tokenq"], strict=True)]
    assert runtime_run is not None
    agreement = min_cosine(runtime_run, st_vectors)
    config = {
        "runtime": runtime,
        "paired_rounds": rounds,
        f"{runtime}_over_torch": over,
        f"{runtime}_over_torch_each_round": each,
        f"{runtime}_ideal_over_torch_ideal": ideal_over,
        f"min_cosine_tokenq_{runtime}_vs_st": round(agreement, 6),
    }
    peak_ratio = compare.ratio(mean["tokenq torch"].peak_rss_mb, mean["tokenq"].peak_rss_mb)
    config[f"{runtime}_worker_peak_rss_over_torch"] = (
        None if peak_ratio is None else round(peak_ratio, 3)
    )
    notes = [
        f"tokenq {runtime} / tokenq torch {setting_name}, {rounds} paired rounds = "
        f"{over} (each round: {each})",
        f"ideal {runtime} / ideal torch (budget {best}), paired = {ideal_over}",
        f"worker peak RSS, {runtime} / torch = "
        f"{config[f'{runtime}_worker_peak_rss_over_torch']}",
        f"lowest cosine between tokenq {runtime}'s and sentence-transformers' vectors: "
        f"{agreement:.6f}",
    ]
    return config, notes


def _largest_peak(timings: list[Timing]) -> float | None:
    """The largest resident high-water mark over paired rounds (None if none was read)."""
    peaks = [t.peak_rss_mb for t in timings if t.peak_rss_mb is not None]
    return max(peaks, default=None)

