"""The Hugging Face backend's options (:class:`HFOptions`, frozen), and the device and dtype
they come to; a bad value is one named ConfigError.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from pydantic import ConfigDict, ValidationError

from tokenq.shared.errors import ConfigError
from tokenq.shared.settings import describe_errors
from tokenq.worker.backends.hf.settings import HFSettings

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class HFOptions(HFSettings):
    """The worker settings the HF backend reads, validated where WorkerSettings validates them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def from_settings(cls, settings: Any) -> HFOptions:
        """This backend's fields of any settings object (missing ones default)."""
        values = {
            name: getattr(settings, name)
            for name in cls.model_fields
            if getattr(settings, name, None) is not None
        }
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = "; ".join(describe_errors(exc, cls))
            raise ConfigError(f"hf backend settings: {problems}") from exc


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
    """The weights' dtype; fp16 on CPU is refused when the CPU was asked for, else fp32 with a
    warning (a GPU config should still start on a CPU box)."""
    if requested == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if requested == "bf16-mixed":  # the weights stay fp32: resolve_autocast says the rest
        return torch.float32
    if requested == "fp16" and device.type == "cpu":
        if explicit_device:
            raise ConfigError("dtype fp16 is not supported on device cpu: use fp32 or bf16")
        warnings.warn("no CUDA device: running in fp32 instead of fp16", RuntimeWarning,
                      stacklevel=3)
        log.warning("no CUDA device: running in fp32 instead of fp16")
        return torch.float32
    if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"dtype bf16 is not supported on {device}: use fp16 or fp32")
    return _DTYPES[requested]


def resolve_autocast(requested: str, device: torch.device) -> torch.dtype | None:
    """The dtype the matrix products run in under ``--dtype bf16-mixed`` (else None); refused
    on a CPU without bf16 instructions (docs/decisions/0041-bf16-mixed.md)."""
    if requested != "bf16-mixed":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_bf16_supported():
            raise ConfigError(f"dtype bf16-mixed is not supported on {device}: use fp16 or fp32")
        return torch.bfloat16
    if not cpu_has_bf16_matmul():
        raise ConfigError(
            "dtype bf16-mixed needs a CPU with bf16 instructions (AVX512-BF16 or AMX), "
            "which this one lacks: torch would emulate bf16, slower than fp32; use fp32"
        )
    return torch.bfloat16


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), as torch's private
    probes report it (no when they are absent)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)
