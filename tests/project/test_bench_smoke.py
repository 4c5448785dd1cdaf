"""Every benchmark suite runs end to end (``--size tiny``; shards ``small``) and writes its JSON.

Why: the benchmarks start real redis-servers and worker processes and read
the workers' batch logs; a change anywhere in tokenq can break them
silently, and docs/BENCHMARKS.md would then quote figures nobody can
reproduce. These tests check that each suite still runs and reports its
keys, and a few facts that hold at any size (a fixed count of 32 runs out
of memory on the seed mix, tokenq does not). They do not check speed: the
machine running tests is shared and tiny runs are seconds long.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN = REPO_ROOT / "scripts" / "bench" / "run.py"
SEED_KEYS = {
    "failed_requests", "padding_efficiency", "useful_tokens_per_s", "requests_per_s",
    "p50_ms", "p99_ms", "peak_memory_bytes",
}


def run_suite(
    suite: str, tmp_path: Path, timeout: float = 120.0, size: str = "tiny", *flags: str
) -> dict[str, Any]:
    out = tmp_path / f"{suite}.json"
    completed = subprocess.run(
        [sys.executable, str(RUN), suite, "--size", size, "--json", str(out), *flags],
        capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert f"== {suite} ({size}" in completed.stdout  # the table was printed
    result = json.loads(out.read_text())
    assert result["suite"] == suite and result["size"] == size
    assert result["machine"]["cores"] and result["rows"]
    return result


def test_seed(tmp_path: Path) -> None:
    result = run_suite("seed", tmp_path)
    rows = {row["setting"]: row for row in result["rows"]}
    safe = result["config"]["largest_safe_count"]
    assert set(rows) == {
        "fifo-32", f"fifo-{safe}", "tokenq-4096", "tokenq-8192", "tokenq-16384", "bound",
    }
    for row in rows.values():
        assert set(row) >= SEED_KEYS
    capacity = result["config"]["sim"]["capacity_bytes"]
    assert rows["fifo-32"]["failed_requests"] > 0  # 32 rows with a passage do not fit
    for name in (f"fifo-{safe}", "tokenq-4096", "tokenq-8192", "tokenq-16384"):
        assert rows[name]["failed_requests"] == 0, name
        assert 0 < rows[name]["peak_memory_bytes"] <= capacity, name
    assert rows["tokenq-4096"]["peak_memory_bytes"] <= 4096 * 4096
    assert rows["tokenq-8192"]["padding_efficiency"] > rows[f"fifo-{safe}"]["padding_efficiency"]


def test_overhead(tmp_path: Path) -> None:
    result = run_suite("overhead", tmp_path)
    rows = {row["setting"]: row for row in result["rows"]}
    e2e = rows["end to end, 1 worker"]
    assert e2e["failed_requests"] == 0 and e2e["requests_per_s"] > 0
    # Every request needs at least its XADD, and publishing it some more (its reply's
    # RPUSH is shared with the other answers to its key in the same publish call).
    assert e2e["commands_per_request"] > 1
    assert 0 < e2e["round_trips_per_request"] < e2e["commands_per_request"]


def test_cpu(tmp_path: Path) -> None:
    """Every side costs some CPU per request, and the lowest is never above the median."""
    result = run_suite("cpu", tmp_path)
    rows = {row["setting"]: row for row in result["rows"]}
    for side in ("producer", "worker", "worker floor"):
        assert 0 < rows[side]["lowest_cpu_us"] <= rows[side]["cpu_us_per_request"], side
        assert rows[side]["lowest_redis_cpu_us"] > 0, side
        assert rows[side]["requests_per_s"] > 0, side
    both = rows["redis-server, both sides"]["redis_cpu_us_per_request"]
    assert both >= rows["worker"]["redis_cpu_us_per_request"]


def test_feed(tmp_path: Path) -> None:
    """Each mix: the worker's CPU with its forward skipped and the tokenizer's, and their
    ratio; the skip switch is the one the suite names."""
    pytest.importorskip("transformers")
    result = run_suite("feed", tmp_path, 300.0)
    rows = {row["mix"]: row for row in result["rows"]}
    assert set(rows) == {"seed", "gpu_seed", "queries", "gpu_seed, cpu budget"}
    for mix, row in rows.items():
        assert row["worker_cpu_us"] > 0 and row["tokenizer_cpu_us"] > 0, mix
        assert row["worker_over_tokenizer"] > 0 and row["requests_per_s"] > 0, mix
        assert row["floor_over_tokenizer"] > 0, mix


@pytest.fixture(scope="module")
def scale_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny scale run, shared by the scale test and the plots test."""
    results = tmp_path_factory.mktemp("results")
    run_suite("scale", results)
    return results


def test_producer(tmp_path: Path) -> None:
    result = run_suite("producer", tmp_path)
    rows = {row["setting"]: row for row in result["rows"]}
    assert {"estimate, all", "estimate, ascii", "estimate, mixed scripts"} <= set(rows)
    assert rows["estimate, all"]["texts"] == sum(
        rows[name]["texts"] for name in ("estimate, ascii", "estimate, mixed scripts")
    )
    assert all(row["us_per_text"] > 0 for name, row in rows.items() if name.startswith("est"))
    (submit,) = [row for name, row in rows.items() if name.startswith("submit_many")]
    assert submit["requests_per_s"] > 0 and submit["texts"] == rows["estimate, all"]["texts"]


def test_scale(scale_results: Path) -> None:
    result = json.loads((scale_results / "scale.json").read_text())
    assert [row["workers"] for row in result["rows"]] == [1, 2]
    assert all(row["failed_requests"] == 0 for row in result["rows"])
    assert result["rows"][0]["speedup"] == 1
    # A burst is shared: no idle worker is left out (the first read of a
    # fresh worker used to take up to 128 requests, i.e. the whole burst).
    assert all(batches > 0 for batches in result["rows"][1]["batches_per_worker"])


def test_latency(tmp_path: Path) -> None:
    result = run_suite("latency", tmp_path)
    assert result["config"]["capacity_per_s"] > 0
    for row in result["rows"]:
        assert row["failed_requests"] == 0
        assert 0 < row["p50_ms"] <= row["p99_ms"]


def runs_onnx() -> bool:
    return all(importlib.util.find_spec(name) for name in ("sentence_transformers", "onnxruntime"))


def test_mixed_latency(tmp_path: Path) -> None:
    """One tiny run: with onnx installed, ``--runtime onnx``, whose sim rows are a plain
    run's, hf-torch's and hf-onnx's beside them (each run starts its workers afresh)."""
    onnx = runs_onnx()
    result = run_suite("mixed-latency", tmp_path, 300.0, "tiny",
                       *(["--runtime", "onnx"] if onnx else []))
    rows = {row["setting"]: row for row in result["rows"]}
    modes, classes = ("no-priority", "priority"), ("query", "passage", "all")
    assert {f"{mode} {cls}" for mode in modes for cls in classes} == {
        name for name in rows if not name.startswith("hf-")
    }
    assert result["config"]["priority_supported"] is True  # this tree's producer takes it
    assert result["config"]["aging_ms"] > 0
    assert result["config"]["priorities"]["priority"] == {"query": 1, "passage": 0}
    for mode in ("no-priority", "priority"):
        parts = [rows[f"{mode} {cls}"] for cls in ("query", "passage")]
        assert rows[f"{mode} all"]["requests"] == sum(row["requests"] for row in parts) > 0
    for name, row in rows.items():
        assert row["failed"] == 0, name
        assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"], name
    if onnx:
        assert result["command"].endswith("--runtime onnx")
        for setting in ("hf-torch", "hf-onnx"):
            assert rows[f"{setting} all"]["requests"] > 0
        assert any("hf onnx / hf torch requests/s" in note for note in result["notes"])


def test_shards(tmp_path: Path) -> None:
    """Small, not tiny: at 600 requests a shard's share is a handful of submit_many calls."""
    result = run_suite("shards", tmp_path, timeout=300.0, size="small")
    totals = {row["shards"]: row for row in result["rows"] if "shards" in row}
    assert set(totals) == {1, 3}
    for shards, total in totals.items():
        nodes = [row for row in result["rows"] if row["setting"].startswith(f"K={shards}, node")]
        assert len(nodes) == 3  # one row per master
        assert total["requests"] == result["config"]["requests_per_k"]
        assert sum(row["requests"] for row in nodes) == total["requests"]
        # Every request needs at least its XADD and its reply RPUSH.
        assert total["commands_per_request"] >= 2
        assert 0 < total["round_trips_per_request"] < total["commands_per_request"]
        assert total["capacity_per_s"] > 0 and total["redis_cpu_us_per_request"] > 0
        busy = [row for row in nodes if row["requests"]]
        assert len(busy) == shards  # K=1 on one master; K=3 on three (spread_queue)
    assert "info" in result["config"]["commands_seen"]["not_counted"]
    assert "fcall" in result["config"]["commands_seen"]["round_trip"]  # a script call: one trip


def test_plots_from_results(scale_results: Path, tmp_path: Path) -> None:
    """The plots draw from whatever suite JSON exists (here: a tiny scale run)."""
    results, images = scale_results, tmp_path / "img"
    completed = subprocess.run(
        [sys.executable, str(RUN), "plots", "--results", str(results), "--images", str(images)],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, completed.stderr
    assert (images / "scale.png").stat().st_size > 1000
    assert not (images / "seed.png").exists()  # no seed.json: skipped, not failed


@pytest.mark.timeout(660)  # its run's own limit is 600 s: a loaded box fails that, not this
def test_real_compares_the_onnx_runtime_with_torch(tmp_path: Path) -> None:
    """``real`` (every torch row and ratio) and, with ``--runtime onnx``, the onnx rows beside
    the torch ones, the same vectors as sentence-transformers, each worker's peak memory, and
    onnx/torch (not its size: tiny runs are noise)."""
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("onnxruntime")
    real = run_suite("real", tmp_path, 600.0, "tiny", "--runtime", "onnx")
    methods = {row["method"] for row in real["rows"]}
    assert {"sentence-transformers", "naive fifo-32", "tokenq (budget 16384)"} <= methods
    assert set(real["ratios"]) >= {"tokenq_over_st", "tokenq_over_ideal"}
    # Same model, same inputs: tokenq's vectors are sentence-transformers' vectors.
    assert real["config"]["min_cosine_tokenq_vs_st"] > 0.999
    assert {"tokenq (budget 16384)", "tokenq onnx (budget 16384)"} <= methods
    assert any(method.startswith("ideal onnx") for method in methods)
    assert real["config"]["min_cosine_tokenq_onnx_vs_st"] >= 0.9999
    assert real["ratios"]["onnx_over_torch"] > 0
    # Each worker process's resident high-water mark, and onnx's against torch's.
    peaks = {row["method"]: row["worker_peak_rss_mb"] for row in real["rows"]}
    assert peaks["tokenq (budget 16384)"] > 50 and peaks["tokenq onnx (budget 16384)"] > 50
    assert peaks["sentence-transformers"] is None  # in-process: not a worker's figure
    assert real["config"]["onnx_worker_peak_rss_over_torch"] > 0
    assert real["command"].endswith("--runtime onnx")


def test_real_compares_bf16_mixed_with_fp32(tmp_path: Path) -> None:
    """``real --dtype bf16-mixed``: the bf16-mixed rows beside fp32's, its vectors within
    0.9999 of sentence-transformers', the ratio (not its size) and the command to rerun it."""
    pytest.importorskip("sentence_transformers")
    from tokenq.worker.backends.hf.runtime import cpu_has_bf16_matmul

    if not cpu_has_bf16_matmul():
        pytest.skip("this CPU has no bf16 instructions: the worker refuses bf16-mixed")
    real = run_suite("real", tmp_path, 600.0, "tiny", "--dtype", "bf16-mixed")
    methods = {row["method"] for row in real["rows"]}
    assert "tokenq bf16-mixed (budget 16384)" in methods
    assert any(method.startswith("ideal bf16-mixed") for method in methods)
    assert real["config"]["min_cosine_tokenq_bf16-mixed_vs_st"] >= 0.9999
    assert real["ratios"]["bf16-mixed_over_torch"] > 0
    assert real["command"].endswith("--dtype bf16-mixed")


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["seed", "--runtime", "onnx"], "apply to real, mixed-latency, tenants, not 'seed'"),
        (["cpu", "--dtype", "bf16-mixed"], "apply to real, mixed-latency, tenants, not 'cpu'"),
        (["real", "--runtime", "onnx", "--dtype", "bf16-mixed"], "one of them with torch fp32"),
    ],
)
def test_a_variant_is_refused_where_it_cannot_run(flags: list[str], refusal: str) -> None:
    completed = subprocess.run(
        [sys.executable, str(RUN), *flags], capture_output=True, text=True, timeout=60,
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 2
    assert refusal in completed.stderr


def test_gpu_seed_runs_its_mix_through_a_real_worker_and_skips_without_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """scripts/bench/gpu_seed.py: on the CPU (its --device cpu), every request answered,
    every figure present; asked for CUDA on a machine without it, a skip, not a failure."""
    script = REPO_ROOT / "scripts" / "bench" / "gpu_seed.py"
    out = tmp_path / "gpu_seed.json"
    completed = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--dtype", "fp32", "--requests", "24",
         "--settings", "2048", "--processes", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=180, cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    (row,) = json.loads(out.read_text())
    assert row["setting"] == "fp32 2048 x2" and row["requests"] == 24
    assert (row["mix"], row["processes"]) == ("seed", 2)
    assert row["failed_requests"] == 0 and row["batches"] > 0
    assert 0 < row["device_busy"] <= 1.0
    assert row["worker_cpu_us"] > 0 and row["useful_tokens_per_s"] > 0
    # The same batches' forward alone, in the script's process (on a CPU, about as fast).
    assert row["forward_alone_tokens_per_s"] > 0
    assert row["end_to_end_over_forward"] == pytest.approx(
        row["useful_tokens_per_s"] / row["forward_alone_tokens_per_s"], rel=0.01)
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():  # its main here: a process would import torch again
        monkeypatch.syspath_prepend(str(script.parent))
        import gpu_seed

        capsys.readouterr()
        assert gpu_seed.main(["--requests", "4"]) == 0
        assert "no CUDA device; skipped" in capsys.readouterr().out


def test_path_steps_times_every_step_of_the_worker_path(tmp_path: Path) -> None:
    """scripts/bench/path_steps.py: each of its ten steps ran and took some time, and the
    batches it picked hold more than one row (the replay packs as the worker does)."""
    out = tmp_path / "steps.json"
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "bench" / "path_steps.py"),
         "--reads", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT / "scripts" / "bench",
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(out.read_text())
    steps = result["us_per_request"]
    assert [name.split()[0] for name in steps] == [str(n) for n in range(1, 11)]
    assert all(us > 0 for us in steps.values())
    assert result["total_us"] > 0 and result["rows_per_batch"] > 1


# Minutes of real workers and models: CI runs them; `-m 'not slow'` skips them.
pytestmark = pytest.mark.slow


def test_cache(tmp_path: Path) -> None:
    """The figures the result cache promises hold even at tiny size (docs/OPERATIONS.md)."""
    rows = run_suite("cache", tmp_path, 300.0)["rows"]
    re_embed, same, budget, full = rows
    assert re_embed["device_tokens_ratio"] <= 0.55 and re_embed["identical_vectors"] is True
    assert same["forward_rows_64_identical"] == 1
    assert budget["cache_bytes_over_budget"] == 0 and budget["cache_bytes"] > 0
    assert full["queue_refused_at_maxmemory"] == 0 and full["used_over_maxmemory"] is False


def test_tenants(tmp_path: Path) -> None:
    result = run_suite("tenants", tmp_path, 300.0)
    summary = {row["setting"]: row for row in result["rows"]}["summary"]
    assert {"b_p50_ratio", "share_equal_a", "share_equal_b", "share_3to1_a",
            "refused_other_tenant"} <= set(summary)
    assert summary["refused_other_tenant"] == 0
    assert summary["share_equal_a"] + summary["share_equal_b"] == pytest.approx(1, abs=0.002)
