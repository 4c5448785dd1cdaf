"""The config hash (``keys.config(q)``, docs/PROTOCOL.md "The config hash"): what a queue's
workers tell its producers. Sans-I/O; parsing never raises (a bad field reads as None)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from tokenq.shared.redis_text import as_text
from tokenq.shared.request_options import ModelFacts
from tokenq.shared.wire import PROTOCOL_VERSION

_FLAGS = {"1": True, "0": False}


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """One queue's config hash, typed; None for a field that is absent or unreadable."""

    max_input_tokens: int | None = None
    policy: str | None = None
    pairs: bool | None = None
    tokenizer: str | None = None
    model: str | None = None
    protocol: int | None = None
    backend: str | None = None
    task: str | None = None
    padded: bool | None = None
    max_batch_tokens: int | None = None
    dim: int | None = None
    normalized: bool | None = None
    labels: tuple[str, ...] | None = None
    prompts: Mapping[str, str] | None = None
    default_prompt_name: str | None = None
    updated_at: int | None = None
    shards: int | None = None
    enqueue_function: str | None = None
    dtype: str | None = None
    tokenize_processes: int | None = None
    token_dim: int | None = None
    raw_vectors: bool | None = None
    pooling: str | None = None


def encode_config(config: QueueConfig) -> dict[str, str]:
    """The hash's fields for HSET (absent values are left out)."""
    out: dict[str, str] = {}
    for field in fields(config):
        value = getattr(config, field.name)
        if isinstance(value, bool):
            out[field.name] = "1" if value else "0"
        elif isinstance(value, tuple):
            out[field.name] = json.dumps(list(value), ensure_ascii=False)
        elif isinstance(value, Mapping):
            out[field.name] = json.dumps(dict(value), ensure_ascii=False, sort_keys=True)
        elif value is not None:
            out[field.name] = str(value)
    return out


_INTS = {"max_input_tokens": 1, "protocol": 0, "max_batch_tokens": 1, "dim": 1, "updated_at": 0,
         "shards": 1, "tokenize_processes": 0, "token_dim": 1}
"""The whole-number fields, each with the least value it may hold."""
_BOOLS = ("pairs", "padded", "normalized", "raw_vectors")


def parse_config(raw: Mapping[str, str] | Mapping[bytes, bytes]) -> QueueConfig | None:
    """The config from an HGETALL (bytes or text); None when the hash is missing (empty)."""
    if not raw:
        return None
    text = {as_text(k): as_text(v) for k, v in raw.items()}
    values: dict[str, Any] = {field.name: text.get(field.name) or None
                              for field in fields(QueueConfig)}
    values.update({name: _int(text, name, minimum=least) for name, least in _INTS.items()})
    values.update({name: _FLAGS.get(text.get(name, "").strip()) for name in _BOOLS})
    values.update(
        policy=text.get("policy", "").strip().lower() or None,
        labels=_json_strings(text.get("labels"), list),
        prompts=_json_strings(text.get("prompts"), dict),
        # Read under its old name from older workers; the new name wins even when empty.
        default_prompt_name=text.get("default_prompt_name", text.get("default_prompt")) or None)
    return QueueConfig(**values)


def describe(
    info: Any, *, policy: str | None = None, max_batch_tokens: int | None = None,
    shards: int = 1, tokenize_processes: int | None = None, updated_at: int | None = None,
) -> QueueConfig:
    """The config a worker with backend ``info`` (its ``BackendInfo``, which this side cannot
    import) publishes, the only way it makes one; the queue's own values (``policy``, ...) are
    its settings, absent when left out."""
    embeds = info.task == "embed"
    return QueueConfig(
        **{name: getattr(info, name) for name in _AS_DESCRIBED},
        protocol=PROTOCOL_VERSION,
        backend=info.name,
        policy=policy,
        max_batch_tokens=max_batch_tokens,
        updated_at=updated_at,
        normalized=info.normalized if embeds else None,
        raw_vectors=info.raw_vectors if embeds else None,
        pooling=info.pooling if embeds else None,
        labels=info.labels or None,
        prompts=dict(info.prompts),
        default_prompt_name=info.default_prompt_name or "",
        tokenizer=info.tokenizer or None,
        shards=shards if shards > 1 else None,  # absent means 1: one shard's hash is unchanged
        tokenize_processes=tokenize_processes)


_AS_DESCRIBED = ("model", "task", "max_input_tokens", "pairs", "padded", "dim", "dtype",
                 "token_dim")
"""The config fields a backend's description holds as they are."""


MODEL_IDENTITY = ("backend", "model", "task", "dim")
"""The config fields that say which model answers a queue."""


def model_identity(config: QueueConfig | None) -> dict[str, str | int | None] | None:
    """Which model answers the queue, as its config says; None with no config or no model
    (``tokenq embed`` refuses to resume under another)."""
    if config is None or config.model is None:
        return None
    return {name: getattr(config, name) for name in MODEL_IDENTITY}


def model_facts(config: QueueConfig | None) -> ModelFacts:
    """What a config tells the request-option checks (None where it says nothing); both
    sides read it here. Without ``raw_vectors`` (an older hash), no ``token_dim`` is unknown."""
    if config is None:
        return ModelFacts()
    embeds = None if config.task is None else config.task == "embed"
    complete = config.raw_vectors is not None
    return ModelFacts(
        embeds=embeds,
        dim=config.dim if embeds else None,
        normalized=config.normalized,
        raw_vectors=config.raw_vectors,
        prompts=config.prompts,
        default_prompt_name=config.default_prompt_name or None,  # "": none (a write clears it)
        sparse=None if config.task is None else config.task == "sparse",
        token_dim=config.token_dim,
        can_output_tokens=(config.token_dim is not None if complete
                           else True if config.token_dim else None))


def _json_strings(raw: str | None, kind: type[list[Any]] | type[dict[str, Any]]) -> Any:
    """A JSON array (as a tuple) or object of strings, or None for anything else."""
    try:
        value = json.loads(raw or "null")
    except ValueError:
        return None
    items = value.values() if isinstance(value, dict) else value
    if not isinstance(value, kind) or not all(isinstance(item, str) for item in items):
        return None
    return tuple(value) if kind is list else value


def _int(fields: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    try:
        value = int(fields.get(name, ""))
    except ValueError:
        return None
    return value if value >= minimum else None
