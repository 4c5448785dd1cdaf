"""int8 weights for ``--runtime onnx``, served only when they pass a gate on a calibration set,
the most sensitive nodes left fp32 if need be (docs/decisions/0043-int8-behind-a-gate.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from tokenq.shared.errors import ConfigError
from tokenq.shared.text import exception_headline
from tokenq.worker.backends.hf.encoding import HFEncoding, flat_rows, pad_rows
from tokenq.worker.backends.hf.export import rename_into_place, scratch_beside

log = logging.getLogger(__name__)

CALIBRATION_MAX_TOKENS = 128
CALIBRATION_BATCH = 8

CALIBRATION_TEXTS: tuple[str, ...] = (
    "x",
    "42",
    "how do I reset my password",
    "weather tomorrow in lisbon",
    "cheap flights to tokyo",
    "python list comprehension example",
    "What is the capital of Australia?",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé — déjà vu",
    "def add(a, b):\n    return a + b  # the sum",
    "The mitochondrion is the powerhouse of the cell: it produces most of the chemical "
    "energy needed to power the cell's biochemical reactions, stored as ATP.",
    "In 1969 Apollo 11 landed on the Moon. Neil Armstrong and Buzz Aldrin walked on the "
    "surface while Michael Collins orbited above in the command module, and the crew "
    "returned safely to Earth eight days after launch.",
    "A work queue packs requests into batches by token budget, so that a GPU is kept busy "
    "without any single batch running out of memory; producers push requests onto a "
    "stream, workers pull, pack within their own budget, run the model and push each "
    "reply to the request's key. " * 3,
    "东京是日本的首都，也是世界上人口最多的城市之一。",
    "猫在桌子上睡觉",
    "Москва — столица России и крупнейший город страны.",
    "Где находится ближайшая аптека?",
    "مرحبا بالعالم",
    "¿Dónde está la biblioteca?",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
)
"""Short queries and long passages, English and other scripts: where int8 errors show."""

CALIBRATION_PAIRS: tuple[tuple[str, str], ...] = tuple(
    (query, passage)
    for query in ("how do I reset my password", "what is the capital of australia", "猫")
    for passage in (
        CALIBRATION_TEXTS[10], CALIBRATION_TEXTS[11], "Canberra is the capital city of Australia.",
        "To reset your password, open settings and choose 'forgot password'.",
        CALIBRATION_TEXTS[12], CALIBRATION_TEXTS[13],
    )
)
"""(query, passage) pairs, relevant and not, for a cross-encoder."""

# (ids, attention mask, type ids) -> hidden states (embed) or logits (classify, rerank)
Encoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Finish = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, mask) -> the rows


@dataclass(frozen=True, slots=True)
class Int8Request:
    """What the gate needs from the backend."""

    model: str  # named in the refusal
    min_cosine: float
    tokenizer: Any
    pad_id: int
    pairs: bool  # a cross-encoder: calibrate on (query, passage) pairs
    max_tokens: int
    finish: Finish | None  # the embedding head; None: the rows are logits, compared per label


@dataclass(frozen=True, slots=True)
class GateReport:
    """What the calibration measured."""

    min_cosine: float
    gate: float
    rows: int
    max_abs_diff: float
    compared: str
    fp32_nodes: int = 0  # quantisable nodes left in fp32 in the graph measured
    nodes: int = 0  # quantisable nodes in the graph (0: not counted)

    @property
    def passed(self) -> bool:
        return self.min_cosine >= self.gate

    def describe(self) -> dict[str, Any]:  # for the backend's info
        return {"quantize": "int8", "quantize_cosine": round(self.min_cosine, 6),
                "quantize_fp32_nodes": self.fp32_nodes}


class Calibration:
    """The fp32 graph's answers to the calibration set, run once; candidates compared to them."""

    def __init__(self, reference: Encoder, request: Int8Request) -> None:
        self.request = request
        self.batches = calibration_batches(request)
        self.want = self._answers(reference)

    def _answers(self, encoder: Encoder) -> np.ndarray:
        rows, finish = [], self.request.finish
        with torch.inference_mode():
            for ids, mask, type_ids in self.batches:
                output = encoder(ids, mask, type_ids)
                answer = output if finish is None else finish(output, mask)
                rows.append(answer.float().numpy().astype(np.float64))
        return np.concatenate(rows)

    def measure(self, candidate: Encoder, fp32_nodes: int, nodes: int = 0) -> GateReport:
        """``candidate`` on the calibration set, compared as the worker would return its rows."""
        a, b = self.want, self._answers(candidate)
        if self.request.finish is None:  # scores: each label's column over the set, centred
            lowest = _lowest_cosine((a - a.mean(0)).T, (b - b.mean(0)).T)
            compared = "scores (per label, centred)"
        else:
            lowest = _lowest_cosine(a, b)
            compared = "vectors"
            a, b = _unit(a), _unit(b)  # the difference as the default (normalised) answer shows
        return GateReport(
            min_cosine=lowest, gate=self.request.min_cosine, rows=len(a),
            max_abs_diff=float(np.abs(a - b).max()), compared=compared, fp32_nodes=fp32_nodes,
            nodes=nodes)


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)


def _lowest_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The lowest cosine between matching rows; two rows that are both zero count as equal."""
    norm_a, norm_b = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    cosines = (a * b).sum(-1) / np.maximum(norm_a * norm_b, 1e-300)
    return float(np.where((norm_a < 1e-12) & (norm_b < 1e-12), 1.0, cosines).min())


def calibration_batches(request: Int8Request) -> list[tuple[torch.Tensor, ...]]:
    """The calibration set tokenized as the backend tokenizes, right-padded in small batches."""
    firsts = [q for q, _ in CALIBRATION_PAIRS] if request.pairs else list(CALIBRATION_TEXTS)
    seconds = [p for _, p in CALIBRATION_PAIRS] if request.pairs else None
    encoded = request.tokenizer(
        firsts, seconds, add_special_tokens=True,
        truncation="longest_first", max_length=request.max_tokens, return_attention_mask=False,
        return_token_type_ids=request.pairs, verbose=False)
    ids_rows = flat_rows(encoded["input_ids"])
    type_rows = flat_rows(encoded["token_type_ids"]) if request.pairs else [None] * len(ids_rows)
    rows = [HFEncoding(ids, types) for ids, types in zip(ids_rows, type_rows, strict=True)]
    batches = (pad_rows(rows[at : at + CALIBRATION_BATCH], request.pad_id)
               for at in range(0, len(rows), CALIBRATION_BATCH))
    return [tuple(map(torch.from_numpy, arrays)) for arrays in batches]


QUANTIZE_FORMAT = 2  # bumped whenever what quantized_model writes changes: old files unused
RECIPE: dict[str, Any] = {  # quantize_dynamic's arguments; part of the cache key
    "op_types_to_quantize": ["MatMul"], "per_channel": True, "reduce_range": True,
    "weight_type": "QInt8"}


def quantisable_nodes(fp32: Path) -> list[str]:
    """The nodes the recipe quantises: its op types, with an initializer as the weight."""
    import onnx

    graph = onnx.load(str(fp32), load_external_data=False).graph
    weights = {tensor.name for tensor in graph.initializer}
    kinds = set(RECIPE["op_types_to_quantize"])
    return [node.name for node in graph.node
            if node.op_type in kinds and len(node.input) > 1 and node.input[1] in weights]


def cache_key(described: dict[str, Any]) -> str:
    import onnxruntime

    described = {**described, "recipe": RECIPE, "format": QUANTIZE_FORMAT,
                 "onnxruntime": onnxruntime.__version__}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def _folder(fp32: Path, exclude: Sequence[str]) -> Path:
    return fp32.parent / f"int8-{cache_key({'exclude': sorted(exclude)})}"


def quantized_model(fp32: Path, *, family: str = "", exclude: Sequence[str] = ()) -> Path:
    """The int8 graph of ``fp32`` with ``exclude`` left fp32, quantised now unless cached."""
    cached = _folder(fp32, exclude) / fp32.name
    if cached.is_file():
        log.info("onnx runtime: reusing the int8 graph %s", cached)
        return cached
    with scratch_beside(cached.parent) as scratch:
        _quantize(fp32, scratch / fp32.name, family=family, exclude=exclude)
        return keep(scratch, fp32, exclude)


def keep(made: Path, fp32: Path, exclude: Sequence[str]) -> Path:
    """Rename the folder ``made`` into the cache (the int8 graph of ``fp32`` less ``exclude``)."""
    done = rename_into_place(made, _folder(fp32, exclude), fp32.name)
    log.info("onnx runtime: quantised to int8: %s", done)
    return done


def _quantize(
    source: Path, target: Path, *, family: str, exclude: Sequence[str] = (),
    only: Sequence[str] | None = None,
) -> None:
    """One ``quantize_dynamic`` call: the recipe, less ``exclude``, or only ``only``; its
    per-tensor lines and pre-processing advice (on the root logger) are filtered out."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    def quiet(record: logging.LogRecord) -> bool:
        level = record.levelno
        return level > logging.WARNING or (
            level == logging.WARNING and "pre-processing" not in record.getMessage())

    logging.getLogger().addFilter(quiet)
    try:
        quantize_dynamic(
            str(source), str(target), op_types_to_quantize=list(RECIPE["op_types_to_quantize"]),
            per_channel=RECIPE["per_channel"], reduce_range=RECIPE["reduce_range"],
            weight_type=QuantType[RECIPE["weight_type"]],
            nodes_to_quantize=list(only) if only is not None else None,
            nodes_to_exclude=list(exclude),
            # The fused graph's contrib ops (Attention, SkipLayerNormalization)
            # defeat ONNX shape inference; their outputs are fp32.
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    except Exception as exc:  # the quantizer fails in many ways, all meaning the same here
        raise ConfigError(f"--quantize int8: ONNX Runtime's quantizer cannot take model "
                          f"{family!r} ({exception_headline(exc)}); use --quantize none") from exc
    finally:
        logging.getLogger().removeFilter(quiet)


E = TypeVar("E", bound=Encoder)
SENSITIVITY_MAX_NODES = 48  # at most this many nodes (the first) are quantised alone, ranked
SENSITIVITY_SECONDS = 120.0  # then the pass stops measuring; the nodes left count as harmless


def int8_encoder(
    fp32: Encoder, fp32_path: Path, open_encoder: Callable[[Path], E], request: Int8Request
) -> tuple[E, GateReport]:
    """The int8 twin of ``fp32`` (the session on ``fp32_path``) that passes the gate: the
    cached choice, else :func:`_choose`'s; else a ConfigError naming the lowest cosine."""
    calibration = Calibration(fp32, request)
    # The choice is kept keyed by the gate, the recipe and the calibration set.
    choice_file = fp32_path.parent / "int8-choice-{}.json".format(cache_key({
        "gate": request.min_cosine, "pairs": request.pairs, "max_tokens": request.max_tokens,
        "calibration": CALIBRATION_PAIRS if request.pairs else CALIBRATION_TEXTS,
    }))
    cached, nodes = _read_choice(choice_file)
    if cached is not None:
        path = quantized_model(fp32_path, family=request.model, exclude=cached)
        int8 = open_encoder(path)
        report = calibration.measure(int8, len(cached), nodes)
        if not report.passed:
            log.warning(
                "onnx runtime: the cached choice of %d fp32 nodes measured %.5f here, below "
                "the gate %g; choosing again", len(cached), report.min_cosine, report.gate)
            cached = None
    if cached is None:
        path, int8, report, exclude = _choose(fp32_path, open_encoder, calibration)
        _write_choice(choice_file, exclude, report)
    log.info(
        "onnx runtime: int8 %s passed the gate: lowest cosine %.5f to fp32 %s on %d "
        "calibration rows (gate %g, largest absolute difference %.3g, %d of %d "
        "quantisable nodes left in fp32)", path, report.min_cosine, report.compared,
        report.rows, report.gate, report.max_abs_diff, report.fp32_nodes, report.nodes)
    return int8, report


def _choose(
    fp32_path: Path, open_encoder: Callable[[Path], E], calibration: Calibration
) -> tuple[Path, E, GateReport, list[str]]:
    """The uniform int8 graph if it passes; else the fewest most sensitive nodes left fp32
    (failing graphs are made in a scratch folder; only the one served is cached)."""
    request = calibration.request
    started = time.monotonic()
    path = quantized_model(fp32_path, family=request.model)
    int8 = open_encoder(path)
    nodes = quantisable_nodes(fp32_path)
    report = calibration.measure(int8, 0, len(nodes))
    if report.passed or len(nodes) < 2:
        _refuse_unless_passed(report, request)
        return path, int8, report, []
    best, exclude = report, []
    rounds = 1
    with scratch_beside(fp32_path.parent / "int8-search") as scratch:
        ranked, measured_alone = _sensitivity(fp32_path, open_encoder, calibration, nodes, scratch)
        rounds += measured_alone
        for count in exclusion_steps(len(nodes)):
            exclude = ranked[:count]
            candidate = scratch / f"exclude-{count}" / fp32_path.name
            candidate.parent.mkdir()
            _quantize(fp32_path, candidate, family=request.model, exclude=exclude)
            rounds += 1
            measured = calibration.measure(open_encoder(candidate), count, len(nodes))
            log.info(
                "onnx runtime: int8 with %d of %d nodes left in fp32: lowest cosine %.5f "
                "(gate %g)", count, len(nodes), measured.min_cosine, measured.gate)
            if measured.min_cosine > best.min_cosine:
                best = measured
            if measured.passed:
                path = keep(candidate.parent, fp32_path, exclude)
                break
    log.info("onnx runtime: int8 choice took %d quantisations in %.1f s",
             rounds, time.monotonic() - started)
    _refuse_unless_passed(best, request)
    return path, open_encoder(path), best, exclude


def _refuse_unless_passed(report: GateReport, request: Int8Request) -> None:
    if report.passed:
        return
    mixed = (f", the best of the graphs tried, with {report.fp32_nodes} of {report.nodes} "
             "quantisable nodes left in fp32 (at most half are: past that int8 is not worth it)"
             if report.nodes >= 2 else "")
    raise ConfigError(
        f"--quantize int8: model {request.model!r} moved too far in int8: lowest cosine "
        f"{report.min_cosine:.5f} to the fp32 graph's {report.compared} on "
        f"{report.rows} calibration rows{mixed}, below --quantize-min-cosine "
        f"{report.gate:g}; use --quantize none (or accept the loss with a lower "
        "--quantize-min-cosine)")


def exclusion_steps(nodes: int) -> list[int]:
    """How many of the most sensitive nodes each greedy round leaves in fp32: 1, 2, 3, 4,
    then growing by half up to half the nodes, so O(log n) rounds."""
    cap, steps, count = nodes // 2, [], 1
    while count < cap:
        steps.append(count)
        count = count + 1 if count < 4 else count + count // 2
    return [*steps, cap] if cap >= 1 else []


def _sensitivity(
    fp32_path: Path, open_encoder: Callable[[Path], E], calibration: Calibration, nodes: list[str],
    scratch: Path,
) -> tuple[list[str], int]:
    """``nodes``, the most sensitive first (each quantised alone and measured, within the
    SENSITIVITY_ limits; one not measured counts as harmless), and how many were measured."""
    started = time.monotonic()
    tried = nodes[:SENSITIVITY_MAX_NODES]
    log.info(
        "onnx runtime: int8 misses the gate %g; measuring %d of %d quantisable nodes "
        "one by one to choose which stay fp32", calibration.request.min_cosine, len(tried),
        len(nodes))
    loss: dict[str, float] = {}
    candidate = scratch / "alone" / fp32_path.name
    candidate.parent.mkdir()
    for done, node in enumerate(tried, start=1):
        elapsed = time.monotonic() - started
        if loss and elapsed > SENSITIVITY_SECONDS:
            log.warning("onnx runtime: sensitivity pass stopped after %.0f s at %d of %d nodes",
                        elapsed, len(loss), len(tried))
            break
        _quantize(fp32_path, candidate, family=calibration.request.model, only=[node])
        report = calibration.measure(open_encoder(candidate), len(nodes) - 1)
        loss[node] = 1.0 - report.min_cosine
        log.info("onnx runtime: sensitivity %d/%d: %s alone in int8 loses %.5f",
                 done, len(tried), node, loss[node])
    return sorted(nodes, key=lambda node: -loss.get(node, 0.0)), len(loss)


def _read_choice(file: Path) -> tuple[list[str] | None, int]:
    """The cached nodes to leave fp32 and the quantisable count; None: choose (again)."""
    try:
        choice = json.loads(file.read_text())
        exclude, nodes = choice["exclude"], int(choice["nodes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, 0
    if not isinstance(exclude, list) or not all(isinstance(n, str) for n in exclude):
        return None, 0  # not node names (a string would read as its letters)
    log.info("onnx runtime: reusing the int8 choice %s (%d nodes in fp32)", file, len(exclude))
    return exclude, nodes


def _write_choice(file: Path, exclude: list[str], report: GateReport) -> None:
    """Atomically: a reader sees the old file or the new one."""
    text = json.dumps({"exclude": exclude, "gate": report.gate, "measured": report.min_cosine,
                       "nodes": report.nodes}, indent=1)
    scratch = file.with_name(f".{file.name}.{os.getpid()}")
    scratch.write_text(text)
    os.replace(scratch, file)
