"""int8 weights for ``--runtime onnx`` (``--quantize int8``), offered only behind a measured gate.

On every start (int8 kernels differ by CPU) the int8 and fp32 graphs answer a
calibration set, compared as the worker returns rows (lowest cosine for
``embed``; per-label Pearson for scores); a model that moved past
``--quantize-min-cosine`` is refused with the number. :data:`RECIPE` and the
choice are docs/decisions/0043-int8-behind-a-gate.md: when the uniform graph
misses, a sensitivity pass (at most :data:`SENSITIVITY_MAX_NODES`, about
:data:`SENSITIVITY_SECONDS`) and :func:`exclusion_steps` leave the most
sensitive nodes in fp32, never over half. Graphs and the choice
(``int8-choice-<key>.json``) are cached beside the export.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from tokenq.shared.errors import ConfigError
from tokenq.worker.backends.hf.calibration import (
    CALIBRATION_MAX_TOKENS,
    CALIBRATION_PAIRS,
    CALIBRATION_TEXTS,
    Calibration,
    Encoder,
    Finish,
    GateReport,
    Int8Request,
)
from tokenq.worker.backends.hf.int8_files import (
    RECIPE,
    cache_key,
    keep,
    quantisable_nodes,
    quantize_or_refuse,
    quantized_model,
)

__all__ = [
    "CALIBRATION_MAX_TOKENS",
    "CALIBRATION_PAIRS",
    "CALIBRATION_TEXTS",
    "RECIPE",
    "Finish",
    "GateReport",
    "Int8Request",
    "exclusion_steps",
    "int8_encoder",
    "quantized_model",
]

log = logging.getLogger(__name__)

E = TypeVar("E", bound=Encoder)
SENSITIVITY_MAX_NODES = 48
"""At most this many nodes (the first in graph order) are quantised alone to rank them."""
SENSITIVITY_SECONDS = 120.0
"""The sensitivity pass stops measuring after this long; the nodes left count as harmless."""



def int8_encoder(
    fp32: Encoder, fp32_path: Path, open_encoder: Callable[[Path], E], request: Int8Request
) -> tuple[E, GateReport]:
    """The int8 twin of ``fp32`` (the session on ``fp32_path``), if it passes the gate.

    Cached choice, else uniform, else :func:`_choose`'s mixed graph; a ConfigError
    names the model, the lowest cosine and the gate when none passes.
    """
    calibration = Calibration(fp32, request)
    choice_file = _choice_file(fp32_path, request)
    cached, nodes = _read_choice(choice_file)
    if cached is not None:
        path = quantized_model(fp32_path, family=request.model, exclude=cached)
        int8 = open_encoder(path)
        report = replace(calibration.measure(int8, fp32_nodes=len(cached)), nodes=nodes)
        if not report.min_cosine >= report.gate:
            log.warning(
                "onnx runtime: the cached choice of %d fp32 nodes measured %.5f here, below "
                "the gate %g; choosing again",
                len(cached),
                report.min_cosine,
                report.gate,
            )
            cached = None
    if cached is None:
        path, int8, report, exclude = _choose(fp32_path, open_encoder, calibration)
        _write_choice(choice_file, exclude, report)
    log.info(
        "onnx runtime: int8 %s passed the gate: lowest cosine %.5f to fp32 %s on %d "
        "calibration rows (gate %g, largest absolute difference %.3g, %d of %d "
        "quantisable nodes left in fp32)",
        path,
        report.min_cosine,
        report.compared,
        report.rows,
        report.gate,
        report.max_abs_diff,
        report.fp32_nodes,
        report.nodes,
    )
    return int8, report


def _choose(
    fp32_path: Path, open_encoder: Callable[[Path], E], calibration: Calibration
) -> tuple[Path, E, GateReport, list[str]]:
    """The uniform int8 graph if it passes; else the fewest most sensitive nodes left fp32.

    Failing graphs are made in a scratch folder and dropped; only the one served is cached.
    """
    request = calibration.request
    started = time.monotonic()
    path = quantized_model(fp32_path, family=request.model)
    int8 = open_encoder(path)
    report = calibration.measure(int8, fp32_nodes=0)
    nodes = quantisable_nodes(fp32_path)
    report = replace(report, nodes=len(nodes))
    if report.min_cosine >= report.gate or len(nodes) < 2:
        _refuse_unless_passed(report, request)
        return path, int8, report, []
    best, exclude = report, []
    rounds = 1
    scratch = Path(tempfile.mkdtemp(prefix=".int8-search.", dir=fp32_path.parent))
    try:
        ranked, measured_alone = _sensitivity(
            fp32_path, open_encoder, calibration, nodes, scratch
        )
        rounds += measured_alone
        for count in exclusion_steps(len(nodes)):
            exclude = ranked[:count]
            candidate = scratch / f"exclude-{count}" / fp32_path.name
            candidate.parent.mkdir()
            quantize_or_refuse(fp32_path, candidate, request.model, exclude=exclude)
            rounds += 1
            measured = calibration.measure(open_encoder(candidate), fp32_nodes=count)
            measured = replace(measured, nodes=len(nodes))
            log.info(
                "onnx runtime: int8 with %d of %d nodes left in fp32: lowest cosine %.5f "
                "(gate %g)",
                count,
                len(nodes),
                measured.min_cosine,
                measured.gate,
            )
            if measured.min_cosine > best.min_cosine:
                best = measured
            if measured.min_cosine >= measured.gate:
                path = keep(candidate, fp32_path, exclude)
                break
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log.info(
        "onnx runtime: int8 choice took %d quantisations in %.1f s",
        rounds,
        time.monotonic() - started,
    )
    _refuse_unless_passed(best, request)
    return path, open_encoder(path), best, exclude


def _refuse_unless_passed(report: GateReport, request: Int8Request) -> None:
    if report.min_cosine >= report.gate:
        return
    mixed = (
        f", the best of the graphs tried, with {report.fp32_nodes} of {report.nodes} "
        f"quantisable nodes left in fp32 (at most half are: past that int8 is not worth it)"
        if report.nodes >= 2
        else ""
    )
    raise ConfigError(
        f"--quantize int8: model {request.model!r} moved too far in int8: lowest cosine "
        f"{report.min_cosine:.5f} to the fp32 graph's {report.compared} on "
        f"{report.rows} calibration rows{mixed}, below --quantize-min-cosine "
        f"{report.gate:g}; use --quantize none (or accept the loss with a lower "
        "--quantize-min-cosine)"
    )


def exclusion_steps(nodes: int) -> list[int]:
    """How many of the most sensitive nodes each greedy round leaves in fp32: 1, 2, 3, 4,
    then growing by half up to half the nodes, so O(log n) rounds.
    """
    cap, steps, count = nodes // 2, [], 1
    while count < cap:
        steps.append(count)
        count = count + 1 if count < 4 else count + count // 2
    return [*steps, cap] if cap >= 1 else []


def _sensitivity(
    fp32_path: Path,
    open_encoder: Callable[[Path], E],
    calibration: Calibration,
    nodes: list[str],
    scratch: Path,
) -> tuple[list[str], int]:
    """``nodes``, the most sensitive first, and how many were measured.

    Each is quantised alone and measured (cheaper proxies ranked poorly:
    docs/decisions/0043-int8-behind-a-gate.md); at most :data:`SENSITIVITY_MAX_NODES`,
    within :data:`SENSITIVITY_SECONDS`. A node not measured counts as harmless.
    """
    started = time.monotonic()
    tried = nodes[:SENSITIVITY_MAX_NODES]
    log.info(
        "onnx runtime: int8 misses the gate %g; measuring %d of %d quantisable nodes "
        "one by one to choose which stay fp32",
        calibration.request.min_cosine,
        len(tried),
        len(nodes),
    )
    loss: dict[str, float] = {}
    candidate = scratch / "alone" / fp32_path.name
    candidate.parent.mkdir()
    for done, node in enumerate(tried, start=1):
        elapsed = time.monotonic() - started
        if loss and elapsed > SENSITIVITY_SECONDS:
            log.warning(
                "onnx runtime: sensitivity pass stopped after %.0f s at %d of %d nodes",
                elapsed,
                len(loss),
                len(tried),
            )
            break
        quantize_or_refuse(fp32_path, candidate, calibration.request.model, only=[node])
        report = calibration.measure(open_encoder(candidate), fp32_nodes=len(nodes) - 1)
        loss[node] = 1.0 - report.min_cosine
        log.info(
            "onnx runtime: sensitivity %d/%d: %s alone in int8 loses %.5f",
            done,
            len(tried),
            node,
            loss[node],
        )
    return sorted(nodes, key=lambda node: -loss.get(node, 0.0)), len(loss)


def _choice_file(fp32: Path, request: Int8Request) -> Path:
    """Where the chosen exclusion list is kept: keyed by the gate, the recipe and the set."""
    described = {
        "gate": request.min_cosine,
        "pairs": request.pairs,
        "max_tokens": request.max_tokens,
        "calibration": CALIBRATION_PAIRS if request.pairs else CALIBRATION_TEXTS,
    }
    return fp32.parent / f"int8-choice-{cache_key(described)}.json"


def _read_choice(file: Path) -> tuple[list[str] | None, int]:
    """The cached nodes to leave fp32 and the quantisable count; None: choose (again)."""
    try:
        choice = json.loads(file.read_text())
        exclude, nodes = choice["exclude"], int(choice["nodes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, 0
    if not isinstance(exclude, list) or not all(isinstance(n, str) for n in exclude):
        return None, 0
    log.info("onnx runtime: reusing the int8 choice %s (%d nodes in fp32)", file, len(exclude))
    return exclude, nodes


def _write_choice(file: Path, exclude: list[str], report: GateReport) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    text = json.dumps(
        {
            "exclude": exclude,
            "gate": report.gate,
            "measured": report.min_cosine,
            "nodes": report.nodes,
        },
        indent=1,
    )
    scratch = file.with_name(f".{file.name}.{os.getpid()}")
    scratch.write_text(text)
    os.replace(scratch, file)


