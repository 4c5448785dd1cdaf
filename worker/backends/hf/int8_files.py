"""The int8 graphs of ``--quantize int8``: quantised by ONNX Runtime, cached beside the
export under a key of recipe, fp32 nodes and onnxruntime version (renamed into place).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tokenq.shared.errors import ConfigError
from tokenq.shared.text import exception_headline

__all__ = [
    "QUANTIZE_FORMAT", "RECIPE", "cache_key", "keep", "quantisable_nodes", "quantize_or_refuse",
    "quantized_model",
]

log = logging.getLogger("tokenq.worker.backends.hf.quantize")

QUANTIZE_FORMAT = 2
"""Bumped whenever what :func:`quantized_model` writes changes, so old int8 files are not reused."""
RECIPE: dict[str, Any] = {
    "op_types_to_quantize": ["MatMul"],
    "per_channel": True,
    "reduce_range": True,
    "weight_type": "QInt8",
}
"""``quantize_dynamic``'s arguments; part of the cache key."""
def quantisable_nodes(fp32: Path) -> list[str]:
    """The nodes the recipe quantises: its op types, with an initializer as the weight."""
    import onnx

    graph = onnx.load(str(fp32), load_external_data=False).graph
    weights = {tensor.name for tensor in graph.initializer}
    kinds = set(RECIPE["op_types_to_quantize"])
    return [
        node.name
        for node in graph.node
        if node.op_type in kinds and len(node.input) > 1 and node.input[1] in weights
    ]


def cache_key(described: dict[str, Any]) -> str:
    import onnxruntime

    described = {
        **described,
        "recipe": RECIPE,
        "format": QUANTIZE_FORMAT,
        "onnxruntime": onnxruntime.__version__,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def _folder(fp32: Path, exclude: Sequence[str]) -> Path:
    return fp32.parent / f"int8-{cache_key({'exclude': sorted(exclude)})}"


def quantized_model(fp32: Path, *, family: str = "", exclude: Sequence[str] = ()) -> Path:
    """The int8 graph of ``fp32`` with ``exclude`` left fp32, quantised now unless cached."""
    done = _folder(fp32, exclude) / fp32.name
    if done.is_file():
        log.info("onnx runtime: reusing the int8 graph %s", done)
        return done
    scratch = Path(tempfile.mkdtemp(prefix=f".{done.parent.name}.", dir=fp32.parent))
    try:
        quantize_or_refuse(fp32, scratch / fp32.name, family, exclude=exclude)
        return keep(scratch / fp32.name, fp32, exclude)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def keep(made: Path, fp32: Path, exclude: Sequence[str]) -> Path:
    """Rename the folder holding ``made`` into the cache; the loser of a race keeps the winner's."""
    folder = _folder(fp32, exclude)
    done = folder / fp32.name
    try:
        os.rename(made.parent, folder)
    except OSError:  # another worker renamed its int8 graph into place first
        if not done.is_file():
            raise
    else:
        log.info("onnx runtime: quantised to int8: %s", done)
    return done


def quantize_or_refuse(
    source: Path,
    target: Path,
    family: str,
    *,
    exclude: Sequence[str] = (),
    only: Sequence[str] | None = None,
) -> None:
    try:
        _quantize(source, target, exclude=exclude, only=only)
    except Exception as exc:  # the quantizer fails in many ways, all meaning the same here
        raise ConfigError(
            f"--quantize int8: ONNX Runtime's quantizer cannot take model {family!r} "
            f"({exception_headline(exc)}); "
            "use --quantize none"
        ) from exc


def _quantize(
    source: Path,
    target: Path,
    *,
    exclude: Sequence[str] = (),
    only: Sequence[str] | None = None,
) -> None:
    """One ``quantize_dynamic`` call: the recipe, less ``exclude``, or only ``only``."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet_quantizer():
        quantize_dynamic(
            str(source),
            str(target),
            op_types_to_quantize=list(RECIPE["op_types_to_quantize"]),
            per_channel=RECIPE["per_channel"],
            reduce_range=RECIPE["reduce_range"],
            weight_type=QuantType[RECIPE["weight_type"]],
            nodes_to_quantize=list(only) if only is not None else None,
            nodes_to_exclude=list(exclude),
            # The fused graph's contrib ops (Attention, SkipLayerNormalization)
            # defeat ONNX shape inference; their outputs are fp32.
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )


class _QuantizerChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING or (
            record.levelno == logging.WARNING and "pre-processing" not in record.getMessage()
        )


@contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """The quantizer logs a line per tensor, and advice on its pre-processing, on the root
    logger; neither is the operator's concern. Its errors still get through."""
    hint = _QuantizerChatter()
    root = logging.getLogger()
    root.addFilter(hint)
    try:
        yield
    finally:
        root.removeFilter(hint)


