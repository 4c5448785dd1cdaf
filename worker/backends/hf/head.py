"""From token states to an embedding model's raw vector: pooling, then any Dense modules.

:class:`EmbeddingHead` stops before L2 normalisation, which the pipeline does per
request (``info.raw_vectors``). Settings come from the sentence-transformers
files, ``--pooling`` and ``--normalize`` overriding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from tokenq.worker.backends.hf.dense import load_dense_head
from tokenq.worker.backends.hf.layout import PoolingMode, SentenceTransformerConfig
from tokenq.worker.backends.hf.load import ModelSource
from tokenq.worker.backends.hf.options import HFOptions
from tokenq.worker.backends.hf.pooling import pool

__all__ = ["EmbeddingHead", "build_embedding_head"]

log = logging.getLogger(__name__)

_SETTING_MODES: dict[str, PoolingMode] = {"last": "lasttoken"}
"""``--pooling`` names that differ from sentence-transformers' own."""


@dataclass(frozen=True, slots=True)
class EmbeddingHead:
    """Pooling, the Dense modules and the normalisation an embedding model's files ask for."""

    modes: tuple[PoolingMode, ...]
    include_prompt: bool
    normalize: bool
    """The model's default answer is unit length (the pipeline normalises, not the head)."""
    dense: torch.nn.Module | None
    dim: int

    def __call__(
        self, hidden: torch.Tensor, mask: torch.Tensor, prompt_lengths: torch.Tensor | None
    ) -> torch.Tensor:
        """Raw vectors, before any normalisation; the prompt is left out when the model says so."""
        skip = None if self.include_prompt else prompt_lengths
        vectors = pool(hidden, mask, self.modes, skip)
        return vectors if self.dense is None else self.dense(vectors)

    def describe(self) -> dict[str, Any]:
        """The head for logs (its pooling is ``BackendInfo.pooling``, published on its own)."""
        facts: dict[str, Any] = {
            "normalize": self.normalize,
            "include_prompt": self.include_prompt,
        }
        if self.dense is not None:
            facts["dense"] = [
                f"{m.linear.in_features}->{m.linear.out_features}" for m in self.dense
            ]
        return facts


def build_embedding_head(
    source: ModelSource,
    st: SentenceTransformerConfig,
    options: HFOptions,
    hidden_size: int,
    device: torch.device,
) -> EmbeddingHead:
    """The head as the model's files describe it, ``--pooling``/``--normalize`` overriding."""
    modes = _pooling_modes(source, st, options)
    dense, dim = load_dense_head(source, st.dense, hidden_size * len(modes))
    if dense is not None:
        dense = dense.to(device)
    normalize = st.normalize if options.normalize == "auto" else options.normalize == "true"
    include_prompt = st.pooling.include_prompt if st.pooling else True
    return EmbeddingHead(modes, include_prompt, normalize, dense, dim)


def _pooling_modes(
    source: ModelSource, st: SentenceTransformerConfig, options: HFOptions
) -> tuple[PoolingMode, ...]:
    """Explicit ``--pooling`` wins, then the model's Pooling config, then mean."""
    saved = st.pooling.modes if st.pooling else None
    if options.pooling == "auto":
        if saved is None:
            log.info("model %r has no pooling config; using mean pooling", source.name)
        return saved or ("mean",)
    chosen: PoolingMode = _SETTING_MODES.get(options.pooling, options.pooling)  # type: ignore[assignment]
    if saved is not None and saved != (chosen,):
        log.warning(
            "model %r was trained with %s pooling; using %s as configured",
            source.name,
            "+".join(saved),
            chosen,
        )
    return (chosen,)
