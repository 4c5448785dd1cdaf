"""The Hugging Face backend's settings, the frozen :class:`HFOptions` it is built from, and its
registration; importing this needs no torch."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator

from tokenq.shared.errors import ConfigError
from tokenq.shared.settings import BackendSettings, Task, describe_errors
from tokenq.worker.backends.registry import BackendEntry

_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
    "mixed-bf16": "bf16-mixed", "bf16_mixed": "bf16-mixed", "amp-bf16": "bf16-mixed",
}


class HFSettings(BackendSettings):
    """The Hugging Face transformers backend's options (``--backend hf``)."""

    heading: ClassVar[str] = "--backend hf (Hugging Face transformers)"

    model: str | None = Field(
        None, description="model directory or Hub id; default: the bundled all-MiniLM-L6-v2"
    )
    task: Task = Field(
        "embed", description="embed, classify, rerank (cross-encoder) or sparse (SPLADE)"
    )
    pooling: Literal[
        "auto", "mean", "cls", "last", "lasttoken", "max", "mean_sqrt_len_tokens", "weightedmean"
    ] = Field("auto", description="--task embed: pooling; auto: the model's, else mean")
    normalize: Literal["auto", "true", "false"] = Field(
        "auto", description="--task embed: L2-normalise; auto: when modules.json has Normalize"
    )
    dtype: Literal["auto", "fp32", "fp16", "bf16", "bf16-mixed"] = Field(
        "auto", description="auto: fp16 on CUDA, fp32 on CPU; bf16-mixed: bf16 matrix products"
    )
    device: str = Field("auto", description="auto (CUDA when present), cpu, cuda or cuda:N")
    runtime: Literal["torch", "onnx", "auto"] = Field(
        "torch", description="torch, onnx (CPU, fp32; pip install 'tokenq[onnx]') or auto"
    )
    onnx_cache_dir: str | None = Field(
        None, description="--runtime onnx: export cache; default $XDG_CACHE_HOME/tokenq/onnx"
    )
    quantize: Literal["none", "int8"] = Field(
        "none", description="--runtime onnx: int8 weights, refused unless they pass the gate"
    )
    quantize_min_cosine: float = Field(
        0.99, gt=0, le=1, description="--quantize int8: the gate, lowest cosine to fp32 accepted"
    )
    max_input_tokens: int | None = Field(
        None, ge=1, description="cap below the model's own max input length"
    )
    trust_remote_code: bool = Field(
        False, description="run Python code the model ships (auto_map); off: it is refused"
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


BACKEND = BackendEntry(
    name="hf", settings=HFSettings, build="tokenq.worker.backends.hf.backend:build_hf_backend"
)
