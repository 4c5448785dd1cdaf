"""The worker's own settings, whatever its backend (``tokenq.worker.settings`` adds the
backends'): batching, reading, delivery, logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from tokenq.shared.settings import (
    REDIS_MS,
    Retries,
    SocketTimeout,
    _QueueLimit,
    _Requests,
    _WorkerProcess,
)

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
    max_batch_tokens: int | Literal["auto"] = Field(16384, description="token budget of one "
                                                    "batch; 'auto': fit to free CUDA memory")
    max_batch_size: int = Field(256, ge=1, description="most rows in one batch")
    linger_ms: float = Field(
        2.0, ge=0, description="how long an idle device waits to fill an unsealed batch")
    max_padding_ratio: float = Field(1.0, ge=0, description="most padding a request may add, "
                                     "times its length (inf: any)", json_schema_extra={"inf": True})
    aging_ms: float = Field(1000.0, gt=0, description="each priority class stands this much "
                            "earlier in line; a head this old is never passed over")
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
    heartbeat_s: float = Field(
        2.0, gt=0, description="heartbeat interval; a worker silent for 3 beats is presumed dead",
        json_schema_extra=REDIS_MS,  # its liveness key lives int(3 × heartbeat_s × 1000) ms
    )
    claim_idle_s: float = Field(300.0, gt=0, description="entries idle this long are claimed "
                                "whoever holds them", json_schema_extra=REDIS_MS)
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
    processes_per_device: int = Field(1, ge=1, le=MAX_PROCESSES_PER_DEVICE, description="with "
                                      "--devices: worker processes per GPU, each a model copy")
    device_share: float = Field(1.0, gt=0.0, le=1.0, description="the share of the device's free "
                                "memory the auto budget plans for (split among its processes)")

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
            raise ValueError(
                f"devices lists {', '.join(twice)} more than once; for more than one worker "
                "process on a GPU use --processes-per-device"
            )
        return value

    @field_validator("processes_per_device")
    @classmethod
    def _check_processes(cls, value: int, info: ValidationInfo) -> int:
        if value > 1 and info.data.get("devices") is None:
            raise ValueError(
                "processes_per_device needs --devices (the GPUs to start them on); without "
                "it, start more tokenq worker processes on the queue"
            )
        return value

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

