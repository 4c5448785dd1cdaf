"""From token states to an embedding or SPLADE model's rows: sentence-transformers' Pooling
(masked: a row pools the same alone or batched) and Dense modules, before L2 normalisation."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenq.worker.backends.hf.layout import DenseConfig, PoolingMode, SentenceTransformerConfig
from tokenq.worker.backends.hf.load import ModelSource, find_file, join, refused
from tokenq.worker.backends.hf.settings import HFOptions

log = logging.getLogger(__name__)

_SETTING_MODES: dict[str, PoolingMode] = {"last": "lasttoken"}
"""``--pooling`` names that differ from sentence-transformers' own."""


def pool(
    hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[PoolingMode],
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool ``hidden`` (rows x tokens x dim) under ``mask`` (1 = real token), the modes
    concatenated in order; ``skip`` leaves each row's leading prompt tokens out."""
    hidden = hidden.float()
    weights = mask.to(torch.float32)
    if skip is not None:
        positions = torch.arange(weights.shape[1], device=weights.device)
        weights = weights * (positions.unsqueeze(0) >= skip.unsqueeze(1))
    return torch.cat([_pool(mode, hidden, weights) for mode in modes], dim=-1)


def _pool(mode: PoolingMode, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One mode under a float ``mask``; a row with no pooled token pools to zeros."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if mode == "cls":
        return hidden[rows, mask.argmax(dim=1)]  # the first pooled token
    if mode == "lasttoken":
        last = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)
        return hidden[rows, last] * mask[rows, last].unsqueeze(-1)
    if mode == "max":
        masked = hidden.masked_fill(mask.unsqueeze(-1) == 0, float("-inf")).max(dim=1).values
        return torch.where(mask.sum(dim=1, keepdim=True) > 0, masked, torch.zeros_like(masked))
    if mode == "weightedmean":  # a mean weighted by position, 1 for the first token
        mask = mask * torch.arange(1, mask.shape[1] + 1, device=mask.device, dtype=mask.dtype)
    summed = (hidden * mask.unsqueeze(-1)).sum(dim=1)
    count = mask.sum(dim=1, keepdim=True).clamp(min=1e-9)
    return summed / (count.sqrt() if mode == "mean_sqrt_len_tokens" else count)


class Dense(torch.nn.Module):
    """One sentence-transformers Dense module: ``activation(linear(x))``, plus ``x`` (or a
    bias-free ``residual(x)``) with ``use_residual``; its parameter names are theirs."""

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(config.in_features, config.out_features, bias=config.bias)
        self.activation = getattr(torch.nn, config.activation)()  # one of DENSE_ACTIVATIONS
        self.use_residual = config.use_residual
        self.residual: torch.nn.Linear | None = None
        if config.use_residual and config.in_features != config.out_features:
            self.residual = torch.nn.Linear(config.in_features, config.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (x if self.residual is None else self.residual(x))
        return out


def _load_dense(source: ModelSource, config: DenseConfig, given: int) -> Dense:
    """One Dense module given ``given`` values, its tensors read (safetensors, else a
    ``weights_only`` pickle) and checked by name and shape: a mismatch is a ConfigError."""
    where = config.path
    if config.in_features != given:
        raise refused(source, f"Dense module {where!r} takes {config.in_features} values but "
                      f"is given {given}")
    module = Dense(config)
    safetensors_path = find_file(source, join(where, "model.safetensors"))
    bin_path = find_file(source, join(where, "pytorch_model.bin"))
    if not safetensors_path and not bin_path:
        raise refused(source, f"Dense module {where!r} has no model.safetensors or "
                      "pytorch_model.bin")
    try:
        if safetensors_path:
            from safetensors.torch import load_file

            state = load_file(safetensors_path)
        else:
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as exc:  # torn, or code
        raise refused(source, f"cannot read Dense {where!r}: {exc}") from exc
    expected = set(module.state_dict())
    if not isinstance(state, dict) or set(state) != expected:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise refused(source, f"Dense module {where!r} holds {got}, expected {sorted(expected)}")
    try:
        module.load_state_dict({key: value.float() for key, value in state.items()}, strict=True)
    except RuntimeError as exc:  # a tensor of the wrong shape
        message = str(exc).splitlines()[-1].strip()
        raise refused(source, f"Dense {where!r}: {message}") from exc
    return module


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
        """Raw vectors; the prompt is left out when the model says so."""
        vectors = pool(hidden, mask, self.modes, None if self.include_prompt else prompt_lengths)
        return vectors if self.dense is None else self.dense(vectors)

    def describe(self) -> dict[str, Any]:  # for logs (the pooling is BackendInfo.pooling)
        facts: dict[str, Any] = {"normalize": self.normalize, "include_prompt": self.include_prompt}
        if self.dense is not None:
            facts["dense"] = [
                f"{m.linear.in_features}->{m.linear.out_features}" for m in self.dense
            ]
        return facts


def build_embedding_head(
    source: ModelSource, st: SentenceTransformerConfig, options: HFOptions, hidden_size: int,
    device: torch.device,
) -> EmbeddingHead:
    """The head as the model's files describe it, ``--pooling``/``--normalize`` overriding."""
    saved = st.pooling
    modes: tuple[PoolingMode, ...]
    if options.pooling == "auto":
        if saved is None:
            log.info("model %r has no pooling config; using mean pooling", source.name)
        modes = saved or ("mean",)
    else:
        chosen: PoolingMode = _SETTING_MODES.get(options.pooling, options.pooling)  # type: ignore[assignment]
        if saved is not None and saved != (chosen,):
            log.warning("model %r was trained with %s pooling; using %s as configured",
                        source.name, "+".join(saved), chosen)
        modes = (chosen,)
    modules, dim = [], hidden_size * len(modes)
    for config in st.dense:
        modules.append(_load_dense(source, config, dim))
        dim = config.out_features
    dense = torch.nn.Sequential(*modules).eval().to(device) if modules else None
    normalize = st.normalize if options.normalize == "auto" else options.normalize == "true"
    return EmbeddingHead(modes, st.include_prompt, normalize, dense, dim)


class SparseHead:
    """sentence-transformers' ``SpladePooling``: (MLM logits rows x tokens x vocab, mask) ->
    ``log1p(relu(x))`` (``log1p_relu``: once more), max or sum over tokens; padding zeroed."""

    def __init__(self, strategy: str, activation: str) -> None:
        self.strategy, self.activation = strategy, activation

    def __call__(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = (logits.float() * mask.unsqueeze(-1).float()).relu_().log1p_()
        if self.activation == "log1p_relu":
            weights = weights.log1p_()
        if self.strategy == "max":
            return weights.amax(dim=1)
        return weights.sum(dim=1)

    def describe(self) -> dict[str, str]:
        return {"splade_pooling": self.strategy, "splade_activation": self.activation}
