"""Which activation turns a scoring model's logits into the scores its replies carry.

``rerank`` follows sentence-transformers' ``CrossEncoder``: the saved
``activation_fn`` (release 6 file, then config.json, then the legacy key), else
sigmoid for one logit and none for several. ``classify`` follows transformers'
``text-classification`` pipeline: none for regression, sigmoid for multi-label or
one logit, else softmax. Any other class is refused.
"""

from __future__ import annotations

from typing import Any

from tokenq.shared.errors import ConfigError
from tokenq.worker.backends.base import Activation
from tokenq.worker.backends.hf.layout import torch_nn_class

__all__ = ["classify_activation", "rerank_activation"]

_CROSS_ENCODER_CLASSES: dict[str, Activation] = {
    "Sigmoid": "sigmoid",
    "Identity": "none",
    "Softmax": "softmax",
}


def rerank_activation(model: str, saved: str | None, config: Any) -> Activation:
    """The CrossEncoder rule; ``saved`` is config_sentence_transformers.json's ``activation_fn``."""
    path = saved
    if path is None:
        block = getattr(config, "sentence_transformers", None)
        if isinstance(block, dict) and block.get("activation_fn") is not None:
            path = str(block["activation_fn"])
    if path is None:
        legacy = getattr(config, "sbert_ce_default_activation_function", None)
        path = str(legacy) if legacy is not None else None
    if path is None:
        return "sigmoid" if int(config.num_labels) == 1 else "none"
    activation = _CROSS_ENCODER_CLASSES.get(torch_nn_class(path) or "")
    if activation is None:
        raise ConfigError(
            f"model {model!r}: cross-encoder activation_fn {path!r} is not supported "
            "(tokenq applies torch.nn Sigmoid, Softmax or Identity)"
        )
    return activation


def classify_activation(config: Any) -> Activation:
    """The transformers text-classification pipeline's default ``function_to_apply``."""
    problem = getattr(config, "problem_type", None)
    if problem == "regression":
        return "none"
    if problem == "multi_label_classification" or int(config.num_labels) == 1:
        return "sigmoid"
    return "softmax"
