"""One short run on a CUDA machine: does tokenq's HF backend hold up on a real GPU?

The test suite runs on CPU, so four things are only ever checked here:

a. fp16 embeddings agree with fp32 ones (cosine >= 0.999) on all-MiniLM-L6-v2
   for ~64 mixed English/Chinese texts: half precision is the CUDA default,
   and a silent precision bug would pass every CPU test;
b. a real CUDA out-of-memory error is recovered: most free memory is taken
   by a ballast tensor, then a batch of 4096 x 256-token rows (doubling until
   torch runs out of memory) goes through ``run_isolated``, which must split
   it and answer every row, each equal to the row run in a small batch;
c. ``calibrate_budget`` (what ``--max-batch-tokens auto`` uses) on this
   device, and the reason it gives;
d. throughput in tokens/s for the sample texts packed under that budget.

It prints one line per check and a summary, and exits 1 if a check failed,
0 when all passed, and 0 with "no CUDA device; skipped" when there is no
GPU (so CI can run it everywhere). Run it through ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE = REPO_ROOT / "scripts" / "data" / "sample.jsonl"
GIB = 1 << 30


@dataclass
class Check:
    """One line of the summary."""

    name: str
    ok: bool
    detail: str


def sample_texts(count: int) -> list[str]:
    """``count`` sample texts spread over all lengths and both languages (deterministic)."""
    rows = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines() if line]
    rows.sort(key=lambda row: len(row["text"]))
    step = max(1, len(rows) // count)
    return [row["text"] for row in rows[::step][:count]]


def all_texts() -> list[str]:
    return [
        json.loads(line)["text"]
        for line in SAMPLE.read_text(encoding="utf-8").splitlines()
        if line
    ]


def cosines(a: Any, b: Any) -> Any:
    """Row-wise cosine similarity of two (rows x dim) arrays."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def load(model: str | None, dtype: str) -> Any:
    from tokenq.worker.backends.hf.backend import HFBackend, HFOptions

    return HFBackend.load(HFOptions(model=model, device="cuda", dtype=dtype))


def embed(backend: Any, texts: Sequence[str]) -> Any:
    """Embeddings of ``texts`` (truncated to the model's limit) in one batch."""
    import numpy as np

    from tokenq.worker.backends.base import TextInput

    encodings = backend.tokenize([TextInput(t) for t in texts], backend.info.max_input_tokens)
    return np.stack(backend.run(encodings))


# ------------------------------------------------------------------------ checks


def check_fp16(model: str | None, texts: Sequence[str], fp16: Any) -> Check:
    """(a) fp16 against fp32 on the same texts."""
    fp32 = load(model, "fp32")
    try:
        reference = embed(fp32, texts)
    finally:
        fp32.close()
    cos = cosines(embed(fp16, texts), reference)
    worst = float(cos.min())
    return Check(
        "fp16 vs fp32",
        worst >= 0.999,
        f"{len(texts)} texts, min cosine {worst:.6f}, mean {float(cos.mean()):.6f} (need >= 0.999)",
    )


class Ballast:
    """Most of the GPU's free memory, held in 1 GiB tensors, so a batch runs out of it.

    Taking the memory away is what makes a *real* CUDA OOM reachable with a
    batch of a few thousand rows, on any size of GPU, in seconds.
    """

    def __init__(self, device: Any, headroom_bytes: int) -> None:
        import torch

        self.blocks: list[Any] = []
        torch.cuda.empty_cache()
        _free, total = torch.cuda.mem_get_info(device)
        while len(self.blocks) < total // GIB:  # a bound, should the free count not move
            free, _total = torch.cuda.mem_get_info(device)
            if free - GIB < headroom_bytes:
                break
            try:
                self.blocks.append(torch.empty(GIB, dtype=torch.uint8, device=device))
            except torch.cuda.OutOfMemoryError:
                break
        self.bytes = len(self.blocks) * GIB

    def release(self) -> None:
        import torch

        self.blocks.clear()
        torch.cuda.empty_cache()


def check_oom(
    backend: Any, texts: Sequence[str], headroom_gib: float, start_rows: int, max_rows: int
) -> Check:
    """(b) a batch that really runs out of CUDA memory, recovered by run_isolated."""
    import numpy as np
    import torch

    from tokenq.worker.backends.base import TextInput
    from tokenq.worker.pipeline.execute import FailedRun, Failure, is_out_of_memory, run_isolated

    limit = backend.info.max_input_tokens
    encodings = backend.tokenize([TextInput(t) for t in texts], limit)
    full = [e for e in encodings if e.length == limit]
    if not full:
        return Check("forced OOM", False, f"no sample text reaches {limit} tokens")
    # Each distinct row alone (a small batch), to compare the split results with.
    alone = np.stack(backend.run(full))
    ballast = Ballast(backend.device, int(headroom_gib * GIB))
    try:
        rows, batch = start_rows, None
        while rows <= max_rows:
            batch = [full[i % len(full)] for i in range(rows)]
            try:
                backend.run(batch)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                break
            rows *= 2
        else:
            return Check(
                "forced OOM",
                False,
                f"no OOM up to {max_rows} rows x {limit} tokens "
                f"with {ballast.bytes / GIB:.0f} GiB of ballast",
            )
        assert batch is not None
        ooms: list[FailedRun] = []
        errors: list[FailedRun] = []
        started = time.perf_counter()
        outcome = run_isolated(backend, batch, on_oom=ooms.append, on_error=errors.append)
        seconds = time.perf_counter() - started
    finally:
        ballast.release()
    failures = [o for o in outcome if isinstance(o, Failure)]
    answered = [o for o in outcome if not isinstance(o, Failure)]
    worst = 0.0
    if answered and not failures:
        expected = np.stack([alone[i % len(full)] for i in range(len(batch))])
        worst = float(cosines(np.stack(answered), expected).min())
    splits = sum(event.rows > 1 for event in ooms + errors)
    smallest_oom = min((event.rows for event in ooms), default=0)
    ok = bool(ooms) and not failures and len(answered) == len(batch) and worst >= 0.999
    torch.cuda.empty_cache()
    return Check(
        "forced OOM",
        ok,
        f"{rows} rows x {limit} tokens ran out of memory ({ballast.bytes / GIB:.0f} GiB ballast, "
        f"~{headroom_gib:g} GiB left); run_isolated: {len(ooms)} OOMs (smallest "
        f"{smallest_oom} rows), {len(errors)} other errors, {splits} splits, "
        f"{len(answered)}/{len(batch)} rows answered, {len(failures)} failed, "
        f"min cosine to the rows run alone {worst:.6f}, {seconds:.1f}s",
    )


def check_calibrate(backend: Any, max_rows: int) -> tuple[Check, int]:
    """(c) the auto budget, as a worker with ``--max-batch-size max_rows`` would get it."""
    from tokenq.worker.backends.calibrate import calibrate_budget

    started = time.perf_counter()
    tokens, reason = calibrate_budget(backend, max_rows=max_rows)
    seconds = time.perf_counter() - started
    ok = tokens >= backend.info.max_input_tokens
    return Check(
        f"calibrate_budget (max_rows {max_rows})",
        ok,
        f"{tokens} tokens in {seconds:.1f}s; reason: {reason}",
    ), tokens


def check_throughput(backend: Any, budget: int, max_rows: int, repeat: int) -> Check:
    """(d) tokens/s over the sample texts, packed by tokenq's packer under ``budget``."""
    import torch

    from tokenq.shared.packer import Budget, CostModel, Packer
    from tokenq.worker.backends.base import TextInput

    if budget < backend.info.max_input_tokens:
        return Check("throughput", False, f"budget {budget} is below the max input length")
    texts = all_texts() * repeat
    encodings = backend.tokenize([TextInput(t) for t in texts], backend.info.max_input_tokens)
    packer: Packer[Any] = Packer(Budget(budget, max_rows, CostModel.PADDED))
    for encoding in encodings:
        packer.add(encoding.length, 0.0, encoding)
    batches = []
    while packer:
        batch = packer.next_batch(0.0, flush=True)
        assert batch is not None
        batches.append(batch)
    backend.run(batches[0].payloads)  # warm-up: kernels, allocator
    torch.cuda.synchronize(backend.device)
    started = time.perf_counter()
    for batch in batches:
        backend.run(batch.payloads)  # returns numpy rows, so each batch is complete
    seconds = time.perf_counter() - started
    real = sum(b.tokens for b in batches)
    padded = sum(b.padded_tokens for b in batches)
    return Check(
        "throughput",
        real > 0,
        f"{real / seconds:,.0f} tokens/s ({padded / seconds:,.0f} padded tokens/s), "
        f"{len(texts)} texts, {len(batches)} batches of ~{len(texts) / len(batches):.0f} rows "
        f"under budget {budget}, padding efficiency {real / padded:.3f}, {seconds:.2f}s",
    )


# -------------------------------------------------------------------------- main


def run_check(checks: list[Check], name: str, step: Callable[[], Check]) -> Check | None:
    """Run one check; an exception fails that check, not the whole run."""
    started = time.perf_counter()
    try:
        check = step()
    except Exception as exc:
        check = Check(name, False, f"raised {type(exc).__name__}: {exc}")
    checks.append(check)
    status = "PASS" if check.ok else "FAIL"
    print(f"[{status}] {check.name}: {check.detail} ({time.perf_counter() - started:.1f}s)",
          flush=True)
    return check


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir or id (default: MiniLM)")
    parser.add_argument("--texts", type=int, default=64, help="texts for the fp16 check")
    parser.add_argument("--headroom-gib", type=float, default=4.0,
                        help="GPU memory left free by the ballast in the OOM check")
    parser.add_argument("--oom-rows", type=int, default=4096,
                        help="rows of max-length inputs in the first batch the OOM check tries")
    parser.add_argument("--max-oom-rows", type=int, default=1 << 20,
                        help="give up forcing an OOM past this many rows")
    parser.add_argument("--max-rows", type=int, default=256,
                        help="max_batch_size for calibration and throughput (worker default)")
    parser.add_argument("--repeat", type=int, default=10,
                        help="times the sample is repeated for the throughput check")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed in this Python; install tokenq[worker]")
        return 1
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device; skipped (torch {torch.__version__})")
        return 0
    device = torch.cuda.get_device_properties(0)
    print(f"gpu_check: {device.name}, {device.total_memory / GIB:.0f} GiB, "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    started = time.perf_counter()
    fp16 = load(args.model, "fp16")
    print(f"gpu_check: model {fp16.info.model}, max input {fp16.info.max_input_tokens}, "
          f"dim {fp16.info.dim}", flush=True)
    texts = sample_texts(args.texts)
    checks: list[Check] = []
    budget = 0

    def calibrate() -> Check:
        nonlocal budget
        check, budget = check_calibrate(fp16, args.max_rows)
        return check

    run_check(checks, "fp16 vs fp32", lambda: check_fp16(args.model, texts, fp16))
    run_check(checks, "forced OOM",
              lambda: check_oom(
                  fp16, all_texts(), args.headroom_gib, args.oom_rows, args.max_oom_rows))
    run_check(checks, "calibrate_budget", calibrate)
    run_check(checks, "calibrate_budget (more rows)",
              lambda: check_calibrate(fp16, max(args.max_rows, 4096))[0])
    run_check(checks, "throughput",
              lambda: check_throughput(fp16, budget, args.max_rows, args.repeat))
    failed = [check.name for check in checks if not check.ok]
    print(f"gpu_check: {len(checks) - len(failed)}/{len(checks)} passed in "
          f"{time.perf_counter() - started:.0f}s" + (f"; FAILED: {', '.join(failed)}" if failed
                                                      else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
