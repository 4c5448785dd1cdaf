"""SPLADE pooling: a masked-LM's logits to one weight per vocabulary token.

sentence-transformers' ``SpladePooling`` in torch: padding zeroed by the mask,
``log1p(relu(x))`` (``log1p_relu``: once more), then max (or sum) over the
sequence. Values are >= 0, so a padded row equals the row alone.
"""

from __future__ import annotations

import torch

from tokenq.worker.backends.hf.layout import SparseConfig

__all__ = ["SparseHead"]


class SparseHead:
    """(MLM logits rows x tokens x vocab, attention mask) -> rows x vocab weights."""

    def __init__(self, config: SparseConfig) -> None:
        self.strategy = config.strategy
        self.activation = config.activation

    def __call__(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = (logits.float() * mask.unsqueeze(-1).float()).relu_().log1p_()
        if self.activation == "log1p_relu":
            weights = weights.log1p_()
        if self.strategy == "max":
            return weights.amax(dim=1)
        return weights.sum(dim=1)

    def describe(self) -> dict[str, str]:
        """Facts for the worker's log line and ``info.extra``."""
        return {"splade_pooling": self.strategy, "splade_activation": self.activation}
