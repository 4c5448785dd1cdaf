"""What a request's options and the model's defaults do to its result: the worker's one home."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenq.shared.queue_config import describe, model_facts
from tokenq.shared.request_options import NO_OPTIONS, ModelFacts, RequestOptions
from tokenq.worker.backends.base import BackendInfo
from tokenq.worker.backends.chunks import combine_chunks

__all__ = ["NO_OPTIONS", "Finisher", "RequestOptions", "facts_of", "sparse_entries"]

_EPS = 1e-12  # sentence-transformers' epsilon: a zero vector stays zero


def facts_of(info: BackendInfo) -> ModelFacts:
    """The facts option checks read, derived as the producer derives them from the config."""
    return model_facts(describe(info))


class Finisher:
    """Shapes a backend's rows into the answers their requests asked for."""

    def __init__(self, info: BackendInfo) -> None:
        self.info = info
        self.embeds = info.embeds
        # Whether a default request's row must be touched at all.
        self._default_work = (
            (info.raw_vectors and info.normalized) if info.embeds else info.activation != "none"
        )

    def finish(
        self, rows: Sequence[np.ndarray], options: Sequence[RequestOptions]
    ) -> Sequence[np.ndarray]:
        """The answer for each row (one request's whole result each), in order; a 2-D array of
        ``rows`` that asked nothing stays one (no object per row)."""
        if options.count(NO_OPTIONS) == len(options):  # no request asked anything: one step
            if not self._default_work or not len(rows):
                return rows
            return self._shape(rows if isinstance(rows, np.ndarray) else stack_rows(rows))
        out = list(rows)
        plain = [i for i, option in enumerate(options) if not option.shapes_output]
        if self._default_work and plain:
            done = self._default([out[i] for i in plain])
            for i, row in zip(plain, done, strict=True):
                out[i] = row
        for i, option in enumerate(options):
            if option.shapes_output:
                out[i] = self.one(out[i], option)
        return out

    def one(self, row: np.ndarray, option: RequestOptions, *, combined: bool = False) -> np.ndarray:
        """One request's answer; a ``combined`` row (a chunked mean) is not unit length.
        ``output: tokens`` rows come back one row per token (2-D)."""
        if option.output_tokens:
            assert self.info.token_dim is not None  # parse_options refused it otherwise
            return np.ascontiguousarray(row, dtype=np.float32).reshape(-1, self.info.token_dim)
        if not self.embeds:
            if option.raw_scores or self.info.activation == "none":
                return row
            return _activate(row[np.newaxis, :], self.info.activation)[0]
        if option.dimensions is not None:
            row = row[: option.dimensions]
        normalize = self.info.normalized if option.normalize is None else option.normalize
        already_unit = self.info.normalized and not self.info.raw_vectors and not combined
        if normalize and (option.dimensions is not None or not already_unit):
            row = _unit(row[np.newaxis, :])[0]
        return np.ascontiguousarray(row, dtype=np.float32)

    def combine(
        self, windows: Sequence[np.ndarray], lengths: Sequence[int], option: RequestOptions
    ) -> np.ndarray:
        """A chunked input's answer from its windows' rows; normalised windows are made unit
        length first, so each counts by its length alone."""
        normalize = self.info.normalized if option.normalize is None else option.normalize
        if normalize and self.info.raw_vectors:
            windows = list(_unit(stack_rows(windows)))
        mean = combine_chunks(windows, lengths, normalize=False)
        return self.one(mean, option, combined=True)

    def _default(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        return list(self._shape(stack_rows(rows)))

    def _shape(self, stacked: np.ndarray) -> np.ndarray:
        """Default requests' answers from their rows stacked."""
        stacked = stacked.astype(np.float32, copy=False)
        return _unit(stacked) if self.embeds else _activate(stacked, self.info.activation)


def stack_rows(rows: Sequence[np.ndarray]) -> np.ndarray:
    """``np.stack(rows)``, the same array; 1-D rows of one shape and dtype are joined at a
    fraction of its cost (it checks each row in Python: per request, on the hot path)."""
    first = rows[0]
    if first.ndim != 1 or any(row.shape != first.shape or row.dtype != first.dtype
                              for row in rows):
        return np.stack(rows)
    return np.concatenate(rows).reshape(len(rows), first.shape[0])


def sparse_entries(row: np.ndarray) -> tuple[bytes, bytes]:
    """A dense sparse-model row's nonzero entries: (uint32 indices, float32 values), LE."""
    flat = np.ravel(row)
    nonzero = np.flatnonzero(flat)
    return nonzero.astype("<u4").tobytes(), flat[nonzero].astype("<f4").tobytes()


def _unit(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return (rows / np.maximum(norms, _EPS)).astype(np.float32, copy=False)


def _activate(rows: np.ndarray, activation: str) -> np.ndarray:
    rows = rows.astype(np.float32, copy=False)
    if activation == "sigmoid":
        # exp of a negative argument only, so no overflow warning for large logits
        positive = rows >= 0
        e = np.exp(-np.abs(rows))
        return np.where(positive, 1.0 / (1.0 + e), e / (1.0 + e)).astype(np.float32)
    if activation == "softmax":
        shifted = np.exp(rows - rows.max(axis=1, keepdims=True))
        return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
    raise ValueError(f"unknown activation {activation!r}")
