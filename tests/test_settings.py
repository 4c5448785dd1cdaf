"""Settings: TOKENQ_* variables are read, and a bad value is refused naming its field.

A worker started with a bad budget or URL should stop at once with a message
that says which setting to fix, not fail minutes later inside a Redis call.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tokenq.shared.keys import QueueRef
from tokenq.shared.settings import DEFAULT_REDIS_URL, ClientSettings, WorkerSettings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No TOKENQ_* from the developer's shell, and no stray .env in the cwd."""
    for name in list(os.environ):
        if name.upper().startswith("TOKENQ_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield


def test_defaults_are_valid() -> None:
    client, worker = ClientSettings(), WorkerSettings()
    assert client.redis_url == worker.redis_url == DEFAULT_REDIS_URL
    assert client.queue_ref == worker.queue_ref == QueueRef("default")
    assert worker.block_ms / 1000 < worker.socket_timeout_s
    assert worker.reply_ttl_s == 300.0


def test_environment_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENQ_REDIS_URL", "rediss://user:secret@redis.example:6380/2")
    monkeypatch.setenv("TOKENQ_QUEUE", "embeddings")
    monkeypatch.setenv("TOKENQ_PREFIX", "app.tq")
    monkeypatch.setenv("TOKENQ_MAX_BATCH_TOKENS", "4096")
    monkeypatch.setenv("TOKENQ_MAX_BATCH_SIZE", "32")
    monkeypatch.setenv("TOKENQ_COST_MODEL", "ragged")
    monkeypatch.setenv("TOKENQ_LINGER_MS", "0.5")
    monkeypatch.setenv("TOKENQ_LOG_JSON", "true")
    monkeypatch.setenv("tokenq_reply_ttl_s", "60")  # names are case-insensitive
    monkeypatch.setenv("TOKENQ_MAX_QUEUE_LENGTH", "10")
    monkeypatch.setenv("TOKENQ_NOT_A_SETTING", "ignored")

    worker = WorkerSettings()
    assert worker.redis_url.startswith("rediss://")
    assert worker.queue_ref == QueueRef("embeddings", prefix="app.tq")
    assert (worker.max_batch_tokens, worker.max_batch_size) == (4096, 32)
    assert worker.cost_model == "ragged"
    assert worker.linger_ms == 0.5
    assert worker.log_json is True
    assert worker.reply_ttl_s == 60.0
    assert ClientSettings().max_queue_length == 10


def test_arguments_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENQ_MAX_BATCH_TOKENS", "4096")
    assert WorkerSettings(max_batch_tokens=8192).max_batch_tokens == 8192


@pytest.mark.parametrize(
    ("cls", "values", "field"),
    [
        (WorkerSettings, {"max_batch_tokens": -1}, "max_batch_tokens"),
        (WorkerSettings, {"max_batch_tokens": 0}, "max_batch_tokens"),
        (WorkerSettings, {"max_batch_size": 0}, "max_batch_size"),
        (WorkerSettings, {"linger_ms": -1}, "linger_ms"),
        (WorkerSettings, {"cost_model": "fancy"}, "cost_model"),
        (WorkerSettings, {"reply_ttl_s": 0}, "reply_ttl_s"),
        (WorkerSettings, {"block_ms": 10_000, "socket_timeout_s": 10}, "block_ms"),
        (WorkerSettings, {"block_ms": 5_000, "socket_timeout_s": 2}, "socket_timeout_s"),
        (WorkerSettings, {"log_level": "LOUD"}, "log_level"),
        (WorkerSettings, {"redis_url": "http://localhost:6379"}, "redis_url"),
        (ClientSettings, {"redis_url": "localhost:6379"}, "redis_url"),
        (ClientSettings, {"queue": "bad name"}, "queue name"),
        (ClientSettings, {"queue": "q{1}"}, "queue name"),
        (WorkerSettings, {"prefix": "a:b"}, "key prefix"),
        (ClientSettings, {"max_queue_length": -1}, "max_queue_length"),
        (ClientSettings, {"timeout_s": 0}, "timeout_s"),
        (ClientSettings, {"max_request_bytes": 0}, "max_request_bytes"),
    ],
)
def test_bad_values_name_their_field(
    cls: type[ClientSettings] | type[WorkerSettings], values: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError, match=field):
        cls(**values)


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [
        ("TOKENQ_MAX_BATCH_TOKENS", "-5", "max_batch_tokens"),
        ("TOKENQ_MAX_BATCH_TOKENS", "lots", "max_batch_tokens"),
        ("TOKENQ_REDIS_URL", "tcp://redis:6379", "redis_url"),
        ("TOKENQ_BLOCK_MS", "60000", "block_ms"),
        ("TOKENQ_QUEUE", "no spaces please", "queue name"),
    ],
)
def test_bad_environment_values_name_their_field(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, field: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError, match=field):
        WorkerSettings()


@pytest.mark.parametrize("cls", [ClientSettings, WorkerSettings])
def test_every_setting_is_documented(cls: type[ClientSettings] | type[WorkerSettings]) -> None:
    """``--help`` shows each field's description; an undocumented setting is a bug."""
    for name, info in cls.model_fields.items():
        assert info.description, f"{cls.__name__}.{name} has no description"
