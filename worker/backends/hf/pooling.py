"""Turning a transformer's token states into one vector per row, as sentence-transformers pools.

Every mode reads the attention mask (right padding), so a row pools the same
alone or batched. Modes follow sentence-transformers 6's ``Pooling`` (``cls``,
``max``, ``mean``, ``mean_sqrt_len_tokens``, ``weightedmean``, ``lasttoken``),
concatenated in the order given; ``include_prompt: false`` masks the first
``skip[row]`` tokens. One difference: a row with nothing left to pool gives zeros
in ``max`` mode, not ``-inf``. Pooling runs in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tokenq.worker.backends.hf.layout import POOLING_MODES, PoolingMode

__all__ = ["POOLING_MODES", "PoolingMode", "l2_normalize", "pool"]


def pool(
    hidden: torch.Tensor,
    mask: torch.Tensor,
    modes: Sequence[PoolingMode],
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool ``hidden`` (rows x tokens x dim) under ``mask`` (1 = real token); ``skip`` leaves
    each row's leading prompt tokens out.
    """
    hidden = hidden.float()
    weights = mask.to(torch.float32)
    if skip is not None:
        positions = torch.arange(weights.shape[1], device=weights.device)
        weights = weights * (positions.unsqueeze(0) >= skip.unsqueeze(1))
    parts = []
    for mode in modes:
        pooler = _POOLERS.get(mode)
        if pooler is None:
            raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")
        parts.append(pooler(hidden, weights))
    return torch.cat(parts, dim=-1)


def l2_normalize(vectors: torch.Tensor) -> torch.Tensor:
    """Unit-length rows, with sentence-transformers' epsilon so a zero row stays zero."""
    return torch.nn.functional.normalize(vectors, p=2.0, dim=-1, eps=1e-12)


def _cls(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    first = mask.argmax(dim=1)  # the first pooled token; 0 for a row with none
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), first]


def _max(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    masked = hidden.masked_fill(mask.unsqueeze(-1) == 0, float("-inf")).max(dim=1).values
    return torch.where(mask.sum(dim=1, keepdim=True) > 0, masked, torch.zeros_like(masked))


def _sum_and_count(hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    summed = (hidden * mask.unsqueeze(-1)).sum(dim=1)
    return summed, mask.sum(dim=1, keepdim=True).clamp(min=1e-9)


def _mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    summed, count = _sum_and_count(hidden, mask)
    return summed / count


def _mean_sqrt_len(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    summed, count = _sum_and_count(hidden, mask)
    return summed / count.sqrt()


def _weighted_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device, dtype=mask.dtype)
    weights = mask * positions.unsqueeze(0)
    summed = (hidden * weights.unsqueeze(-1)).sum(dim=1)
    return summed / weights.sum(dim=1, keepdim=True).clamp(min=1e-9)


def _last_token(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    tokens = mask.shape[1]
    last = tokens - 1 - mask.flip(1).argmax(dim=1)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, last] * mask[rows, last].unsqueeze(-1)  # zeros for a row with none


_POOLERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cls": _cls,
    "max": _max,
    "mean": _mean,
    "mean_sqrt_len_tokens": _mean_sqrt_len,
    "weightedmean": _weighted_mean,
    "lasttoken": _last_token,
}
