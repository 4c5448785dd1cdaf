"""Run one batch on a backend so that one bad row, or one too-big batch, fails alone.

Both the Redis worker loop and the in-process :class:`~tokenq.worker.local.batcher.Batcher`
call :func:`run_isolated`; it knows nothing about Redis or asyncio and is
synchronous, because the caller runs it in a thread next to its event loop.

docs/RELIABILITY.md promises that an input which makes a batch raise is isolated by
splitting the batch, and that no request fails because of an out-of-memory
error unless it alone does not fit. Both come down to the same move: when
``backend.run`` raises, run the two halves separately, recursively. A batch of
``n`` rows with one bad row costs about ``2 log2(n)`` extra runs; every healthy
row is answered.

What this module does *not* decide is the budget: it reports each failed run
(:class:`FailedRun`) through callbacks, and the caller lowers its packer's
budget after an OOM and exports the counts as metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from tokenq.shared.errors import DeviceLost, ErrorCode
from tokenq.shared.failures import error_text
from tokenq.shared.packer import AdaptiveBudget, CostModel, Packer
from tokenq.shared.wire import ErrorInfo
from tokenq.worker.backends.base import Backend, Encoding

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1000
"""Longest error message put in a Failure (framework messages can be pages long)."""


Failure = ErrorInfo
"""Why one row got no result: the reply's own error record (``code`` is an
:class:`ErrorCode` value), so a failure becomes an error reply as it is."""


@dataclass(frozen=True, slots=True)
class FailedRun:
    """One ``backend.run`` call that raised, reported to the caller's callback.

    ``rows > 1`` means the batch was split and its halves retried; ``rows == 1``
    means that row now fails for good.
    """

    reason: Literal["oom", "error"]
    rows: int
    longest: int
    tokens: int
    error: str
    """``TypeName: message`` of what the backend raised."""

    @property
    def padded_tokens(self) -> int:
        """rows x longest: what a padded model tried to hold when it failed."""
        return self.rows * self.longest


OnFailedRun = Callable[[FailedRun], None]


def is_out_of_memory(exc: BaseException) -> bool:
    """True for any framework's "device out of memory" error.

    Matches :class:`~tokenq.shared.errors.DeviceOutOfMemory` and ``MemoryError``
    (a CPU backend's device memory is host memory), and any exception class
    named ``OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``,
    ``torch.OutOfMemoryError``) by name, so this module never imports torch.
    """
    if isinstance(exc, MemoryError):
        return True
    return any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__)


def describe(exc: BaseException) -> str:
    """``TypeName: message``, capped so an error reply stays small."""
    text = error_text(exc)
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 3] + "..."
    return text


def run_isolated(
    backend: Backend,
    encodings: Sequence[Encoding],
    *,
    on_oom: OnFailedRun | None = None,
    on_error: OnFailedRun | None = None,
) -> list[np.ndarray | Failure]:
    """Run ``encodings`` as one batch; answer every row with a vector or a Failure.

    On an out-of-memory error (see :func:`is_out_of_memory`) or any other
    exception, the batch is split into halves and each is retried, down to
    single rows; a single row that still fails gets ``out_of_memory`` or
    ``inference_failed``. ``on_oom`` / ``on_error`` hear about every failed
    run, so the caller can count splits and lower its budget. A row whose
    output is not a finite 1-D array fails with ``inference_failed``.
    """
    results: list[np.ndarray | Failure | None] = [None] * len(encodings)
    # An explicit stack instead of recursion: the depth is only log2(n), but
    # an iterative walk keeps tracebacks of backend errors short.
    pending: list[tuple[int, int]] = [(0, len(encodings))] if encodings else []
    while pending:
        start, stop = pending.pop()
        rows = encodings[start:stop]
        try:
            outputs = backend.run(rows)
            if len(outputs) != len(rows):
                raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(rows)} rows")
        except DeviceLost:
            raise  # nothing more can run here; splitting would only fail every row
        except Exception as exc:
            oom = is_out_of_memory(exc)
            lengths = [encoding.length for encoding in rows]
            event = FailedRun(
                reason="oom" if oom else "error",
                rows=len(rows),
                longest=max(lengths),
                tokens=sum(lengths),
                error=describe(exc),
            )
            _notify(on_oom if oom else on_error, event)
            if len(rows) == 1:
                code = ErrorCode.OUT_OF_MEMORY if oom else ErrorCode.INFERENCE_FAILED
                log.warning("row failed alone (%s): %s", code.value, event.error)
                results[start] = Failure(code.value, event.error)
            else:
                log.debug("splitting a batch of %d rows after %s", len(rows), event.error)
                middle = start + len(rows) // 2
                # Pushed right half first so the left half runs first (input order).
                pending.append((middle, stop))
                pending.append((start, middle))
            continue
        results[start:start + len(outputs)] = _checked_rows(outputs)
    return [result if result is not None else _missing() for result in results]


def _checked_rows(outputs: Sequence[object]) -> list[np.ndarray | Failure]:
    """:func:`_checked` for every row of a run, the finiteness test in one numpy call.

    Why: three numpy calls per row cost more than the null backend's whole
    run. When every row is already a 1-D float32 array of one
    length, which is what the built-in backends return, the rows are
    stacked and tested at once; a row that is not finite gets the same
    Failure it would alone. Anything else goes row by row.
    """
    rows = list(outputs)
    if len(rows) > 1 and all(
        type(row) is np.ndarray and row.dtype == np.float32 and row.ndim == 1
        for row in rows
    ) and len({row.shape for row in rows}) == 1:  # type: ignore[union-attr]
        # concatenate, not stack: the same values at a third of the cost per row
        width = rows[0].shape[0]  # type: ignore[union-attr]
        finite = np.isfinite(np.concatenate(rows)).reshape(len(rows), width).all(axis=1)  # type: ignore[arg-type]
        if finite.all():
            return rows  # type: ignore[return-value]
        return [row if ok else _checked(row) for row, ok in zip(rows, finite.tolist(), strict=True)]
    return [_checked(row) for row in rows]


def _checked(output: object) -> np.ndarray | Failure:
    """The row's output as a float32 1-D array, or a Failure saying what is wrong."""
    try:
        array = np.asarray(output, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        return Failure(ErrorCode.INFERENCE_FAILED.value, f"output is not numeric: {describe(exc)}")
    if array.ndim != 1:
        return Failure(
            ErrorCode.INFERENCE_FAILED.value, f"output has shape {array.shape}, expected 1-D"
        )
    if not np.isfinite(array).all():
        return Failure(ErrorCode.INFERENCE_FAILED.value, "output contains NaN or infinity")
    return array


def _notify(callback: OnFailedRun | None, event: FailedRun) -> None:
    """Call a caller's hook; a failing hook is logged, never allowed to lose results."""
    if callback is None:
        return
    try:
        callback(event)
    except Exception:
        log.exception("on_oom/on_error callback raised; ignored")


def _missing() -> Failure:
    # Unreachable: every row is either answered by a run or fails alone.
    return Failure(ErrorCode.INFERENCE_FAILED.value, "row was never run (tokenq bug)")


def adapt_budget(
    adaptive: AdaptiveBudget, packer: Packer[Any], ooms: Sequence[FailedRun], who: str
) -> None:
    """Feed one batch's out-of-memory events to the adaptive budget and the packer.

    After an OOM the budget drops below the failed batch's cost (padded or
    ragged, as the packer counts); after clean batches it climbs back slowly.
    Shared by the Redis worker and the in-process batcher.
    """
    before = adaptive.current
    if ooms:
        padded = packer.budget.cost_model is CostModel.PADDED
        after = adaptive.on_oom(max(e.padded_tokens if padded else e.tokens for e in ooms))
    else:
        after = adaptive.on_success()
    if after != before:
        packer.budget = replace(packer.budget, max_batch_tokens=after)
        log.warning(
            "%s budget %s from %d to %d tokens%s", who,
            "lowered" if after < before else "raised", before, after,
            " after out-of-memory" if ooms else "",
        )
