"""The Hugging Face backend's encodings (just the ids, to keep read-ahead small) and prompt
lengths; no torch."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class HFEncoding:
    """One tokenized input, special tokens included, ready to be padded into a batch."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...] | None = None  # a pair's segment ids; None: one sequence
    prompt_length: int = 0
    """Leading tokens that are the prompt, specials before it included; pooling with
    ``include_prompt: false`` leaves them out, and a window repeats them."""
    tokens: bool = False  # answer every token's last hidden state (output: tokens)
    truncated: bool | None = False  # cut to max_length; None where it cannot tell

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def is_pair(self) -> bool:
        return self.type_ids is not None


def pad_rows(batch: Sequence[HFEncoding], pad_id: int) -> tuple[np.ndarray, ...]:
    """ids, attention mask and type ids (rows x longest, int64), right-padded with ``pad_id``."""
    ids = np.full((len(batch), max(enc.length for enc in batch)), pad_id, dtype=np.int64)
    mask, type_ids = np.zeros_like(ids), np.zeros_like(ids)
    for row, enc in enumerate(batch):
        ids[row, : enc.length] = enc.ids
        mask[row, : enc.length] = 1
        if enc.type_ids is not None:
            type_ids[row, : enc.length] = enc.type_ids
    return ids, mask, type_ids


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
