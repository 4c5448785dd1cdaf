"""Turning a transformer's token states into one vector per row.

Every pooling mode reads the attention mask, so pad tokens never reach a
result: a row's embedding is the same alone or padded into any batch.
Pooling runs in float32 whatever the model's dtype, as sentence-transformers
does, so a half-precision model loses nothing more in the sum.
"""

from __future__ import annotations

import torch

POOLING_MODES = ("mean", "cls", "last")


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool ``hidden`` (rows x tokens x dim) under ``mask`` (rows x tokens, 1 = real token).

    ``mean`` averages the real tokens; ``cls`` takes the first token;
    ``last`` takes each row's last real token (right padding assumed, which
    is how the backend pads).
    """
    hidden = hidden.float()
    if mode == "mean":
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * weights).sum(dim=1)
        return summed / weights.sum(dim=1).clamp(min=1e-9)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        last = mask.sum(dim=1).clamp(min=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")


def l2_normalize(vectors: torch.Tensor) -> torch.Tensor:
    """Unit-length rows, with sentence-transformers' epsilon so a zero row stays zero."""
    return torch.nn.functional.normalize(vectors, p=2.0, dim=-1, eps=1e-12)
