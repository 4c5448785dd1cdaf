"""A worker's token budget (``max_batch_tokens``) from its device: on CUDA, full-length probes
of doubling rows and a line through the last two; on CPU a documented default."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CPU_DEFAULT_TOKENS = 16384  # a CPU batch is compute-bound long before memory matters
CPU_ROWS_AT_MAX_LENGTH = 8  # and the CPU budget admits this many full-length rows


def calibrate_budget(
    backend: Any, *, safety: float = 0.8, max_rows: int = 256, share: float = 1.0
) -> tuple[int, str]:
    """A token budget for ``backend`` and a sentence saying how it was chosen; ``share`` is this
    process's part of the device (``--device-share``, ``--processes-per-device``)."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1]: {share}")
    max_len = int(backend.info.max_input_tokens)
    if not str(backend.info.device).startswith("cuda"):
        tokens = max(CPU_ROWS_AT_MAX_LENGTH * max_len, CPU_DEFAULT_TOKENS)
        return tokens, (
            f"cpu: no device memory to probe; default max({CPU_ROWS_AT_MAX_LENGTH} x "
            f"max_input_tokens {max_len}, {CPU_DEFAULT_TOKENS}) = {tokens}"
        )
    tokens, reason = _calibrate_cuda(backend, safety=safety * share, max_rows=max_rows)
    if share < 1:
        reason += f" ({share:.3g} of the device's free memory: --device-share)"
    return tokens, reason


def _calibrate_cuda(backend: Any, *, safety: float, max_rows: int) -> tuple[int, str]:
    import torch

    from tokenq.worker.backends.base import TextInput

    device = torch.device(backend.info.device)
    max_len = int(backend.info.max_input_tokens)
    # A real full-length encoding by the backend's own tokenizer (a cross-encoder takes pairs).
    filler = "x " * max_len
    probe = TextInput(filler, filler) if backend.info.pairs else TextInput(filler)
    row = backend.tokenize([probe], max_len)[0]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)

    def measure(rows: int) -> int:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        backend.run([row] * rows)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base

    try:
        return probe_budget(
            measure, usable_bytes=int(free * safety), row_tokens=row.length, max_rows=max_rows
        )
    finally:
        torch.cuda.empty_cache()


def probe_budget(
    measure: Callable[[int], int], *, usable_bytes: int, row_tokens: int, max_rows: int
) -> tuple[int, str]:
    """Double the rows of full-length probes until memory or ``max_rows`` says stop;
    ``measure(rows)`` returns a probe's peak bytes or raises an OOM."""
    samples: list[tuple[int, int]] = []
    oom_tokens: int | None = None
    rows = 1
    while rows <= max_rows:
        try:
            peak = measure(rows)
        except (MemoryError, RuntimeError) as exc:  # DeviceOutOfMemory, or torch's own OOM
            if not isinstance(exc, MemoryError) and "out of memory" not in str(exc):
                raise
            oom_tokens = rows * row_tokens
            break
        samples.append((rows * row_tokens, peak))
        if peak * 2 > usable_bytes:
            break
        rows *= 2
    return plan_budget(samples, usable_bytes=usable_bytes, row_tokens=row_tokens,
                       max_rows=max_rows, oom_tokens=oom_tokens)


def plan_budget(
    samples: list[tuple[int, int]], *, usable_bytes: int, row_tokens: int, max_rows: int,
    oom_tokens: int | None = None,
) -> tuple[int, str]:
    """The budget a line through the probes (tokens, peak bytes) allows within ``usable_bytes``."""
    cap = max_rows * row_tokens
    if not samples:
        return 0, (
            f"cuda: one row of {row_tokens} tokens does not fit in {usable_bytes} usable bytes"
        )
    tokens, peak = samples[-1]
    per_token, fixed = peak / tokens, 0.0
    t1, p1 = samples[-2] if len(samples) >= 2 else samples[-1]
    if t1 != tokens:  # rows double, so the last two differ in tokens; a repeat gives no slope
        per_token = (peak - p1) / (tokens - t1)
        fixed = peak - per_token * tokens
    if per_token <= 0:
        per_token, fixed = max(peak, 1) / tokens, 0.0
    fixed = max(fixed, 0.0)  # a line that predicts negative memory would overshoot
    budget = int((usable_bytes - fixed) / per_token)
    if oom_tokens is not None:
        budget = min(budget, oom_tokens - 1)
    budget = max(min(budget, cap), 0)
    reason = (
        f"cuda: {per_token:.0f} bytes/token at {row_tokens}-token rows "
        f"(probed up to {tokens} tokens, peak {peak} bytes), {usable_bytes} usable bytes"
    )
    if budget == cap:
        reason += f"; capped at max_rows {max_rows} x {row_tokens}"
    if oom_tokens is not None:
        reason += f"; out of memory at {oom_tokens} tokens"
    return budget, reason
