"""The transformer run by ONNX Runtime on the CPU (``--runtime onnx``).

:func:`load_onnx_encoder` exports once (:mod:`~tokenq.worker.backends.hf.export`),
opens a session and, on every start, checks a probe batch against torch, so a
wrong or stale export is refused at start. The session: ``ORT_ENABLE_ALL``,
``intra_op_num_threads`` as torch's, one inter-op thread, numpy inputs (no I/O
binding; docs/decisions/0040-onnx-runtime.md). fp32 activations only;
``--quantize int8`` goes through :mod:`~tokenq.worker.backends.hf.quantize`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenq.shared.errors import ConfigError
from tokenq.shared.text import exception_headline
from tokenq.worker.backends.hf.export import INPUTS, cache_key, default_cache_dir, export
from tokenq.worker.backends.hf.quantize import GateReport, Int8Request, int8_encoder

__all__ = ["OnnxEncoder", "import_onnxruntime", "load_onnx_encoder", "onnx_available"]

log = logging.getLogger(__name__)

PROBE_TOLERANCE = 1e-4
"""Largest difference (relative to the row's largest value, at least 1) the probe accepts."""


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


def onnx_available() -> bool:
    """Whether ``--runtime auto`` may choose onnx: the extra is installed."""
    try:
        import_onnxruntime()
    except ConfigError:
        return False
    return True


class OnnxEncoder:
    """The exported transformer: (ids, mask, type ids) in, hidden states or logits out."""

    def __init__(self, session: Any, path: Path) -> None:
        self.session = session
        self.path = path
        self._inputs = tuple(item.name for item in session.get_inputs())

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, type_ids: torch.Tensor
    ) -> torch.Tensor:
        given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": type_ids}
        feed = {name: given[name].numpy() for name in self._inputs}
        (output,) = self.session.run(None, feed)
        return torch.from_numpy(output)


def load_onnx_encoder(
    model: torch.nn.Module,
    model_dir: Path,
    *,
    family: str,
    task: str,
    uses_type_ids: bool,
    cache_dir: str | None,
    vocab_size: int,
    trust_remote_code: bool,
    int8: Int8Request | None = None,
) -> tuple[OnnxEncoder, GateReport | None]:
    """Export (or reuse) ``model``, open a session, check it against torch on a probe batch;
    with ``int8``, the gated int8 encoder and its report.
    """
    ort = import_onnxruntime()
    inputs = INPUTS if uses_type_ids else INPUTS[:2]
    logits = task != "embed"
    key = cache_key(
        model_dir,
        {
            "task": task,
            "inputs": inputs,
            "class": type(model).__name__,
            "dtype": str(next(model.parameters()).dtype),
            "trust_remote_code": trust_remote_code,
        },
    )
    folder = default_cache_dir(cache_dir) / key
    try:
        path = export(model, folder, inputs, logits=logits)
    except Exception as exc:  # the exporter fails in many ways, all meaning the same here
        raise ConfigError(
            f"--runtime onnx: torch's ONNX exporter cannot take model family {family!r} "
            f"({exception_headline(exc)}); "
            "use --runtime torch"
        ) from exc
    encoder = OnnxEncoder(_session(ort, path), path)
    _check_against_torch(
        encoder, model, inputs, family=family, vocab_size=vocab_size, logits=logits
    )
    if int8 is None:
        return encoder, None
    return int8_encoder(encoder, path, lambda p: OnnxEncoder(_session(ort, p), p), int8)


def _session(ort: Any, path: Path) -> Any:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # warnings about unused initialisers are not the operator's
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _check_against_torch(
    encoder: OnnxEncoder,
    model: torch.nn.Module,
    inputs: tuple[str, ...],
    *,
    family: str,
    vocab_size: int,
    logits: bool,
) -> None:
    """Refuse an export whose answers on a padded probe batch differ from torch's (its shape
    differs from the trace's, so a frozen dimension fails too).
    """
    lengths = (11, 6, 2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, max(vocab_size, 1), (len(lengths), max(lengths)), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    type_ids = torch.zeros_like(ids)
    given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": type_ids}
    with torch.inference_mode():
        output = model(**{name: given[name] for name in inputs})
        expected = (output.logits if logits else output[0]).float().numpy()
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
