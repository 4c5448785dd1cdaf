"""Run one batch on a backend so that one bad row, or one too-big batch, fails alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
    """One ``backend.run`` call that raised: ``rows > 1`` was split and retried, ``rows == 1``
    fails for good."""

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


def is_out_of_memory(exc: BaseException) -> bool:
    """True for any framework's "device out of memory" error."""
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
    backend: Backend, encodings: Sequence[Encoding], failed_runs: list[FailedRun] | None = None
) -> Sequence[np.ndarray | Failure]:
    """Run ``encodings`` as one batch; answer every row with a vector or a Failure (one 2-D
    array when all ran at once and are alike). Each ``backend.run`` that raised is added to
    ``failed_runs``."""
    results: list[np.ndarray | Failure | None] = [None] * len(encodings)
    # An explicit stack, not recursion, keeps backend tracebacks short.
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
            if failed_runs is not None:
                failed_runs.append(event)
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
        checked = _checked_rows(outputs)
        if len(checked) == len(encodings):  # the whole batch in one run: as checked
            return checked
        results[start:start + len(outputs)] = checked
    return results  # type: ignore[return-value]  # each row was answered or failed alone


def _checked_rows(outputs: Sequence[object]) -> Sequence[np.ndarray | Failure]:
    """:func:`_checked` for every row, with one stacked numpy finiteness test when all rows
    are 1-D float32 of one length (per-row calls cost more than a fast model's run); rows
    all finite so come back as one 2-D array, each row a row of it."""
    rows = list(outputs)
    if len(rows) > 1 and all(
        type(row) is np.ndarray and row.dtype == np.float32 and row.ndim == 1
        for row in rows
    ) and len({row.shape for row in rows}) == 1:  # type: ignore[union-attr]
        # concatenate, not stack: the same values at a third of the cost per row
        width = rows[0].shape[0]  # type: ignore[union-attr]
        stacked = np.concatenate(rows).reshape(len(rows), width)  # type: ignore[arg-type]
        finite = np.isfinite(stacked).all(axis=1)
        if finite.all():
            return stacked
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


def adapt_budget(
    adaptive: AdaptiveBudget, packer: Packer[Any], ooms: Sequence[FailedRun], who: str
) -> None:
    """Feed one batch's OOM events to the adaptive budget and the packer: it drops below the
    failed cost, and climbs back slowly after clean batches."""
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
