"""The 'chunk' over-length policy's arithmetic, shared by every backend: overlapping windows
combined by a length-weighted mean (docs/ARCHITECTURE.md, "Over-long input")."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def sliding_windows(
    ids: Sequence[int], n_prefix: int, n_suffix: int, max_length: int, overlap: int
) -> list[tuple[int, ...]]:
    """Windows of at most ``max_length`` tokens of ``ids`` (``prefix + content + suffix``):
    the content cut with ``overlap`` shared tokens, the specials around each; whole if it fits."""
    width = max_length - n_prefix - n_suffix
    if width < 1:
        raise ValueError(
            f"max_length {max_length} leaves no room for content next to "
            f"{n_prefix + n_suffix} special tokens"
        )
    if not 0 <= overlap < width:
        raise ValueError(f"overlap must be in [0, {width}) for max_length {max_length}: {overlap}")
    ids = tuple(ids)
    if len(ids) <= max_length:
        return [ids]
    prefix, suffix = ids[:n_prefix], ids[len(ids) - n_suffix :]
    content = ids[n_prefix : len(ids) - n_suffix]
    stride = width - overlap
    windows, start = [], 0
    while True:
        windows.append(prefix + content[start : start + width] + suffix)
        if start + width >= len(content):
            return windows
        start += stride


def combine_chunks(
    vectors: Sequence[np.ndarray], lengths: Sequence[int], normalize: bool
) -> np.ndarray:
    """One input's window embeddings combined by a length-weighted mean (``lengths``: their
    token counts), re-normalised when the model's embeddings are."""
    weights = np.asarray(lengths, dtype=np.float64)
    stacked = np.stack([np.asarray(v, dtype=np.float64) for v in vectors])
    mean = weights @ stacked / weights.sum()
    if normalize:
        mean = mean / max(float(np.linalg.norm(mean)), 1e-12)
    return mean.astype(np.float32)
