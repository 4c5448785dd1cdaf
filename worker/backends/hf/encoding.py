"""The Hugging Face backend's encodings (just the ids: read-ahead stays small) and prompt
lengths; no torch."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True, eq=False)  # identity: arrays have no one truth value
class HFEncoding:
    """One tokenized input, special tokens included; not frozen, made per request."""

    ids: np.ndarray  # int64, one row (often a view of a whole tokenize call's ids)
    type_ids: np.ndarray | None = None  # a pair's segment ids; None: one sequence
    prompt_length: int = 0
    """Leading tokens that are the prompt, specials before it included; pooling with
    ``include_prompt: false`` leaves them out, and a window repeats them."""
    tokens: bool = False  # answer every token's last hidden state (output: tokens)
    truncated: bool | None = False  # cut to max_length; None where it cannot tell
    length: int = field(init=False)

    def __post_init__(self) -> None:
        self.length = len(self.ids)

    @property
    def is_pair(self) -> bool:
        return self.type_ids is not None


def flat_rows(rows: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """``rows`` as int64 views of one flat array."""
    ends = list(itertools.accumulate(len(row) for row in rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, ends[-1] if ends else 0)
    return [flat[start:end] for start, end in zip([0, *ends], ends, strict=False)]


def pad_rows(batch: Sequence[HFEncoding], pad_id: int) -> tuple[np.ndarray, ...]:
    """ids, attention mask and type ids (rows x longest, int64), right-padded with ``pad_id``."""
    lengths = np.array([enc.length for enc in batch])
    mask = np.arange(lengths.max()) < lengths[:, None]
    ids = np.full(mask.shape, pad_id, dtype=np.int64)
    ids[mask] = np.concatenate([enc.ids for enc in batch])
    type_ids = np.zeros_like(ids)
    if any(enc.is_pair for enc in batch):
        rows = [np.zeros(enc.length, np.int64) if enc.type_ids is None else enc.type_ids
                for enc in batch]
        type_ids[mask] = np.concatenate(rows)
    return ids, mask.astype(np.int64), type_ids


def prompt_lengths(
    measure: Callable[[str], list[int]], special_ids: set[int], size: int = 1024
) -> Callable[[str], int]:
    """sentence-transformers' prompt length (its ids alone, less a trailing special token; 0
    for no prompt), one measurement per prompt text, the ``size`` most recently used kept."""
    special = frozenset(special_ids)

    @functools.lru_cache(maxsize=size)
    def length(prompt: str) -> int:
        ids = measure(prompt)
        return len(ids) - (1 if ids and ids[-1] in special else 0)

    return lambda prompt: length(prompt) if prompt else 0
