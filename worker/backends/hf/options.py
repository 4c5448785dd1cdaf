"""Every setting the Hugging Face backend reads, and the device and dtype they come to.

:class:`HFOptions` is built from ``WorkerSettings`` (or any object with the
same attribute names) by :meth:`HFOptions.from_settings`; a setting the
object does not have takes the default here, and any bad value becomes one
:class:`~tokenq.shared.errors.ConfigError` that names it.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tokenq.shared.errors import ConfigError

log = logging.getLogger(__name__)

HFTask = Literal["embed", "classify", "rerank"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
}
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class HFOptions(BaseModel):
    """The worker settings the HF backend reads, validated in one place.

    Built from :class:`~tokenq.shared.settings.WorkerSettings` by
    :meth:`from_settings`; a setting WorkerSettings does not (yet) have takes
    the default below.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = Field(
        None, description="model directory or Hugging Face id; None: bundled all-MiniLM-L6-v2"
    )
    task: HFTask = Field("embed", description="embed, classify or rerank (cross-encoder)")
    pooling: Literal["auto", "mean", "cls", "last"] = Field(
        "auto", description="embed: pooling; auto reads 1_Pooling/config.json, else mean"
    )
    normalize: Literal["auto", "true", "false"] = Field(
        "auto", description="embed: L2-normalise; auto: when modules.json has a Normalize module"
    )
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="weights and activations; auto: fp16 on CUDA, fp32 on CPU"
    )
    device: str = Field("auto", description="auto (CUDA when present), cpu, cuda or cuda:N")
    max_input_tokens: int | None = Field(
        None, ge=1, description="cap below the model's own max input length"
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
        if not _DEVICE.match(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N: {value!r}")
        return value

    @classmethod
    def from_settings(cls, settings: Any) -> HFOptions:
        """Pick this backend's fields off a settings object; a bad value is a ConfigError."""
        values = {
            name: getattr(settings, name)
            for name in cls.model_fields
            if getattr(settings, name, None) is not None
        }
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ConfigError(f"hf backend settings: {exc}") from exc


def resolve_device(requested: str) -> torch.device:
    """A concrete device (``cuda`` becomes ``cuda:<current>``), or a ConfigError saying why not."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {requested!r}: CUDA is not available to torch {torch.__version__}"
        )
    index = int(requested.split(":")[1]) if ":" in requested else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {requested!r}: only {torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", index)


def resolve_dtype(requested: str, device: torch.device, *, explicit_device: bool) -> torch.dtype:
    """fp16 on CPU: refused when the CPU was asked for, fp32 with a warning when it was a fallback.

    A config written for GPU machines (dtype fp16, device auto) should still
    start on a developer's CPU-only box; someone who asks for fp16 *and* cpu
    gets an error, since CPU fp16 kernels are slow and partly missing.
    """
    if requested == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if requested == "fp16" and device.type == "cpu":
        if explicit_device:
            raise ConfigError("dtype fp16 is not supported on device cpu: use fp32 or bf16")
        warnings.warn(
            "no CUDA device: running in fp32 instead of fp16", RuntimeWarning, stacklevel=3
        )
        log.warning("no CUDA device: running in fp32 instead of fp16")
        return torch.float32
    if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"dtype bf16 is not supported on {device}: use fp16 or fp32")
    return _DTYPES[requested]
