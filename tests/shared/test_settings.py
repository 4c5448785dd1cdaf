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
from tokenq.shared.settings import (
    DEFAULT_REDIS_URL,
    ClientSettings,
    DlqSettings,
    EmbedSettings,
    StatsSettings,
    TopSettings,
    UpSettings,
    describe_errors,
    env_var,
    flag,
)
from tokenq.worker.backends.hf.settings import HFSettings
from tokenq.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit


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


# ----------------------------------------------------------------- one definition per setting

COMMANDS = [ClientSettings, WorkerSettings, StatsSettings, TopSettings, DlqSettings,
            EmbedSettings, UpSettings]

# Where one setting legitimately differs between commands, and why.
ROLE_DEFAULTS = {
    ("WorkerSettings", "socket_timeout_s"): 10.0,  # a worker rides out a Redis restart
    ("WorkerSettings", "retries"): 10,
    ("EmbedSettings", "timeout_s"): 300.0,  # one enqueue call's replies, not one reply
    ("WorkerSettings", "shards"): 1,  # workers serve K; producers learn it from them
    ("UpSettings", "shards"): 1,
}
OPTIONAL_IN = {("StatsSettings", "queue"), ("TopSettings", "queue"), ("UpSettings", "redis_url")}


def _shape(cls: type, name: str) -> tuple:
    info = cls.model_fields[name]
    return info.description, info.metadata


def test_a_setting_two_commands_share_is_defined_once() -> None:
    """Same help, bounds and validators wherever a setting appears; defaults differ only by role."""
    by_name: dict[str, list[type]] = {}
    for cls in COMMANDS:
        for name in cls.model_fields:
            by_name.setdefault(name, []).append(cls)
    shared = {name: classes for name, classes in by_name.items() if len(classes) > 1}
    assert {"redis_url", "prefix", "queue", "socket_timeout_s", "max_queue_length", "as_json",
            "backend", "metrics_port", "retries"} <= set(shared)
    for name, classes in shared.items():
        usual = [cls for cls in classes if (cls.__name__, name) not in OPTIONAL_IN]
        first = usual[0]
        for cls in usual[1:]:
            assert _shape(cls, name) == _shape(first, name), f"{cls.__name__}.{name}"
            expected = ROLE_DEFAULTS.get((cls.__name__, name),
                                         ROLE_DEFAULTS.get((first.__name__, name)))
            if expected is None:
                assert cls.model_fields[name].default == first.model_fields[name].default, name
            else:
                picked = cls if (cls.__name__, name) in ROLE_DEFAULTS else first
                assert picked.model_fields[name].default == expected


def test_the_hf_options_are_the_worker_settings_own_definitions() -> None:
    pytest.importorskip("torch")
    from tokenq.worker.backends.hf.settings import HFOptions

    assert issubclass(WorkerSettings, HFSettings) and issubclass(HFOptions, HFSettings)
    for name in HFSettings.model_fields:
        mine, theirs = HFOptions.model_fields[name], WorkerSettings.model_fields[name]
        assert (mine.default, mine.description, mine.metadata) == (
            theirs.default, theirs.description, theirs.metadata), name
    # The aliases and checks are shared too: the CLI accepts what the backend accepts.
    assert WorkerSettings(dtype="half").dtype == HFOptions(dtype="half").dtype == "fp16"
    with pytest.raises(ValidationError, match="device must be"):
        WorkerSettings(device="tpu")


@pytest.mark.parametrize("cls", [ClientSettings, WorkerSettings, DlqSettings, UpSettings,
                                 StatsSettings])
def test_every_command_checks_queue_and_prefix_the_same_way(cls: type) -> None:
    extra: dict[str, Any] = {"action": "list"} if cls is DlqSettings else {}
    with pytest.raises(ValidationError, match="queue name 'bad name' is invalid"):
        cls(queue="bad name", **extra)
    with pytest.raises(ValidationError, match="key prefix 'a:b' is invalid"):
        cls(prefix="a:b", **extra)


def test_a_bad_url_is_refused_without_showing_its_password() -> None:
    with pytest.raises(ValidationError) as caught:
        ClientSettings(redis_url="http://ops:hunter2@redis:6379/0")
    assert "hunter2" not in str(caught.value) and "http://" in str(caught.value)
    with pytest.raises(ValidationError) as caught:
        ClientSettings(redis_url="ops:hunter2@redis:6379/0")
    assert "hunter2" not in str(caught.value)


# ----------------------------------------------------------------- the one error formatter


def _errors(cls: type, **values: Any) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        cls(**values)
    return describe_errors(caught.value, cls)


def test_errors_name_the_flag_and_the_variable() -> None:
    assert _errors(WorkerSettings, block_ms=20_000, socket_timeout_s=5) == [
        "--block-ms / TOKENQ_BLOCK_MS: block_ms (20000) must be shorter than socket_timeout_s "
        "(5.0s), or blocking reads would time out"]
    assert _errors(ClientSettings, socket_timeout_s=0) == [
        "--socket-timeout-s / TOKENQ_SOCKET_TIMEOUT_S: Input should be greater than 0"]
    assert _errors(WorkerSettings, heartbeat_s=5, batch_timeout_s=5)[0].startswith(
        "--batch-timeout-s / TOKENQ_BATCH_TIMEOUT_S: ")


def test_errors_use_the_flag_as_spelt_and_name_positionals() -> None:
    [line] = _errors(StatsSettings, as_json="maybe")
    assert line.startswith("--json / TOKENQ_AS_JSON: ")
    [line] = _errors(EmbedSettings, file="in.txt", output="out.jsonl", input_format="csv")
    assert line.startswith("--format / TOKENQ_INPUT_FORMAT: ")
    [line] = _errors(DlqSettings, action="lst")
    assert line.startswith("ACTION: ")
    # A check that spans settings is its own message, and that message names the flags.
    assert _errors(DlqSettings, action="retry") == ["dlq retry needs --id ENTRY_ID ... or --all"]


def test_one_line_per_setting_even_for_a_union() -> None:
    assert _errors(WorkerSettings, max_batch_tokens="lots") == [
        "--max-batch-tokens / TOKENQ_MAX_BATCH_TOKENS: max_batch_tokens must be a whole number "
        ">= 1 or 'auto', got 'lots'"]
    assert len(_errors(WorkerSettings, max_batch_size=0, linger_ms=-1)) == 2


def test_errors_for_settings_built_in_code_name_the_field() -> None:
    with pytest.raises(ValidationError) as caught:
        ClientSettings(timeout_s=0)
    assert describe_errors(caught.value, ClientSettings, flags=False) == [
        "timeout_s / TOKENQ_TIMEOUT_S: Input should be greater than 0"]


def test_flag_and_env_var_names() -> None:
    assert flag(WorkerSettings, "max_batch_tokens") == "--max-batch-tokens"
    assert flag(StatsSettings, "as_json") == "--json"
    assert flag(DlqSettings, "action") == "ACTION"
    assert env_var("max_batch_tokens") == "TOKENQ_MAX_BATCH_TOKENS"


def test_the_worker_serves_the_real_model_unless_told_otherwise() -> None:
    assert WorkerSettings().backend == "hf"
    assert WorkerSettings().model is None  # the bundled all-MiniLM-L6-v2


@pytest.mark.parametrize(
    ("backend", "given", "named"),
    [
        ("sim", {"model": "BAAI/bge-small-en-v1.5"}, "--model"),
        ("sim", {"task": "classify", "pooling": "cls"}, "--pooling, --task"),
        ("hf", {"sim_dim": 8}, "--sim-dim"),
        (" sim ", {"device": "cuda:0"}, "--device"),
    ],
)
def test_an_option_the_chosen_backend_ignores_is_refused_by_name(
    backend: str, given: dict, named: str
) -> None:
    with pytest.raises(ValidationError, match=f"--backend {backend.strip()} ignores {named}"):
        WorkerSettings(backend=backend, **given)


def test_a_plugin_may_read_either_backends_options() -> None:
    settings = WorkerSettings(backend="tests.plugins_for_tests:hf_oom_above", model="m", sim_dim=3)
    assert (settings.model, settings.sim_dim) == ("m", 3)
    assert WorkerSettings(backend="sim", sim_dim=8).sim_dim == 8  # its own options are fine
