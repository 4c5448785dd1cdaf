"""What a sentence-transformers model's own files say it is (modules, pooling, Dense, prompts,
a scorer's activation), read without torch; anything else refused by name."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from tokenq.shared.errors import ConfigError
from tokenq.worker.backends.base import Activation
from tokenq.worker.backends.hf.load import ModelSource, join, read_json, refused

PoolingMode = Literal["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]

POOLING_MODES: tuple[PoolingMode, ...] = get_args(PoolingMode)  # in the legacy keys' order

_LEGACY_POOLING_KEYS: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken",
}

DENSE_ACTIVATIONS = frozenset({  # elementwise torch.nn activations without parameters
    "Identity", "Tanh", "ReLU", "GELU", "Sigmoid", "SiLU", "LeakyReLU", "ELU", "SELU", "CELU",
    "Softplus", "Softsign", "Mish", "Hardtanh", "Hardswish", "Hardsigmoid", "ReLU6", "LogSigmoid",
    "Tanhshrink",
})

# Transformer-module config files, newest name first (sentence-transformers tries them in order).
_TRANSFORMER_CONFIGS = tuple(
    f"sentence_{name}_config.json"
    for name in ("bert", "roberta", "distilbert", "camembert", "albert", "xlm-roberta", "xlnet")
)
# What the Transformer module must compute for each task tokenq can serve from it.
_TRANSFORMER_TASK = {
    "embed": "feature-extraction", "rerank": "sequence-classification", "sparse": "fill-mask"
}
_TRANSFORMER_OUTPUT = {"embed": "token_embeddings", "rerank": "scores"}
# A SentenceTransformer starts with these prompts, empty unless the model's config fills them.
_EMBED_DEFAULT_PROMPTS = ("query", "document")


@dataclass(frozen=True, slots=True)
class DenseConfig:
    """One Dense module: ``activation(linear(x))`` (+ ``x`` or ``residual(x)``)."""

    path: str  # the module's folder, where its weights are
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "Tanh"  # a torch.nn class name from DENSE_ACTIVATIONS
    use_residual: bool = False


@dataclass(frozen=True, slots=True)
class SentenceTransformerConfig:
    """What a sentence-transformers model's own files say; all defaults for a plain model."""

    subfolder: str = ""  # where the Transformer module's files are ('' for the root)
    pooling: tuple[PoolingMode, ...] | None = None  # the Pooling module's modes, in order
    include_prompt: bool = True  # whether the Pooling module pools the prompt's tokens
    dense: tuple[DenseConfig, ...] = ()
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    activation_fn: str | None = None  # a cross-encoder's, as config_sentence_transformers saved
    splade: tuple[str, str] | None = None  # a SPLADE model's pooling strategy and activation


def read_sentence_transformer_config(source: ModelSource, task: str) -> SentenceTransformerConfig:
    """Read modules.json and the files it points to (none for a plain transformers model,
    not read for a classifier); a layout :data:`_LAYOUTS` does not allow is refused."""
    if task == "classify":
        return SentenceTransformerConfig()
    modules = read_json(source, "modules.json")
    if not isinstance(modules, list):
        if task == "sparse":
            raise ConfigError(f"model {source.name!r} has no modules.json: --task sparse needs "
                              "a sentence-transformers SparseEncoder (MLMTransformer, "
                              "SpladePooling)")
        return SentenceTransformerConfig(prompts=_prompts({}, task, source)[0])
    if not all(isinstance(m, Mapping) for m in modules):
        raise refused(source, "modules.json must be a list of objects")
    kinds = [  # each module's class name and folder, in order
        (str(m.get("type", "")).rsplit(".", 1)[-1], str(m.get("path", "")).strip("/"))
        for m in sorted(modules, key=lambda m: m.get("idx", 0))
    ]
    _check_order(source, task, [kind for kind, _ in kinds])
    subfolder, pooling, include_prompt, dense, normalize, splade = "", None, True, [], False, None
    for kind, path in kinds:
        if kind in ("Transformer", "MLMTransformer"):
            subfolder = path
        elif kind == "Pooling":
            pooling, include_prompt = _pooling(source, join(path, "config.json"))
        elif kind == "Dense":
            dense.append(_dense(source, path))
        elif kind == "SpladePooling":
            splade = _splade(source, join(path, "config.json"))
        else:
            normalize = True
    transformer = _transformer_config(source, subfolder, task)
    model_config = read_json(source, "config_sentence_transformers.json") or {}
    prompts, default_prompt_name = _prompts(model_config, task, source)
    max_seq = transformer.get("max_seq_length")
    activation_fn = model_config.get("activation_fn")
    return SentenceTransformerConfig(
        subfolder=subfolder, pooling=pooling, include_prompt=include_prompt, dense=tuple(dense),
        normalize=normalize, max_seq_length=int(max_seq) if max_seq else None,
        do_lower_case=bool(transformer.get("do_lower_case", False)), prompts=prompts,
        default_prompt_name=default_prompt_name,
        activation_fn=str(activation_fn) if activation_fn is not None else None, splade=splade,
    )


def torch_nn_class(path: str) -> str | None:
    """``X`` for ``torch.nn.X`` or ``torch.nn.modules.<file>.X`` (a saved class), else None."""
    parts = path.split(".")
    if parts[:2] != ["torch", "nn"] or len(parts) not in (3, 5):
        return None
    if len(parts) == 5 and parts[2] != "modules":
        return None
    return parts[-1] if parts[-1].isidentifier() else None


_LAYOUTS = {  # the modules tokenq runs for each task: in words, and as a pattern over their kinds
    "embed": ("Transformer, Pooling, then any Dense, then Normalize",
              r"Transformer Pooling( Dense)*( Normalize)?"),
    "rerank": ("Transformer", "Transformer"),
    # sentence-transformers 5+'s SparseEncoder
    "sparse": ("MLMTransformer, SpladePooling", "MLMTransformer SpladePooling"),
}
_MODULE_KINDS = frozenset(re.findall(r"\w+", " ".join(p for _, p in _LAYOUTS.values())))


def _check_order(source: ModelSource, task: str, kinds: list[str]) -> None:
    wanted, pattern = _LAYOUTS[task]
    if re.fullmatch(pattern, " ".join(kinds)):
        return
    unknown = [kind for kind in kinds if kind not in _MODULE_KINDS]
    what = f"modules {unknown}" if unknown else f"modules in the order {kinds}"
    sparse = task != "sparse" and "SpladePooling" in kinds
    raise refused(source, f"sentence-transformers {what} are not supported for --task {task} "
                  f"(tokenq runs {wanted})" + ("; it is a sparse (SPLADE) model: serve it with "
                                               "--task sparse" if sparse else ""))


def _transformer_config(source: ModelSource, subfolder: str, task: str) -> Mapping[str, Any]:
    """The Transformer module's config, refused when it computes something other than ``task``."""
    config: Mapping[str, Any] = {}
    for name in _TRANSFORMER_CONFIGS:
        found = read_json(source, join(subfolder, name))
        if isinstance(found, Mapping) and found:
            config = found
            break
    where = join(subfolder, "sentence_bert_config.json")
    transformer_task = config.get("transformer_task")
    if transformer_task is not None and transformer_task != _TRANSFORMER_TASK[task]:
        raise refused(source, f"its Transformer module computes {transformer_task!r} ({where}); "
                      f"--task {task} needs {_TRANSFORMER_TASK[task]!r}")
    modalities = config.get("modality_config") or {}
    if "message" in modalities:
        # sentence-transformers would render every input through the chat template.
        raise refused(source, "its Transformer module takes chat messages (modality_config "
                      f"'message' in {where}); tokenq tokenizes plain text only")
    output = config.get("module_output_name")
    if output is not None and output != _TRANSFORMER_OUTPUT.get(task, output):
        raise refused(source, f"module_output_name {output!r} in {where} is not supported "
                      f"(tokenq reads {_TRANSFORMER_OUTPUT[task]!r})")
    return config


def _pooling(source: ModelSource, filename: str) -> tuple[tuple[PoolingMode, ...], bool]:
    """A Pooling config's modes (``pooling_mode``, else the legacy booleans, else mean) and
    include_prompt."""
    config = read_json(source, filename) or {}
    if "pooling_mode" not in config:
        enabled = tuple(mode for key, mode in _LEGACY_POOLING_KEYS.items() if config.get(key))
        return enabled or ("mean",), bool(config.get("include_prompt", True))
    value = config["pooling_mode"]
    modes = [value] if isinstance(value, str) else value
    if not isinstance(modes, list | tuple) or not modes or any(
        mode not in POOLING_MODES for mode in modes
    ):
        raise refused(source, f"pooling_mode {value!r} in {filename} is not a mode or a list "
                      f"of modes of {list(POOLING_MODES)}")
    return tuple(modes), bool(config.get("include_prompt", True))


def _dense(source: ModelSource, path: str) -> DenseConfig:
    where = join(path, "config.json")
    config = read_json(source, where)
    if not isinstance(config, Mapping):
        raise refused(source, f"its Dense module has no {where}")
    for key in ("module_input_name", "module_output_name"):
        name = config.get(key)
        if name is not None and name != "sentence_embedding":
            raise refused(source, f"Dense {key} {name!r} in {where} is not supported (tokenq's "
                          "Dense maps the sentence embedding)")
    saved = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    activation = torch_nn_class(str(saved))
    if activation not in DENSE_ACTIVATIONS:
        raise refused(source, f"Dense activation_function {saved!r} in {where} is not supported "
                      f"(tokenq runs torch.nn {', '.join(sorted(DENSE_ACTIVATIONS))})")
    try:
        return DenseConfig(
            path=path, in_features=int(config["in_features"]),
            out_features=int(config["out_features"]), bias=bool(config.get("bias", True)),
            activation=activation, use_residual=bool(config.get("use_residual", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise refused(source, f"bad Dense config {where}: {exc!r}") from exc


def _prompts(
    config: Mapping[str, Any], task: str, source: ModelSource
) -> tuple[dict[str, str], str | None]:
    """Named prompts as sentence-transformers loads them (a SentenceTransformer starts with
    empty ``query`` and ``document`` ones, a CrossEncoder with none), and the default one."""
    prompts = dict.fromkeys(_EMBED_DEFAULT_PROMPTS, "") if task != "rerank" else {}
    saved = config.get("prompts") or {}
    if not isinstance(saved, Mapping):
        raise refused(source, "prompts in config_sentence_transformers.json")
    for name, text in saved.items():
        prompts[str(name)] = "" if text is None else str(text)
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise refused(source, f"default_prompt_name {default!r} is not one of its prompts "
                      f"{sorted(prompts)} (config_sentence_transformers.json)")
    return prompts, default


SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


def _splade(source: ModelSource, where: str) -> tuple[str, str]:
    pooling = read_json(source, where) or {}
    strategy = str(pooling.get("pooling_strategy", "max"))
    activation = str(pooling.get("activation_function", "relu"))
    if strategy not in SPLADE_STRATEGIES or activation not in SPLADE_ACTIVATIONS:
        raise refused(source, f"SpladePooling pooling_strategy {strategy!r} / activation_function "
                      f"{activation!r} in {where} is not supported (tokenq runs "
                      f"{list(SPLADE_STRATEGIES)} / {list(SPLADE_ACTIVATIONS)})")
    return strategy, activation


_CROSS_ENCODER_CLASSES: dict[str, Activation] = {
    "Sigmoid": "sigmoid", "Identity": "none", "Softmax": "softmax"}


def rerank_activation(model: str, saved: str | None, config: Any) -> Activation:
    """sentence-transformers' CrossEncoder rule: the saved ``activation_fn`` (its own file,
    then config.json, then the legacy key), else sigmoid for one logit and none for more."""
    block = getattr(config, "sentence_transformers", None)
    block = block if isinstance(block, dict) else {}
    found = (saved, block.get("activation_fn"),
             getattr(config, "sbert_ce_default_activation_function", None))
    path = next((str(value) for value in found if value is not None), None)
    if path is None:
        return "sigmoid" if int(config.num_labels) == 1 else "none"
    activation = _CROSS_ENCODER_CLASSES.get(torch_nn_class(path) or "")
    if activation is None:
        raise ConfigError(f"model {model!r}: cross-encoder activation_fn {path!r} is not "
                          "supported (tokenq applies torch.nn Sigmoid, Softmax or Identity)")
    return activation


def classify_activation(config: Any) -> Activation:
    """The transformers text-classification pipeline's default ``function_to_apply``."""
    problem = getattr(config, "problem_type", None)
    if problem == "regression":
        return "none"
    if problem == "multi_label_classification" or int(config.num_labels) == 1:
        return "sigmoid"
    return "softmax"
