"""Which runtime runs the transformer (``--runtime``), and the one call both answer.

An :data:`Encoder` takes the padded batch and returns hidden states or logits;
everything after it is the same torch code. ``torch`` (default): any device and
dtype, the only one for ``bf16-mixed``. ``onnx``: CPU, fp32, needs the ``onnx``
extra; refused on CUDA (docs/decisions/0040-onnx-runtime.md). ``auto``: onnx
where it can run, else torch. ``--quantize int8`` needs onnx and is refused by
name otherwise. torch is the default because onnx's first start exports to disk.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

import torch

from tokenq.shared.errors import ConfigError
from tokenq.worker.backends.hf.load import ModelSource, find_file, join
from tokenq.worker.backends.hf.options import HFOptions
from tokenq.worker.backends.hf.pretrained import pad_token_id
from tokenq.worker.backends.hf.quantize import CALIBRATION_MAX_TOKENS, Finish, Int8Request

__all__ = [
    "Encoder",
    "Runtime",
    "TorchEncoder",
    "attention_kernels",
    "build_encoder",
    "check_quantize",
    "resolve_runtime",
]

Runtime = Literal["torch", "onnx"]
Encoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(ids, attention mask, type ids) -> hidden states (embed) or logits (classify, rerank)."""


class TorchEncoder:
    """The transformer in eager torch, as loaded."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        uses_type_ids: bool,
        logits: bool,
        autocast: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self._uses_type_ids = uses_type_ids
        self._logits = logits
        device = _device_of(model)
        self._attention = attention_kernels(device)
        self._autocast = autocast
        self._precision: Callable[[], AbstractContextManager[Any]] = (
            contextlib.nullcontext
            if autocast is None
            else functools.partial(torch.autocast, device.type, dtype=autocast)
        )

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, type_ids: torch.Tensor
    ) -> torch.Tensor:
        kwargs = {"input_ids": ids, "attention_mask": mask}
        if self._uses_type_ids:
            kwargs["token_type_ids"] = type_ids
        with self._attention(), self._precision():
            output = self.model(**kwargs)
        result = output.logits if self._logits else output[0]
        # Under autocast a model's last op may hand back bf16 (a decoder's
        # norm, a classifier's Linear); the head and Dense after it are fp32.
        return result if self._autocast is None else result.float()


def attention_kernels(device: torch.device) -> Callable[[], AbstractContextManager[Any]]:
    """What a forward runs under: on CUDA, every fused attention kernel but cuDNN's.

    cuDNN plans per new (rows, length) shape, and token-budget batches are nearly
    all new shapes (docs/decisions/0044-cudnn-fused-attention-left-out.md;
    docs/BENCHMARKS.md, "gpu"). CPU, or no ``torch.nn.attention``: nothing changes.
    """
    if device.type != "cuda":
        return contextlib.nullcontext
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3: no cuDNN attention to avoid
        return contextlib.nullcontext
    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return functools.partial(sdpa_kernel, kernels)


def _device_of(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are (the CPU for a model without any)."""
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def resolve_runtime(requested: str, device: torch.device, dtype: torch.dtype) -> Runtime:
    """``--runtime`` made concrete for this device and dtype, or a ConfigError saying why not."""
    if requested == "torch":
        return "torch"
    fits = device.type == "cpu" and dtype == torch.float32
    if requested == "auto":
        from tokenq.worker.backends.hf.onnx_runtime import onnx_available

        return "onnx" if fits and onnx_available() else "torch"
    if device.type != "cpu":
        raise ConfigError(
            f"--runtime onnx runs on the CPU only, not {device}: ONNX Runtime's CUDA provider "
            "is not offered until it is measured faster than torch fp16; use --runtime torch"
        )
    if dtype != torch.float32:
        raise ConfigError(
            f"--runtime onnx runs in fp32 only, not {str(dtype).removeprefix('torch.')}: "
            "use --dtype fp32 or --runtime torch"
        )
    from tokenq.worker.backends.hf.onnx_runtime import import_onnxruntime

    import_onnxruntime()
    return "onnx"


def check_quantize(options: HFOptions, runtime: Runtime) -> None:
    """Refuse ``--quantize`` on the torch runtime, saying which setting made it torch."""
    if options.quantize == "none" or runtime == "onnx":
        return
    why = (
        "--task sparse runs on torch only" if options.task == "sparse"
        else "--runtime auto chose torch for this device and dtype" if options.runtime == "auto"
        else "--runtime torch"
    )
    raise ConfigError(
        f"--quantize {options.quantize} quantises the ONNX graph and needs --runtime onnx "
        f"({why}): use --runtime onnx or --quantize none"
    )


def build_encoder(
    runtime: Runtime,
    model: torch.nn.Module,
    tokenizer: Any,
    source: ModelSource,
    subfolder: str,
    options: HFOptions,
    *,
    finish: Finish | None = None,
    max_input: int = CALIBRATION_MAX_TOKENS,
    autocast: torch.dtype | None = None,
) -> tuple[Encoder, dict[str, Any]]:
    """The encoder ``runtime`` names, for a model already loaded in torch, and its facts.

    ``finish`` is the embedding head the ``--quantize`` gate compares through;
    ``autocast`` is from ``resolve_autocast``, run before the load.
    """
    check_quantize(options, runtime)
    uses_type_ids = "token_type_ids" in tokenizer.model_input_names
    logits = options.task != "embed"
    if runtime == "torch":
        encoder = TorchEncoder(model, uses_type_ids=uses_type_ids, logits=logits, autocast=autocast)
        return encoder, {}
    from tokenq.worker.backends.hf.onnx_runtime import load_onnx_encoder

    config_path = find_file(source, join(subfolder, "config.json"))
    assert config_path is not None  # transformers loaded the model from it
    int8 = None
    if options.quantize == "int8":
        assert logits or finish is not None, "an embedding model's gate compares through its head"
        int8 = Int8Request(
            model=source.name,
            min_cosine=options.quantize_min_cosine,
            tokenizer=tokenizer,
            pad_id=pad_token_id(tokenizer),
            pairs=options.task == "rerank",
            max_tokens=min(CALIBRATION_MAX_TOKENS, max_input),
            finish=finish,
        )
    encoder, report = load_onnx_encoder(
        model,
        Path(config_path).parent,
        family=str(getattr(model.config, "model_type", type(model).__name__)),
        task=options.task,
        uses_type_ids=uses_type_ids,
        cache_dir=options.onnx_cache_dir,
        vocab_size=len(tokenizer),
        trust_remote_code=options.trust_remote_code,
        int8=int8,
    )
    return encoder, ({} if report is None else report.describe())
