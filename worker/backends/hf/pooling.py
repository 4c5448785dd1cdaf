"""Turning a transformer's token states into one vector per row, as sentence-transformers pools.

Every mode reads the attention mask, so pad tokens never reach a result: a
row's embedding is the same alone or padded into any batch. The backend
pads on the right, so a row's real tokens are its first ``length`` ones.
Modes and their order follow sentence-transformers 6's ``Pooling``:

- ``cls``: the first token pooling sees (the first after the prompt when it
  is left out); ``max``, ``mean``, ``mean_sqrt_len_tokens`` (sum over the
  square root of the count), ``weightedmean`` (token ``i`` weighs ``i + 1``,
  positions counted from the row's start even when a prompt is left out);
  ``lasttoken``: the row's last real token.
- several modes are concatenated in the order given.
- ``include_prompt: false``: the first ``skip[row]`` tokens are masked out
  before pooling, as sentence-transformers does with its prompt length.

One deliberate difference: a row with no token left to pool (a prompt that
fills the whole truncated input) gives zeros in ``max`` mode, as it does in
``mean`` and ``lasttoken``, where sentence-transformers gives ``-inf``.
Pooling runs in float32 whatever the model's dtype, so a half-precision
model loses nothing more in the sum.
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
    """Pool ``hidden`` (rows x tokens x dim) under ``mask`` (rows x tokens, 1 = real token).

    ``skip`` (one count per row) leaves each row's leading tokens out: its
    prompt, for a model whose Pooling has ``include_prompt: false``.
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
