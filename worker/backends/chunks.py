"""The 'chunk' over-length policy's arithmetic, shared by every backend.

docs/ARCHITECTURE.md, "Over-long input": an input longer than the model's limit is cut
into overlapping windows, each packed as its own sequence, and the window
embeddings are combined per request with a length-weighted mean. These are
pure functions over token ids and vectors (numpy only), so the sim and the
Hugging Face backend cut windows the same way and tests need no model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def sliding_windows(
    ids: Sequence[int], n_prefix: int, n_suffix: int, max_length: int, overlap: int
) -> list[tuple[int, ...]]:
    """Split one single-sequence input into windows of at most ``max_length`` tokens.

    ``ids`` is ``prefix + content + suffix`` where the prefix and suffix are
    the model's special tokens (``[CLS]`` and ``[SEP]`` for BERT). The
    content is cut into windows of ``max_length - n_prefix - n_suffix``
    tokens, consecutive windows sharing ``overlap`` tokens, and the special
    tokens are put back around each window, so each window is a sequence the
    model was trained on. An input that already fits comes back whole.
    """
    if n_prefix < 0 or n_suffix < 0 or n_prefix + n_suffix > len(ids):
        raise ValueError(f"bad special-token counts {n_prefix}+{n_suffix} for {len(ids)} ids")
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
    windows = []
    start = 0
    while True:
        windows.append(prefix + content[start : start + width] + suffix)
        if start + width >= len(content):
            return windows
        start += stride


def combine_chunks(
    vectors: Sequence[np.ndarray], lengths: Sequence[int], normalize: bool
) -> np.ndarray:
    """Combine the embeddings of one input's windows into one embedding.

    A length-weighted mean, so a short tail window counts for less than a
    full one; re-normalised to unit length when the model's own embeddings
    are normalised (a mean of unit vectors is shorter than one). ``lengths``
    are the windows' token counts (``HFEncoding.length``).
    """
    if len(vectors) == 0:
        raise ValueError("combine_chunks needs at least one vector")
    if len(vectors) != len(lengths):
        raise ValueError(f"{len(vectors)} vectors but {len(lengths)} lengths")
    weights = np.asarray(lengths, dtype=np.float64)
    if np.any(weights <= 0):
        raise ValueError(f"window lengths must be positive: {list(lengths)}")
    stacked = np.stack([np.asarray(v, dtype=np.float64) for v in vectors])
    mean = weights @ stacked / weights.sum()
    if normalize:
        mean = mean / max(float(np.linalg.norm(mean)), 1e-12)
    return mean.astype(np.float32)
