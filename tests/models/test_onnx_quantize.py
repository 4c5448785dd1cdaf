"""``--quantize int8``: the int8 graph is served only behind its calibration gate.

On tiny random BERTs: a gate the int8 graph cannot meet refuses the worker
with the measured cosine named; a gate it meets serves int8 vectors (which
differ from fp32's, and stay within the gate) and reports the cosine; the
int8 file is written once and reused; a classifier is gated on its scores;
a gate the uniform graph misses is met by leaving the most sensitive
nodes in fp32, chosen once (a bounded pass) and cached; a gate no mix
meets is refused with the best cosine tried;
``--quantize`` without the onnx runtime, and a gate outside (0, 1], are
refused by name.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

from tests.tiny_bert import SAMPLE_TEXTS, write_tiny_bert  # noqa: E402
from tokenq.shared.errors import ConfigError  # noqa: E402
from tokenq.shared.flags import parse_settings  # noqa: E402
from tokenq.worker.backends.base import TextInput  # noqa: E402
from tokenq.worker.backends.hf import quantize as quantize_module  # noqa: E402
from tokenq.worker.backends.hf.backend import HFBackend, HFOptions  # noqa: E402
from tokenq.worker.settings import WorkerSettings, settings_class_for  # noqa: E402


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("quantize") / "bert", seed=11)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quantize") / "classifier"
    return write_tiny_bert(path, head="classify", num_labels=3, seed=12)


def load(path: Path, cache: Path, **options: object) -> HFBackend:
    settings = HFOptions(
        model=str(path), device="cpu", runtime="onnx", onnx_cache_dir=str(cache), **options
    )
    return HFBackend.load(settings)


def unit_rows(backend: HFBackend) -> np.ndarray:
    encodings = backend.tokenize([TextInput(t) for t in SAMPLE_TEXTS if t], 64)
    rows = np.stack(backend.run(encodings)).astype(np.float64)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def count_quantizations(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record every real quantisation (``_quantize``) from now on."""
    written: list[Path] = []
    real = quantize_module._quantize

    def recording(source: Path, target: Path, **which: object) -> None:
        written.append(target)
        real(source, target, **which)  # type: ignore[arg-type]

    monkeypatch.setattr(quantize_module, "_quantize", recording)
    return written


# -- the gate -----------------------------------------------------------------------


def test_a_gate_the_int8_graph_cannot_meet_refuses_the_worker_with_the_cosine_named(
    bert: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as refused:
        load(bert, tmp_path, quantize="int8", quantize_min_cosine=1.0)
    message = str(refused.value)
    assert f"model {str(bert)!r}" in message
    measured = re.search(r"lowest cosine (\d\.\d+)", message)
    assert measured is not None, message
    assert 0 < float(measured.group(1)) < 1.0  # int8 really moved the vectors
    assert "--quantize-min-cosine 1" in message and "--quantize none" in message


def test_a_gate_the_int8_graph_meets_serves_int8_vectors_within_it(
    bert: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = 0.5
    fp32 = load(bert, tmp_path)
    with caplog.at_level(logging.INFO):
        int8 = load(bert, tmp_path, quantize="int8", quantize_min_cosine=gate)
    measured = int8.info.extra["quantize_cosine"]
    assert int8.info.extra["quantize"] == "int8" and gate <= measured < 1.0
    assert "quantize" not in fp32.info.extra
    assert any(
        "passed the gate" in r.getMessage() and f"{measured:.5f}"[:6] in r.getMessage()
        for r in caplog.records
    )
    want, have = unit_rows(fp32), unit_rows(int8)
    assert not np.array_equal(want, have)  # the int8 graph answered, not the fp32 one
    assert float((want * have).sum(axis=1).min()) >= gate


def test_a_classifier_is_gated_on_its_scores(
    classifier: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        backend = load(classifier, tmp_path, task="classify", quantize="int8",
                       quantize_min_cosine=0.5)
    assert 0.5 <= backend.info.extra["quantize_cosine"] <= 1.0 + 1e-9
    assert any("scores (per label, centred)" in r.getMessage() for r in caplog.records)
    scores = backend.run(backend.tokenize([TextInput("hello world")], 64))
    assert scores[0].shape == (3,) and np.isfinite(scores[0]).all()


def test_the_int8_graph_is_written_once_and_reused(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = count_quantizations(monkeypatch)
    first = load(bert, tmp_path, quantize="int8", quantize_min_cosine=0.5)
    (int8_file,) = tmp_path.glob("*/int8-*/model.onnx")
    stamp = int8_file.stat().st_mtime_ns
    second = load(bert, tmp_path, quantize="int8", quantize_min_cosine=0.5)
    assert len(written) == 1
    assert int8_file.stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob("*/.int8-*"))  # no scratch folder left
    np.testing.assert_array_equal(unit_rows(first), unit_rows(second))
    # The gate is measured on every start, the cached file or not.
    assert second.info.extra["quantize_cosine"] == first.info.extra["quantize_cosine"]


def test_a_quantizer_failure_is_refused_by_name_and_leaves_no_int8_entry(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnxruntime.quantization

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Unable to find data type for weight_name='x'")

    monkeypatch.setattr(onnxruntime.quantization, "quantize_dynamic", refuse)
    with pytest.raises(ConfigError, match=r"quantizer cannot take model .*--quantize none"):
        load(bert, tmp_path, quantize="int8")
    assert not list(tmp_path.glob("*/*int8-*"))


# -- a mixed graph: the most sensitive nodes left in fp32 ----------------------------


def mixed_gate(bert: Path, cache: Path) -> float:
    """A gate the uniform int8 graph misses and a mixed one meets.

    The loss of the tiny model's uniform graph is spread over its nodes;
    leaving half of them fp32 was measured to remove more than half of it,
    so a gate that asks a fifth less loss than the uniform graph's is met.
    """
    backend = load(bert, cache, quantize="int8", quantize_min_cosine=0.01)
    assert backend.info.extra["quantize_fp32_nodes"] == 0
    uniform = float(backend.info.extra["quantize_cosine"])
    return 1.0 - 0.8 * (1.0 - uniform)


def fp32_matmuls(backend: HFBackend) -> int:
    """MatMul nodes (fp32) in the graph the backend serves; int8 ones are MatMulInteger."""
    import onnx

    path = backend._encoder.path  # type: ignore[attr-defined]
    return sum(node.op_type == "MatMul" for node in onnx.load(str(path)).graph.node)


def test_a_gate_the_uniform_graph_misses_is_met_by_leaving_nodes_in_fp32(
    bert: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = mixed_gate(bert, tmp_path)
    fp32 = load(bert, tmp_path)
    with caplog.at_level(logging.INFO):
        mixed = load(bert, tmp_path, quantize="int8", quantize_min_cosine=gate)
    kept = mixed.info.extra["quantize_fp32_nodes"]
    served = mixed._encoder.path  # type: ignore[attr-defined]
    nodes = len(quantize_module.quantisable_nodes(served.parent.parent / served.name))  # fp32
    assert 1 <= kept <= nodes // 2
    assert fp32_matmuls(mixed) == kept  # the graph served really has them in fp32
    assert gate <= mixed.info.extra["quantize_cosine"] < 1.0
    want, have = unit_rows(fp32), unit_rows(mixed)
    assert not np.array_equal(want, have)  # still int8
    assert float((want * have).sum(axis=1).min()) >= gate
    log = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("onnx runtime: sensitivity 1/") for m in log)
    assert any(f"{kept} of {nodes} quantisable nodes left in fp32" in m for m in log)


def test_the_chosen_nodes_are_cached_and_reused_without_a_sensitivity_pass(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gate = mixed_gate(bert, tmp_path)
    first = load(bert, tmp_path, quantize="int8", quantize_min_cosine=gate)
    choices = [json.loads(f.read_text()) for f in tmp_path.glob("*/int8-choice-*.json")]
    (chosen,) = [c["exclude"] for c in choices if c["gate"] == gate]  # one file per gate
    assert len(chosen) == first.info.extra["quantize_fp32_nodes"] >= 1
    written = count_quantizations(monkeypatch)
    with caplog.at_level(logging.INFO):
        second = load(bert, tmp_path, quantize="int8", quantize_min_cosine=gate)
    assert written == []  # neither a sensitivity pass nor a greedy step
    assert not any("sensitivity" in r.getMessage() for r in caplog.records)
    assert second.info.extra == first.info.extra  # the gate is still measured, same graph
    np.testing.assert_array_equal(unit_rows(first), unit_rows(second))
    # Another gate is another choice.
    load(bert, tmp_path, quantize="int8", quantize_min_cosine=gate - 1e-6)
    assert len(written) > 1 and len(list(tmp_path.glob("*/int8-choice-*.json"))) == 3


def test_a_gate_no_mix_meets_is_refused_with_the_best_cosine_and_the_fp32_count(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = count_quantizations(monkeypatch)
    with pytest.raises(ConfigError) as refused:
        load(bert, tmp_path, quantize="int8", quantize_min_cosine=1.0)
    message = str(refused.value)
    found = re.search(r"lowest cosine (\d\.\d+) .*with (\d+) of (\d+) quantisable nodes", message)
    assert found is not None, message
    nodes = int(found.group(3))
    assert 0 < float(found.group(1)) < 1.0 and 1 <= int(found.group(2)) <= nodes // 2
    # Bounded: the uniform graph, each node alone, one graph per greedy step.
    assert len(written) == 1 + nodes + len(quantize_module.exclusion_steps(nodes))
    assert not list(tmp_path.glob("*/int8-choice-*.json"))  # a refusal chooses nothing
    assert not list(tmp_path.glob("*/.int8-*"))  # no scratch left


def test_the_sensitivity_pass_is_bounded_in_nodes_and_time(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = count_quantizations(monkeypatch)
    monkeypatch.setattr(quantize_module, "SENSITIVITY_MAX_NODES", 2)
    with pytest.raises(ConfigError):
        load(bert, tmp_path, quantize="int8", quantize_min_cosine=1.0)
    alone = [t for t in written if t.parent.name == "alone"]
    assert len(alone) == 2
    written.clear()
    monkeypatch.setattr(quantize_module, "SENSITIVITY_SECONDS", 0.0)
    with pytest.raises(ConfigError):
        load(bert, tmp_path, quantize="int8", quantize_min_cosine=1.0)
    assert len([t for t in written if t.parent.name == "alone"]) == 1


@pytest.mark.parametrize("exclude", ["Attention_0", {"Attention_0": 1}, [1, 2], [None]])
def test_a_cached_choice_whose_nodes_are_not_names_is_chosen_again(
    tmp_path: Path, exclude: object
) -> None:
    # A string is not read as its letters, a dict as its keys, numbers as names: choose again.
    file = tmp_path / "int8-choice-x.json"
    file.write_text(json.dumps({"exclude": exclude, "gate": 0.9, "measured": 0.95, "nodes": 4}))
    assert quantize_module._read_choice(file) == (None, 0)
    file.write_text(json.dumps({"exclude": ["Attention_0"], "gate": 0.9, "nodes": 4}))
    assert quantize_module._read_choice(file) == (["Attention_0"], 4)


def test_the_greedy_steps_grow_and_stop_at_half_the_nodes() -> None:
    assert quantize_module.exclusion_steps(18) == [1, 2, 3, 4, 6, 9]
    assert quantize_module.exclusion_steps(12) == [1, 2, 3, 4, 6]
    assert quantize_module.exclusion_steps(3) == [1]
    assert quantize_module.exclusion_steps(1) == []
    assert len(quantize_module.exclusion_steps(400)) <= 2 * math.log2(400)


# -- refusals before any model is loaded ----------------------------------------------


def test_quantize_with_the_torch_runtime_is_refused_by_name(bert: Path) -> None:
    needs_onnx = r"--quantize int8 .*needs --runtime onnx \(--runtime torch\)"
    with pytest.raises(ConfigError, match=needs_onnx):
        HFBackend.load(HFOptions(model=str(bert), device="cpu", runtime="torch", quantize="int8"))


def test_quantize_where_auto_chose_torch_is_refused_by_name(
    bert: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # auto then picks torch
    with pytest.raises(ConfigError, match=r"--quantize int8 .*--runtime auto chose torch"):
        HFBackend.load(HFOptions(model=str(bert), device="cpu", runtime="auto", quantize="int8"))


@pytest.mark.parametrize("gate", [0, 0.0, -0.5, 1.0000001, 2, math.nan, "high"])
def test_a_gate_outside_zero_to_one_is_refused_where_settings_are(gate: object) -> None:
    with pytest.raises(ConfigError, match=r"--quantize-min-cosine"):
        HFOptions.from_settings(SimpleNamespace(quantize="int8", quantize_min_cosine=gate))


def test_the_quantize_settings_are_flags_with_their_defaults() -> None:
    assert (HFOptions().quantize, HFOptions().quantize_min_cosine) == ("none", 0.99)
    with pytest.raises(ConfigError, match=r"quantize"):
        HFOptions.from_settings(SimpleNamespace(quantize="int4"))
    argv = ["--backend", "hf", "--runtime", "onnx", "--quantize", "int8",
            "--quantize-min-cosine", "0.97"]
    settings = parse_settings(settings_class_for(argv), argv, "tokenq worker")
    options = HFOptions.from_settings(settings)
    assert (options.quantize, options.quantize_min_cosine) == ("int8", 0.97)
    assert WorkerSettings(quantize="int8").quantize == "int8"  # type: ignore[call-arg,attr-defined]
