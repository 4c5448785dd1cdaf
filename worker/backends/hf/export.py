"""Exporting a loaded transformer (hidden states or logits) to ONNX once, cached under a hash
of the model's files and options, renamed into place: workers see a whole export or none."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

EXPORT_FORMAT = 2  # bumped whenever what export writes changes: old entries are not reused
OPSET = 17  # LayerNormalization is native from 17 on
MODEL_FILE = "model.onnx"
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "output"
FUSED_FAMILIES = frozenset({"bert"})  # ONNX Runtime's optimizer fuses these (parity-tested)


def default_cache_dir(override: str | None) -> Path:
    """``--onnx-cache-dir``, else ``$XDG_CACHE_HOME/tokenq/onnx``, else ``~/.cache/tokenq/onnx``."""
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenq" / "onnx"


def cache_key(model_dir: Path, facts: Mapping[str, Any]) -> str:
    """A hex digest of every file directly in ``model_dir`` and of ``facts`` (the options)."""
    import transformers

    digest = hashlib.sha256()
    described = {**facts, "format": EXPORT_FORMAT, "opset": OPSET, "torch": torch.__version__,
                 "transformers": transformers.__version__}
    digest.update(json.dumps(described, sort_keys=True, default=str).encode())
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + _file_identity(path).encode() + b"\0")
    return digest.hexdigest()[:32]


def _file_identity(path: Path) -> str:
    """The blob name of a Hugging Face cache link (its content hash), else the content's sha256."""
    if path.is_symlink():
        target = Path(os.readlink(path))
        if target.parent.name == "blobs" and len(target.name) >= 40:
            return target.name
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


class Exportable(torch.nn.Module):
    """The transformer with the positional inputs the graph takes and the one output it gives."""

    def __init__(self, model: torch.nn.Module, inputs: Iterable[str], logits: bool) -> None:
        super().__init__()
        self.model = model
        self.inputs = tuple(inputs)
        self.logits = logits

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        output = self.model(**dict(zip(self.inputs, tensors, strict=True)))
        return output.logits if self.logits else output[0]


def export(model: torch.nn.Module, folder: Path, inputs: tuple[str, ...], *, logits: bool) -> Path:
    """``folder/model.onnx``, exported now unless a whole export is already there."""
    if (folder / MODEL_FILE).is_file():
        return folder / MODEL_FILE
    folder.parent.mkdir(parents=True, exist_ok=True)
    with scratch_beside(folder) as scratch:
        _write(model, scratch / MODEL_FILE, inputs, logits=logits)
        _fuse(scratch / MODEL_FILE, getattr(model, "config", None))
        log.info("exported the model to ONNX: %s", folder)
        return rename_into_place(scratch, folder, MODEL_FILE)


@contextmanager
def scratch_beside(folder: Path) -> Iterator[Path]:
    """A private folder beside ``folder`` to write into, removed afterwards."""
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def rename_into_place(made: Path, folder: Path, name: str) -> Path:
    """``folder/name`` once ``made`` is renamed to ``folder``; the loser of a race between
    workers keeps the winner's."""
    try:
        os.rename(made, folder)
    except OSError:
        if not (folder / name).is_file():
            raise
    return folder / name


def _write(model: torch.nn.Module, path: Path, inputs: tuple[str, ...], *, logits: bool) -> None:
    """The TorchScript exporter (``dynamo=False``: one file, faster, the same graph after ONNX
    Runtime's optimisations); two rows of different lengths keep the mask's padded path."""
    ids = torch.ones((2, 8), dtype=torch.long)
    mask = torch.ones((2, 8), dtype=torch.long)
    mask[1, 5:] = 0
    example = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    axes = {name: {0: "rows", 1: "tokens"} for name in inputs}
    axes[OUTPUT] = {0: "rows"} if logits else {0: "rows", 1: "tokens"}
    config = getattr(model, "config", None)
    saved_cache = getattr(config, "use_cache", None)
    if saved_cache is not None:
        config.use_cache = False  # a decoder would otherwise trace its key/value cache out
    saved_attention = _eager_attention(model)
    try:
        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.simplefilter("ignore")  # tracer warnings about Python control flow
            torch.onnx.export(
                Exportable(model, inputs, logits).eval(), tuple(example[name] for name in inputs),
                str(path), input_names=list(inputs), output_names=[OUTPUT], dynamic_axes=axes,
                opset_version=OPSET, do_constant_folding=True, dynamo=False,
            )
    finally:
        if saved_cache is not None:
            config.use_cache = saved_cache
        if saved_attention is not None:
            model.set_attn_implementation(saved_attention)  # type: ignore[operator]


def _eager_attention(model: torch.nn.Module) -> str | None:
    """Switch to eager attention for the trace (ONNX Runtime fuses its pattern, not SDPA's:
    docs/decisions/0040-onnx-runtime.md); the one it replaced, or None if it cannot switch."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    switch = getattr(model, "set_attn_implementation", None)
    if current in (None, "eager") or switch is None:
        return None
    try:
        switch("eager")
    except (ValueError, ImportError, AttributeError, NotImplementedError):
        return None
    return str(current)


def _fuse(path: Path, config: Any) -> None:
    """Rewrite a one-file export of :data:`FUSED_FAMILIES` with ONNX Runtime's fusions."""
    family = getattr(config, "model_type", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if family not in FUSED_FAMILIES or not heads or not hidden or len(os.listdir(path.parent)) > 1:
        return
    from onnxruntime.transformers.optimizer import optimize_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = optimize_model(str(path), model_type="bert", num_heads=int(heads),
                               hidden_size=int(hidden), opt_level=0)
    fused.save_model_to_file(str(path))
    log.info("fused %s: %s", family, fused.get_fused_operator_statistics())
