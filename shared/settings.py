"""Every setting of every command, defined once with its default, bounds and help (a setting two
commands share in a small base below); a backend's own live in its folder (BackendSettings)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonDict
from pydantic_settings import BaseSettings, CliPositionalArg, SettingsConfigDict

from tokenq.shared.keys import DEFAULT_PREFIX, MAX_QUOTA, MAX_SHARDS, QueueRef, check_tenant
from tokenq.shared.redis_url import parse_redis_url
from tokenq.shared.wire import DEFAULT_MAX_REQUEST_BYTES

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ENV_PREFIX = "TOKENQ_"
Task = Literal["embed", "classify", "rerank", "sparse"]
"""What a model computes: vectors, a score per label or (query, passage), or a sparse vector."""
_POSITIONAL = get_args(CliPositionalArg[str])[1]
"""The marker pydantic-settings puts on a positional argument's field."""


def is_positional(settings_cls: type[BaseModel], name: str) -> bool:
    """Whether ``name`` is a positional argument (``dlq ACTION``)."""
    info = settings_cls.model_fields.get(name)
    return info is not None and _POSITIONAL in info.metadata


def _extra(settings_cls: type[BaseModel], name: str) -> dict[str, Any]:
    """Setting ``name``'s ``json_schema_extra``: its flag's spelling and marks."""
    info = settings_cls.model_fields.get(name)
    extra = info.json_schema_extra if info is not None else None
    return extra if isinstance(extra, dict) else {}


def flag(settings_cls: type[BaseModel], name: str) -> str:
    """The command-line spelling of setting ``name``: ``--max-batch-tokens``, ``ACTION``."""
    if is_positional(settings_cls, name):
        return name.upper()
    spelt = _extra(settings_cls, name).get("flag")
    return spelt if isinstance(spelt, str) else "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    """The environment variable of setting ``name``: ``TOKENQ_MAX_BATCH_TOKENS``."""
    return ENV_PREFIX + name.upper()


def describe_errors(
    exc: ValidationError, settings_cls: type[BaseModel], *, flags: bool = True
) -> list[str]:
    """One line per bad setting, ``--socket-timeout-s / TOKENQ_SOCKET_TIMEOUT_S: <why>``
    (``flags=False``: the field's name); a check of no one field is its message alone."""
    problems: dict[str, dict[str, None]] = {}  # label -> its messages, each once, in order
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        if name not in settings_cls.model_fields:
            label = ""
        elif is_positional(settings_cls, name):
            label = flag(settings_cls, name)
        else:
            label = f"{flag(settings_cls, name) if flags else name} / {env_var(name)}"
        problems.setdefault(label, {})[error["msg"].removeprefix("Value error, ")] = None
    return [f"{label}: {'; '.join(messages)}" if label else "; ".join(messages)
            for label, messages in problems.items()]


def _redis_url(value: str) -> str:
    if parse_redis_url(value).kind != "single":
        return value  # a Cluster or Sentinel URL, checked whole by the parser
    if not value.startswith(("redis://", "rediss://", "unix://")):
        # Only the scheme is shown: the rest may hold a password.
        given = f"not {value.split('://', 1)[0]}://" if "://" in value else "it has no scheme"
        raise ValueError(
            "redis_url must start with redis://, rediss://, unix://, redis+cluster:// or "
            f"redis+sentinel:// ({given})")
    return value


MAX_EXACT_INT = 2**53
"""The largest whole number any setting may be (exact as a Lua double in a Redis script)."""
MAX_SECONDS = 10**9
"""The longest time any ``*_s``/``*_ms``/``*_us`` setting may name, about 31 years: what
Python's waits and Redis's TTLs all take (docs/decisions/0060-numeric-settings-bounded.md)."""
_UNIT_SCALE = {"_s": 1, "_ms": 1_000, "_us": 1_000_000}


def check_number(value: object, name: str, *, allow_inf: bool = False) -> object:
    """``value`` if a setting may hold it, else ValueError: no NaN, infinite only with
    ``allow_inf``, a time at most :data:`MAX_SECONDS`, any other number :data:`MAX_EXACT_INT`."""
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


REDIS_MS: JsonDict = {"redis_ms": True}
"""``json_schema_extra`` of a seconds setting Redis gets in whole milliseconds (a TTL)."""


def check_redis_ms(value: object, name: str) -> object:
    """``value`` unless it is a positive time under 1 ms, which Redis would get as 0 ms (a
    refused TTL, dedupe off, every entry claimed)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 0.001:
        raise ValueError(f"{name} must be 0.001 (1 ms) or more: Redis takes it in whole "
                         f"milliseconds, and {value:g}s would be 0 ms")
    return value


RedisUrl = Annotated[str, AfterValidator(_redis_url)]
QueueName = Annotated[str, AfterValidator(lambda value: QueueRef(value).name)]
"""A queue name; a bad one is QueueRef's ValueError, which names it."""
SocketTimeout = Annotated[float, Field(gt=0, description="Redis socket timeout, seconds")]
Retries = Annotated[int, Field(ge=0, description="Redis command retries (exponential backoff)")]
ReplyTimeout = Annotated[
    float, Field(gt=0, description="how long one call waits for its replies, seconds")
]
Port = Annotated[int, Field(ge=0, le=65535)]
Shards = Annotated[int, Field(ge=1, le=MAX_SHARDS)]


def _shards(default: int | None) -> Any:
    """The one definition of ``shards``; workers default to 1, producers to learning it."""
    return Field(default, description="the queue's shard count K (streams {q:0}..{q:K-1} plus "
                 "{q}); producers learn it from the workers' config hash, or must match it")


ShardChoice = Literal["round_robin", "shortest"]


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
        defer_build=True,  # a process builds the one command's class it parses, not all
    )

    redis_url: RedisUrl = Field(DEFAULT_REDIS_URL, description="Redis URL: redis://, rediss:// "
                                "(TLS), redis+cluster://h:p,..., redis+sentinel://h:p,.../service")
    prefix: Annotated[str, AfterValidator(lambda value: QueueRef("x", value).prefix)] = Field(
        DEFAULT_PREFIX, description="key prefix of every tokenq key")
    socket_timeout_s: SocketTimeout = 5.0

    @field_validator("*", mode="after")
    @classmethod
    def _bounded(cls, value: Any, info: ValidationInfo) -> Any:
        """Every number of every command's settings within what Redis and Python take."""
        name = info.field_name or ""
        marks = _extra(cls, name)
        value = check_number(value, name, allow_inf=marks.get("inf") is True)
        return check_redis_ms(value, name) if marks.get("redis_ms") is True else value


class _QueueSettings(_Settings):
    """Settings that address one queue."""

    queue: QueueName = Field("default", description="queue name (letters, digits, _.-)")

    @property
    def queue_ref(self) -> QueueRef:
        return QueueRef(self.queue, self.prefix)


class _Requests(_QueueSettings):
    """Settings both sides of the queue share: a producer and a worker must agree on these."""

    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES, ge=1, description="largest UTF-8 text accepted per request")


class _QueueLimit(BaseModel):
    max_queue_length: int = Field(100_000, ge=0, description="most requests the queue holds; "
                                  "past it enqueue raises QueueFull (0: no limit)")


class _JsonOutput(BaseModel):
    as_json: bool = Field(False, description="print JSON instead of text (docs/OPERATIONS.md)",
                          json_schema_extra={"flag": "--json"})


class _WorkerProcess(BaseModel):
    """What each worker process runs: ``tokenq worker`` flags, passed on by ``tokenq up``."""

    backend: str = Field("hf", description="'hf' (a real model), 'sim' (a simulated GPU) or a "
                         "plugin 'package.module:factory'")
    shards: Shards | None = _shards(1)
    metrics_port: Port = Field(
        0, description="Prometheus metrics port (0: off); worker i of up or --devices: port + i")


class BackendSettings(BaseModel):
    """The base of a backend's own settings (in its folder, composed by the worker), listed in
    ``--help`` under ``heading`` (``--backend sim (a simulated GPU)``)."""

    heading: ClassVar[str] = ""


def help_group(settings_cls: type[BaseModel], name: str) -> str | None:
    """The ``heading`` of the backend settings that declare ``name``; None for the command's."""
    for base in settings_cls.__mro__:
        title = base.__dict__.get("heading")
        if isinstance(title, str) and title and name in getattr(base, "model_fields", {}):
            return title
    return None


def group_environment(settings_cls: type[BaseModel], title: str) -> str:
    """The ``TOKENQ_*`` variables ``--help`` lists under ``title`` as well."""
    names = [env_var(name) for name in settings_cls.model_fields
             if help_group(settings_cls, name) == title]
    return textwrap.fill("variables: " + ", ".join(names), 77) if names else ""


class ClientSettings(_QueueLimit, _Requests):
    """What a producer needs."""

    timeout_s: ReplyTimeout = 30.0
    retries: Retries = 5
    dedupe_ttl_s: float = Field(60.0, ge=0, description="remember enqueued ids this long so a "
                                "retry adds nothing twice (0: off)", json_schema_extra=REDIS_MS)
    durable_replicas: int = Field(0, ge=0, le=64, description="an enqueue returns once this many "
                                  "replicas have it (Redis WAIT; 0: off)")
    durable_timeout_ms: int = Field(1000, ge=1, le=600_000, description="longest a durable "
                                    "enqueue waits for its replicas (within the call's timeout)")
    shards: Shards | None = _shards(None)
    shard_choice: ShardChoice = Field("round_robin", description="the shard each call writes to: "
                                      "round_robin, or shortest (lengths read once a second)")


class _Survey(_Settings):
    """What tokenq stats and tokenq top look at."""

    queue: QueueName | None = Field(
        None, description="only this queue (default: every queue under the prefix)")


class StatsSettings(_JsonOutput, _Survey):
    """One look at every queue under the prefix: length, pending, lag, workers, dead letters."""


class TopSettings(_JsonOutput, _Survey):
    """tokenq stats refreshed live, with rates between refreshes; Ctrl-C quits."""

    interval_s: float = Field(1.0, gt=0, description="seconds between refreshes")
    once: bool = Field(False, description="draw one frame and exit (scripts, tests)")


class FunctionsSettings(_Settings):
    """Load tokenq's Lua functions (Redis 7+) with an admin's rights (docs/SECURITY.md)."""

    action: CliPositionalArg[Literal["load", "show"]] = Field(
        description="load the library (every primary of a Cluster), or show its names")


class DlqSettings(_QueueLimit, _JsonOutput, _QueueSettings):
    """Look at, retry or purge a queue's dead letters (docs/OPERATIONS.md)."""

    action: CliPositionalArg[Literal["list", "retry", "purge"]] = Field(
        description="list the dead letters, retry them (back onto the queue), or purge them")
    id: list[str] = Field(default_factory=list, description="dead-stream entry ids to act on "
                          "(--id A B, --id A --id B or --id A,B)")
    all: bool = Field(False, description="act on every dead letter")
    count: int = Field(100, ge=1, description="list: show at most this many (oldest first)")
    drop_deadline: bool = Field(
        False, description="retry: remove the request's deadline_ms so it runs even if late")

    @model_validator(mode="after")
    def _check_target(self) -> DlqSettings:
        if self.action != "list" and not self.id and not self.all:
            raise ValueError(f"dlq {self.action} needs --id ENTRY_ID ... or --all")
        if self.id and self.all:
            raise ValueError("give --id or --all, not both")
        return self


class QuotasSettings(_JsonOutput, _QueueSettings):
    """Show, set or clear a queue's tenant quotas of pending tokens (docs/OPERATIONS.md)."""

    action: CliPositionalArg[Literal["show", "set", "clear"]] = Field(
        description="show each quota and each tenant's pending tokens, set one, or clear them")
    tenant: str | None = Field(None, description="set, clear: the tenant ('*': every tenant "
                               "not named; 'default': requests of no tenant)")
    tokens: int | None = Field(None, ge=0, le=MAX_QUOTA, description="set: the most pending "
                               "tokens the tenant may hold; past it enqueue refuses (0: all)")
    all: bool = Field(False, description="clear: every quota")

    @model_validator(mode="after")
    def _check_target(self) -> QuotasSettings:
        if self.tenant is not None and self.tenant != "*":
            check_tenant(self.tenant)
        if self.action == "set" and (self.tenant is None or self.tokens is None):
            raise ValueError("quotas set needs --tenant TENANT and --tokens N")
        if self.action == "clear" and (self.tenant is None) == (not self.all):
            raise ValueError("quotas clear needs --tenant TENANT or --all (not both)")
        return self


class EmbedSettings(ClientSettings):
    """Embed a file through the queue, in input order; run it again to resume."""

    file: CliPositionalArg[str] = Field(
        description="input: lines of text, or JSONL ('-' reads standard input)")
    output: Path = Field(
        description="where the vectors go: .npy (a float32 matrix, needs numpy) or .jsonl")
    input_format: Literal["auto", "text", "jsonl"] = Field(
        "auto", description="auto: jsonl for .jsonl/.ndjson, else one text per line",
        json_schema_extra={"flag": "--format"})
    field: str = Field("text", description="jsonl input: the field holding the text")
    id_field: str = Field("id", description="jsonl input: copied into .jsonl output as id")
    blank: Literal["skip", "error"] = Field("skip", description="blank inputs: skip (no row; .npy "
                                            "lists them in OUTPUT.skipped.txt) or an error row")
    chunk_size: int = Field(
        2048, ge=1, description="inputs per checkpoint: a re-run resumes after the last one")
    batch_size: int = Field(64, ge=1, description="inputs per enqueue call (one reply key)")
    max_in_flight: int = Field(1024, ge=1, description="most inputs enqueued and unanswered")
    timeout_s: ReplyTimeout = 300.0  # one enqueue call of --batch-size inputs
    restart: bool = Field(False, description="discard progress from an earlier run and start over")
    progress: bool = Field(True, description="show a progress bar on stderr",
                           json_schema_extra={"off_help": "no progress bar on stderr"})


class ServeSettings(ClientSettings):
    """An HTTP gateway (OpenAI and TEI APIs) in front of queues; it holds no model."""

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: Port = Field(8080, description="port to listen on")
    models: str = Field("", description="'name=queue,...' (the first is the default); empty: "
                        "--queue serves every model name")
    max_client_batch_size: int = Field(2048, ge=1, description="most inputs per request (413)")
    max_body_bytes: int = Field(16 << 20, ge=1024, description="largest request body (413)")
    max_concurrent_requests: int = Field(512, ge=1, description="most POSTs in flight, bodies "
                                         "being read included (more: 429)")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>' but on "
                                "/health, /ready, /metrics (401); best as TOKENQ_API_KEY")
    api_keys: str = Field("", description="'tenant=key,...': each API key names its caller's "
                          "tenant, as --api-key accepts one; best as TOKENQ_API_KEYS")
    cors_allow_origin: str = Field("", description="origins browsers may call from, "
                                   "comma-separated ('*': any; empty: no CORS headers)")
    cold_start_s: float = Field(0.0, ge=0, description="with no live worker: 0 answers 503 at "
                                "once; N queues the request and waits N s for a worker")
    header_timeout_s: float = Field(10.0, gt=0, description="close a connection that sends no "
                                    "request headers this long after opening or its last answer")

    @field_validator("models")
    @classmethod
    def _check_models(cls, value: str) -> str:
        _model_queues(value)  # raises ValueError naming the bad part
        return value

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: str) -> str:
        tenant_keys(value)  # raises ValueError naming the bad part, never the key
        return value

    @property
    def model_queues(self) -> dict[str, str]:
        """``--models`` as {model name: queue}, in order (empty: --queue serves every name)."""
        return _model_queues(self.models)


def _parts(value: str) -> list[str]:
    """A comma-separated setting's parts, stripped, empty ones dropped."""
    return [part for part in (item.strip() for item in value.split(",")) if part]


def _model_queues(value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in _parts(value):
        name, sep, queue = (side.strip() for side in part.partition("="))
        if not sep or not name or not queue:
            raise ValueError(f"models: {part!r} is not name=queue")
        out[name] = QueueRef(queue).name  # a ValueError naming the queue name
    return out


def tenant_keys(value: str) -> dict[str, str]:
    """``--api-keys`` as {key: tenant}; ValueError for a part that is not tenant=key, or that
    gives a key to a second tenant (the key itself never in the message)."""
    out: dict[str, str] = {}
    for number, part in enumerate(_parts(value), 1):
        tenant, sep, key = part.partition("=")
        if not sep or not key:
            raise ValueError(f"api_keys: part {number} is not tenant=key")
        if out.setdefault(key, check_tenant(tenant)) != tenant:  # whose would its caller be?
            raise ValueError(f"api_keys: part {number} gives tenant {tenant!r} the key of "
                             f"tenant {out[key]!r}")
    return out


class UpSettings(_WorkerProcess, _QueueSettings):
    """A local Redis and N workers, for development and demos; flags after -- go to each worker."""

    redis_url: RedisUrl | None = Field(  # type: ignore[assignment]
        None, description="use this Redis instead of a private redis-server (AOF on, loopback)")
    workers: int = Field(2, ge=0, description="worker processes to start")
    data_dir: Path | None = Field(
        None, description="the private Redis's data directory (default: a temporary one)")
    port: Port = Field(0, description="the private Redis's port (0: a free one)")
    stop_timeout_s: float = Field(
        30.0, gt=0, description="how long workers get to finish after Ctrl-C before SIGKILL")


MAX_DEVICES = 64
"""Most GPUs ``--devices`` lists (8 GPUs of 7 MIG slices fit), so a typo starts no thousands."""
MAX_PROCESSES_PER_DEVICE = 8
"""Most worker processes per GPU: each holds a copy of the model and a CUDA context."""


class BaseWorkerSettings(_WorkerProcess, _QueueLimit, _Requests):
    """Run one worker process on a queue (--devices: one per GPU)."""

    # Longer than a caller's: a worker rides out a Redis restart instead of failing.
    socket_timeout_s: SocketTimeout = 10.0
    retries: Retries = 10

    consumer: str | None = Field(
        None, description="consumer name in the group (default: host-pid-random)")
    max_batch_tokens: int | Literal["auto"] = Field(
        16384, description="token budget of one batch; 'auto': fit to free CUDA memory")
    max_batch_size: int = Field(256, ge=1, description="most rows in one batch")
    linger_ms: float = Field(
        2.0, ge=0, description="how long an idle device waits to fill an unsealed batch")
    max_padding_ratio: float = Field(1.0, ge=0, description="most padding a request may add, "
                                     "times its length (inf: any)", json_schema_extra={"inf": True})
    aging_ms: float = Field(1000.0, gt=0, description="each priority class stands this much "
                            "earlier in line; a head passed over this long goes next")
    max_batch_ms: float | None = Field(
        None, gt=0, description="plan no batch longer than this on the device (default: no cap)")
    cost_model: Literal["auto", "padded", "ragged"] = Field(
        "auto", description="batch cost: rows x longest (padded) or sum (ragged); auto asks the "
        "backend")
    policy: Literal["truncate", "reject", "chunk"] = Field(
        "truncate", description="over-long input: truncate, reject, or chunk into windows")
    chunk_overlap: int = Field(
        32, ge=0, description="chunk policy: tokens shared by consecutive windows")
    tokenize_processes: int = Field(0, ge=0, le=256, description="tokenize in this many child "
                                    "processes (0: a thread of the worker)")
    admit_inline_ms: float = Field(2.0, ge=0, le=1000, description="tokenize a read predicted "
                                   "this fast on the event loop, not a thread (0: never)")
    read_ahead_budgets: float = Field(
        4.0, gt=0, description="read at most this many budgets of estimated tokens ahead")
    block_ms: int = Field(
        1000, ge=1, description="XREADGROUP BLOCK time; kept below --socket-timeout-s")
    reply_ttl_s: float = Field(300.0, gt=0, description="reply keys expire this long after a push",
                               json_schema_extra=REDIS_MS)
    cache_bytes: int = Field(0, ge=0, description="the result cache's budget in the queue's Redis "
                             "(0: no cache; identical requests in flight still run once)")
    cache_ttl_s: float = Field(3600.0, gt=0, description="a cached result is answered this long "
                               "after it was computed", json_schema_extra=REDIS_MS)
    cache_across_tenants: bool = Field(False, description="share cached and coalesced answers "
                                       "among the queue's tenants (default: each tenant its own)")
    heartbeat_s: float = Field(
        2.0, gt=0, description="heartbeat interval; a worker silent for 3 beats is presumed dead",
        json_schema_extra=REDIS_MS,  # its liveness key lives int(3 × heartbeat_s × 1000) ms
    )
    claim_idle_s: float = Field(300.0, gt=0, description="entries idle this long are claimed "
                                "whoever holds them", json_schema_extra=REDIS_MS)
    tenant_idle_s: float = Field(600.0, gt=0, description="a tenant's stream empty, and "
                                 "written no more for this long, is removed (made again by its "
                                 "next request)", json_schema_extra=REDIS_MS)
    max_deliveries: int = Field(
        3, ge=1, description="an entry delivered more often goes to the dead stream")
    dead_max_len: int = Field(
        10_000, ge=1, description="the dead stream is trimmed (approximately) to this many")
    dead_max_letter_bytes: int = Field(16 * 1024, ge=1024, description="bytes of the entry's "
                                       "fields a dead letter keeps (cut ones: dead_truncated)")
    read_ahead_bytes: int | None = Field(None, ge=1, description="bytes read and not yet answered "
                                         "(default: 1/32 of the worker's memory, 64 MiB-1 GiB)")
    batch_timeout_s: float = Field(300.0, gt=0, description="a batch on the device this long is "
                                   "hung: the worker exits 3 for its supervisor to restart")
    reply_to_prefixes: str = Field("", description="comma-separated key prefixes reply_to may "
                                   "name besides the queue's reply keys")
    batch_log: Path | None = Field(
        None, description="append one JSON line per batch to this file (rows, tokens, cost)")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_format: Literal["text", "json"] = Field(
        "text", description="text lines, or one JSON object per line (for log shippers)")
    log_json: bool = Field(False, description="the same as --log-format json")
    exit_when_idle_s: float | None = Field(
        None, gt=0, description="exit after the queue has been empty this long (batch jobs)")
    metrics_host: str = Field("127.0.0.1", description="address the metrics endpoint binds to "
                              "(0.0.0.0: every interface)")
    devices: str | None = Field(None, description="one worker process per GPU, e.g. '0,1' "
                                "(CUDA_VISIBLE_DEVICES=N, consumer suffixed -gpuN)")
    processes_per_device: Annotated[int, Field(ge=1, le=MAX_PROCESSES_PER_DEVICE)] | Literal[
        "auto"] = Field(1, description="with --devices: worker processes per GPU, each a model "
                        "copy; auto: 2 for a small model on a GPU, else 1")
    device_share: float = Field(1.0, gt=0.0, le=1.0, description="the share of the device's free "
                                "memory the auto budget plans for (split among its processes)")

    # Checks that span two settings sit on the later one, so the message names it.

    @field_validator("max_batch_tokens", mode="before")
    @classmethod
    def _check_budget(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip() != "auto":
            value = int(value) if value.strip().isdigit() else value
        if value != "auto" and not (type(value) is int and value >= 1):
            raise ValueError(f"max_batch_tokens must be a whole number >= 1 or 'auto', "
                             f"got {value!r}")
        return value

    @field_validator("block_ms")
    @classmethod
    def _check_block(cls, value: int, info: ValidationInfo) -> int:
        timeout = info.data.get("socket_timeout_s")
        if timeout is not None and value / 1000 >= timeout:
            raise ValueError(f"block_ms ({value}) must be shorter than socket_timeout_s "
                             f"({timeout}s), or blocking reads would time out")
        return value

    @field_validator("batch_timeout_s")
    @classmethod
    def _check_batch_timeout(cls, value: float, info: ValidationInfo) -> float:
        beat = info.data.get("heartbeat_s")
        if beat is not None and value <= beat:
            raise ValueError(f"batch_timeout_s ({value}s) must be longer than heartbeat_s "
                             f"({beat}s)")
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
        if value is None:
            return value
        parts = _split_devices(value)
        if not parts:
            raise ValueError(f"devices must be GPU indices or ids like '0,1': {value!r}")
        if len(parts) > MAX_DEVICES:
            raise ValueError(f"devices lists {len(parts)} GPUs; at most {MAX_DEVICES}")
        twice = sorted({part for part in parts if parts.count(part) > 1})
        if twice:
            # Both children would be one consumer, each taking the other's entries as its own.
            raise ValueError(f"devices lists {', '.join(twice)} more than once; for more than "
                             "one worker process on a GPU use --processes-per-device")
        return value

    @field_validator("processes_per_device")
    @classmethod
    def _check_processes(cls, value: int | str, info: ValidationInfo) -> int | str:
        if value != 1 and info.data.get("devices") is None:
            raise ValueError(f"processes_per_device {value} needs --devices (the GPUs to start "
                             "them on); without it, start more tokenq worker processes on the "
                             "queue")
        return value

    @property
    def logs_json(self) -> bool:
        """Whether the worker logs JSON lines (``--log-format json`` or ``--log-json``)."""
        return self.log_format == "json" or self.log_json

    @property
    def reply_to_prefix_list(self) -> tuple[str, ...]:
        """``--reply-to-prefixes`` split on commas, empty parts dropped."""
        return tuple(_parts(self.reply_to_prefixes))

    @property
    def device_list(self) -> list[str]:
        """``--devices`` split on commas (CUDA_VISIBLE_DEVICES accepts indices or UUIDs)."""
        return [] if self.devices is None else _split_devices(self.devices)


def _split_devices(devices: str) -> list[str]:
    parts = [part.strip() for part in devices.split(",")]
    if not all(parts) or any(" " in part for part in parts):
        return []
    return parts

