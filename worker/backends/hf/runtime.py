"""Where and how the transformer runs: device, dtype and runtime (torch, or ONNX Runtime on the
CPU in fp32, checked against torch at start: docs/decisions/0040-onnx-runtime.md)."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from tokenq.shared.errors import ConfigError
from tokenq.shared.text import exception_headline
from tokenq.worker.backends.hf import export, quantize
from tokenq.worker.backends.hf.load import ModelSource, find_file, join, pad_token_id
from tokenq.worker.backends.hf.quantize import Encoder, Finish
from tokenq.worker.backends.hf.settings import HFOptions

log = logging.getLogger(__name__)

Runtime = Literal["torch", "onnx"]

PROBE_TOLERANCE = 1e-4  # largest ONNX-vs-torch difference, relative to max(1, largest value)

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), by torch's probes."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


class TorchEncoder(export.Exportable):
    """The transformer in eager torch, under :func:`attention_kernels` and ``autocast``."""

    def __init__(
        self, model: torch.nn.Module, *, uses_type_ids: bool, logits: bool,
        autocast: torch.dtype | None = None,
    ) -> None:
        super().__init__(model, export.INPUTS if uses_type_ids else export.INPUTS[:2], logits)
        parameter = next(model.parameters(), None)  # none: the CPU
        device = torch.device("cpu") if parameter is None else parameter.device
        self._attention = attention_kernels(device)
        self._autocast = autocast
        self._precision: Callable[[], AbstractContextManager[Any]] = (
            contextlib.nullcontext
            if autocast is None
            else functools.partial(torch.autocast, device.type, dtype=autocast)
        )

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        """(ids, mask, type ids); the type ids dropped where the model takes none."""
        with self._attention(), self._precision():
            result = super().forward(*tensors[: len(self.inputs)])
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


def resolve_runtime(options: HFOptions, device: torch.device, dtype: torch.dtype) -> Runtime:
    """``--runtime`` made concrete for this task, device and dtype; ``--quantize`` refused on
    torch, saying which setting made it torch."""
    runtime: Runtime = "torch"
    if options.task == "sparse" and options.runtime == "onnx":
        raise ConfigError(
            "--task sparse runs on --runtime torch only (the ONNX export does not take a "
            "masked-LM head)"
        )
    if options.task != "sparse" and options.runtime == "auto":
        with contextlib.suppress(ConfigError):  # the extra is not installed
            if device.type == "cpu" and dtype == torch.float32 and import_onnxruntime():
                runtime = "onnx"
    elif options.runtime == "onnx":
        if device.type != "cpu":
            raise ConfigError(
                f"--runtime onnx runs on the CPU only, not {device}: ONNX Runtime's CUDA "
                "provider is not offered until it is measured faster than torch fp16; use "
                "--runtime torch"
            )
        if dtype != torch.float32:
            raise ConfigError(
                f"--runtime onnx runs in fp32 only, not {str(dtype).removeprefix('torch.')}: "
                "use --dtype fp32 or --runtime torch"
            )
        import_onnxruntime()
        runtime = "onnx"
    if options.quantize != "none" and runtime == "torch":
        why = (
            "--task sparse runs on torch only" if options.task == "sparse"
            else "--runtime auto chose torch for this device and dtype" if options.runtime == "auto"
            else "--runtime torch"
        )
        raise ConfigError(
            f"--quantize {options.quantize} quantises the ONNX graph and needs --runtime onnx "
            f"({why}): use --runtime onnx or --quantize none"
        )
    return runtime


def build_encoder(
    runtime: Runtime, model: torch.nn.Module, tokenizer: Any, source: ModelSource, subfolder: str,
    options: HFOptions, *, finish: Finish | None, max_input: int, autocast: torch.dtype | None,
) -> tuple[Encoder, dict[str, Any]]:
    """The encoder ``runtime`` names, and its facts for the info; onnx: exported (or reused),
    checked against torch, with ``--quantize int8`` the gated int8 twin (``finish``: the head
    the gate compares through)."""
    uses_type_ids = "token_type_ids" in tokenizer.model_input_names
    logits = options.task != "embed"
    encoder = TorchEncoder(model, uses_type_ids=uses_type_ids, logits=logits, autocast=autocast)
    if runtime == "torch":
        return encoder, {}
    ort = import_onnxruntime()
    config_path = find_file(source, join(subfolder, "config.json"))
    assert config_path is not None  # transformers loaded the model from it
    family = str(getattr(model.config, "model_type", type(model).__name__))
    inputs = encoder.inputs
    key = export.cache_key(Path(config_path).parent, {
        "task": options.task, "inputs": inputs, "class": type(model).__name__,
        "dtype": str(next(model.parameters()).dtype),
        "trust_remote_code": options.trust_remote_code,
    })
    try:
        folder = export.default_cache_dir(options.onnx_cache_dir) / key
        path = export.export(model, folder, inputs, logits=logits)
    except Exception as exc:  # the exporter fails in many ways, all meaning the same here
        raise ConfigError(
            f"--runtime onnx: torch's ONNX exporter cannot take model family {family!r} "
            f"({exception_headline(exc)}); use --runtime torch"
        ) from exc
    onnx = OnnxEncoder(_session(ort, path), path)
    _check_against_torch(onnx, encoder, family=family, vocab_size=len(tokenizer))
    if options.quantize != "int8":
        return onnx, {}
    assert logits or finish is not None, "an embedding model's gate compares through its head"
    request = quantize.Int8Request(
        model=source.name, min_cosine=options.quantize_min_cosine, tokenizer=tokenizer,
        pad_id=pad_token_id(tokenizer), pairs=options.task == "rerank",
        max_tokens=min(quantize.CALIBRATION_MAX_TOKENS, max_input), finish=finish,
    )
    int8, report = quantize.int8_encoder(
        onnx, path, lambda p: OnnxEncoder(_session(ort, p), p), request)
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
    onnx: OnnxEncoder, torch_encoder: TorchEncoder, *, family: str, vocab_size: int
) -> None:
    """Refuse an export whose answers on a padded probe batch (shaped unlike the trace's)
    differ from torch's."""
    lengths = (11, 6, 2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, max(vocab_size, 1), (len(lengths), max(lengths)), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    type_ids = torch.zeros_like(ids)
    with torch.inference_mode():
        expected = torch_encoder(ids, mask, type_ids).float().numpy()
    got = onnx(ids, mask, type_ids).numpy()
    real = slice(None) if torch_encoder.logits else mask.numpy().astype(bool)
    want, have = expected[real], got[real]
    scale = max(1.0, float(np.abs(want).max()))
    if want.shape != have.shape or not np.all(np.abs(want - have) <= PROBE_TOLERANCE * scale):
        worst = float(np.abs(want - have).max()) if want.shape == have.shape else float("nan")
        raise ConfigError(
            f"--runtime onnx: the ONNX export of model family {family!r} does not compute "
            f"what torch does (largest difference {worst:.3g} on a probe batch); "
            "use --runtime torch"
        )
    log.info("onnx runtime: %s checked against torch on a probe batch", onnx.path)
