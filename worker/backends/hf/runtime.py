"""Which runtime runs the transformer (``--runtime``: torch, or ONNX Runtime on the CPU in
fp32, checked against torch on every start: docs/decisions/0040-onnx-runtime.md), and the
:data:`Encoder` each gives."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from tokenq.shared.errors import ConfigError
from tokenq.shared.text import exception_headline
from tokenq.worker.backends.hf.export import (
    INPUTS,
    Exportable,
    cache_key,
    default_cache_dir,
    export,
)
from tokenq.worker.backends.hf.load import ModelSource, find_file, join, pad_token_id
from tokenq.worker.backends.hf.options import HFOptions
from tokenq.worker.backends.hf.quantize import (
    CALIBRATION_MAX_TOKENS,
    Encoder,
    Finish,
    Int8Request,
    int8_encoder,
)

log = logging.getLogger(__name__)

Runtime = Literal["torch", "onnx"]

PROBE_TOLERANCE = 1e-4  # largest ONNX-vs-torch difference, relative to max(1, largest value)


class TorchEncoder:
    """The transformer in eager torch, as loaded."""

    def __init__(
        self, model: torch.nn.Module, *, uses_type_ids: bool, logits: bool,
        autocast: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self._uses_type_ids = uses_type_ids
        self._logits = logits
        parameter = next(model.parameters(), None)  # none: the CPU
        device = torch.device("cpu") if parameter is None else parameter.device
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
        # Under autocast a model's last op may hand back bf16; the head after it is fp32.
        return result if self._autocast is None else result.float()


def attention_kernels(device: torch.device) -> Callable[[], AbstractContextManager[Any]]:
    """What a forward runs under: on CUDA, every fused attention kernel but cuDNN's, which
    plans per new batch shape (docs/decisions/0044-cudnn-fused-attention-left-out.md)."""
    if device.type != "cuda":
        return contextlib.nullcontext
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3: no cuDNN attention to avoid
        return contextlib.nullcontext
    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return functools.partial(sdpa_kernel, kernels)


class OnnxEncoder:
    """The exported transformer: (ids, mask, type ids) in, hidden states or logits out."""

    def __init__(self, session: Any, path: Path) -> None:
        self.session, self.path = session, path
        self._inputs = tuple(item.name for item in session.get_inputs())

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, type_ids: torch.Tensor
    ) -> torch.Tensor:
        given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": type_ids}
        feed = {name: given[name].numpy() for name in self._inputs}
        (output,) = self.session.run(None, feed)
        return torch.from_numpy(output)


def import_onnxruntime() -> Any:
    """The ``onnxruntime`` module, or a ConfigError naming the extra that provides it."""
    try:
        import onnx  # noqa: F401  (torch's exporter imports it; checked here to fail early)
        import onnxruntime
    except ImportError as exc:
        raise ConfigError(
            f"--runtime onnx needs onnxruntime and onnx ({exc.msg}): "
            "pip install 'tokenq[onnx]', or use --runtime torch"
        ) from exc
    return onnxruntime


def resolve_runtime(requested: str, device: torch.device, dtype: torch.dtype) -> Runtime:
    """``--runtime`` made concrete for this device and dtype, or a ConfigError saying why not."""
    if requested == "torch":
        return "torch"
    fits = device.type == "cpu" and dtype == torch.float32
    if requested == "auto":
        try:
            return "onnx" if fits and import_onnxruntime() else "torch"
        except ConfigError:  # the extra is not installed
            return "torch"
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
    runtime: Runtime, model: torch.nn.Module, tokenizer: Any, source: ModelSource, subfolder: str,
    options: HFOptions, *, finish: Finish | None = None, max_input: int = CALIBRATION_MAX_TOKENS,
    autocast: torch.dtype | None = None,
) -> tuple[Encoder, dict[str, Any]]:
    """The encoder ``runtime`` names for a model loaded in torch, and its facts for the info.

    onnx: exported (or reused), checked against torch on a probe batch, and with
    ``--quantize int8`` the gated int8 twin (``finish``: the head the gate compares through).
    """
    uses_type_ids = "token_type_ids" in tokenizer.model_input_names
    logits = options.task != "embed"
    if runtime == "torch":
        encoder = TorchEncoder(model, uses_type_ids=uses_type_ids, logits=logits, autocast=autocast)
        return encoder, {}
    ort = import_onnxruntime()
    config_path = find_file(source, join(subfolder, "config.json"))
    assert config_path is not None  # transformers loaded the model from it
    family = str(getattr(model.config, "model_type", type(model).__name__))
    inputs = INPUTS if uses_type_ids else INPUTS[:2]
    key = cache_key(Path(config_path).parent, {
        "task": options.task, "inputs": inputs, "class": type(model).__name__,
        "dtype": str(next(model.parameters()).dtype),
        "trust_remote_code": options.trust_remote_code,
    })
    try:
        path = export(model, default_cache_dir(options.onnx_cache_dir) / key, inputs, logits=logits)
    except Exception as exc:  # the exporter fails in many ways, all meaning the same here
        raise ConfigError(
            f"--runtime onnx: torch's ONNX exporter cannot take model family {family!r} "
            f"({exception_headline(exc)}); use --runtime torch"
        ) from exc
    onnx = OnnxEncoder(_session(ort, path), path)
    _check_against_torch(onnx, model, inputs, family=family, vocab_size=len(tokenizer),
                         logits=logits)
    if options.quantize != "int8":
        return onnx, {}
    assert logits or finish is not None, "an embedding model's gate compares through its head"
    request = Int8Request(
        model=source.name, min_cosine=options.quantize_min_cosine, tokenizer=tokenizer,
        pad_id=pad_token_id(tokenizer), pairs=options.task == "rerank",
        max_tokens=min(CALIBRATION_MAX_TOKENS, max_input), finish=finish,
    )
    int8, report = int8_encoder(onnx, path, lambda p: OnnxEncoder(_session(ort, p), p), request)
    return int8, report.describe()


def _session(ort: Any, path: Path) -> Any:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # warnings about unused initialisers are not the operator's
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _check_against_torch(
    encoder: OnnxEncoder, model: torch.nn.Module, inputs: tuple[str, ...], *, family: str,
    vocab_size: int, logits: bool,
) -> None:
    """Refuse an export whose answers on a padded probe batch differ from torch's (its shape
    differs from the trace's, so a frozen dimension fails too)."""
    lengths = (11, 6, 2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, max(vocab_size, 1), (len(lengths), max(lengths)), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    type_ids = torch.zeros_like(ids)
    given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": type_ids}
    with torch.inference_mode():
        expected = Exportable(model, inputs, logits)(*(given[n] for n in inputs)).float().numpy()
    got = encoder(ids, mask, type_ids).numpy()
    real = slice(None) if logits else mask.numpy().astype(bool)
    want, have = expected[real], got[real]
    scale = max(1.0, float(np.abs(want).max()))
    if want.shape != have.shape or not np.all(np.abs(want - have) <= PROBE_TOLERANCE * scale):
        worst = float(np.abs(want - have).max()) if want.shape == have.shape else float("nan")
        raise ConfigError(
            f"--runtime onnx: the ONNX export of model family {family!r} does not compute "
            f"what torch does (largest difference {worst:.3g} on a probe batch); "
            "use --runtime torch"
        )
    log.info("onnx runtime: %s checked against torch on a probe batch", encoder.path)
