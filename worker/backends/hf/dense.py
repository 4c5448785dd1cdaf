"""sentence-transformers Dense modules: the projection some embedding models put after pooling.

``activation(linear(x))``, plus ``x`` (or a bias-free ``residual(x)``) with
``use_residual``, as sentence-transformers 6 computes it. Weights from
``model.safetensors`` or ``pytorch_model.bin`` with ``weights_only=True``; run in
float32.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import torch

from tokenq.shared.errors import ConfigError
from tokenq.worker.backends.hf.layout import DENSE_ACTIVATIONS, DenseConfig
from tokenq.worker.backends.hf.load import ModelSource, find_file, join

__all__ = ["Dense", "load_dense_head"]


class Dense(torch.nn.Module):
    """One Dense module; its parameter names are sentence-transformers' own."""

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(config.in_features, config.out_features, bias=config.bias)
        self.activation = _activation(config.activation)
        self.use_residual = config.use_residual
        self.residual: torch.nn.Linear | None = None
        if config.use_residual and config.in_features != config.out_features:
            self.residual = torch.nn.Linear(config.in_features, config.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (x if self.residual is None else self.residual(x))
        return out


def load_dense_head(
    source: ModelSource, configs: Sequence[DenseConfig], in_features: int
) -> tuple[torch.nn.Sequential | None, int]:
    """The Dense modules in order and the size they end with (None: none); a size
    mismatch is a ConfigError at start-up.
    """
    if not configs:
        return None, in_features
    modules = []
    size = in_features
    for config in configs:
        if config.in_features != size:
            raise ConfigError(
                f"model {source.name!r}: Dense module {config.path!r} takes {config.in_features} "
                f"values but is given {size}"
            )
        module = Dense(config)
        try:
            module.load_state_dict(_weights(source, config, module), strict=True)
        except RuntimeError as exc:  # a tensor of the wrong shape
            message = str(exc).splitlines()[-1].strip()
            raise ConfigError(f"model {source.name!r}: Dense {config.path!r}: {message}") from exc
        modules.append(module)
        size = config.out_features
    return torch.nn.Sequential(*modules).eval(), size


def _activation(name: str) -> torch.nn.Module:
    cls = getattr(torch.nn, name, None)
    if name not in DENSE_ACTIVATIONS or not isinstance(cls, type):
        raise ConfigError(f"Dense activation {name!r} is not a supported torch.nn activation")
    return cls()


def _weights(source: ModelSource, config: DenseConfig, module: Dense) -> dict[str, torch.Tensor]:
    """The module's saved tensors, checked against the parameters it must have."""
    safetensors_path = find_file(source, join(config.path, "model.safetensors"))
    bin_path = find_file(source, join(config.path, "pytorch_model.bin"))
    try:
        if safetensors_path:
            from safetensors.torch import load_file

            state = load_file(safetensors_path)
        elif bin_path:
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
        else:
            raise ConfigError(
                f"model {source.name!r}: Dense module {config.path!r} has no model.safetensors "
                "or pytorch_model.bin"
            )
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as exc:  # torn, or code
        raise ConfigError(
            f"model {source.name!r}: cannot read Dense {config.path!r}: {exc}"
        ) from exc
    expected = set(module.state_dict())
    if not isinstance(state, dict) or set(state) != expected:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(
            f"model {source.name!r}: Dense module {config.path!r} holds {got}, "
            f"expected {sorted(expected)}"
        )
    return {key: value.float() for key, value in state.items()}
