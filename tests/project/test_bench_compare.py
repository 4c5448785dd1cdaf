"""``run.py SUITE --baseline REV``: the ratios it reports, and that it cleans up after itself.

Why: a comparison is read as "this change made X n % faster", so the
arithmetic (medians per side, rows matched by setting, no ratio to a zero or
a missing baseline) must be right, and a comparison must never leave a git
worktree or a benchmark process behind. The pure part is driven with
hand-made suite results; one slow test runs the whole thing on ``cpu``.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "scripts" / "bench"
RUN = BENCH_DIR / "run.py"
sys.path.insert(0, str(BENCH_DIR))

import compare  # noqa: E402  (scripts/bench is not a package)


def result(*rows: dict[str, Any], columns: list[str] | None = None) -> dict[str, Any]:
    """A suite result as run.py writes it, with only what a comparison reads."""
    return {"columns": columns or ["setting", "rps", "p99_ms"], "rows": list(rows)}


def by_key(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(row["setting"], row["figure"]): row for row in rows}


@pytest.fixture
def own_worktree_list(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The repository's worktree list to this test alone: the tests that compare it before
    and after take this lock in turn, whichever xdist process runs them."""
    lock = tmp_path_factory.getbasetemp().parent / "git-worktrees.lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def worktrees() -> set[str]:
    listed = subprocess.run(
        ["git", "worktree", "list", "--porcelain"], cwd=REPO_ROOT,
        capture_output=True, text=True, check=True,
    ).stdout
    return {line.split(" ", 1)[1] for line in listed.splitlines() if line.startswith("worktree ")}


# ------------------------------------------------------------------ pure part


@pytest.mark.unit
def test_ratio_is_current_over_baseline() -> None:
    assert compare.ratio(200.0, 250.0) == 1.25
    assert compare.ratio(4, 2) == 0.5


@pytest.mark.unit
@pytest.mark.parametrize(
    ("baseline", "current"),
    [(0, 5.0), (0.0, 0.0), (None, 5.0), (5.0, None), ("fast", 5.0), (True, 1.0),
     (float("nan"), 1.0), (1.0, float("inf"))],
)
def test_no_ratio_without_two_numbers_and_a_nonzero_baseline(
    baseline: object, current: object
) -> None:
    assert compare.ratio(baseline, current) is None  # type: ignore[arg-type]


@pytest.mark.unit
def test_only_finite_non_bool_numbers_are_figures() -> None:
    assert compare.is_figure(3) and compare.is_figure(0.5) and compare.is_figure(0)
    for value in (None, True, False, "3", [1], {"a": 1}, float("nan"), float("inf")):
        assert not compare.is_figure(value), value


@pytest.mark.unit
def test_each_side_is_the_median_of_its_rounds() -> None:
    base = [result({"setting": "a", "rps": v, "p99_ms": 10.0}) for v in (100.0, 300.0, 110.0)]
    current = [result({"setting": "a", "rps": v, "p99_ms": 8.0}) for v in (120.0, 121.0)]
    rows = by_key(compare.compare(base, current))
    assert rows["a", "rps"]["baseline"] == 110.0  # the slow-machine outlier is dropped
    assert rows["a", "rps"]["current"] == 120.5
    assert rows["a", "rps"]["ratio"] == round(120.5 / 110.0, 4)
    assert rows["a", "p99_ms"]["ratio"] == 0.8


@pytest.mark.unit
def test_rows_are_matched_by_setting_not_by_position() -> None:
    base = [result({"setting": "x", "rps": 10.0}, {"setting": "y", "rps": 20.0})]
    current = [result({"setting": "y", "rps": 40.0}, {"setting": "x", "rps": 5.0})]
    rows = by_key(compare.compare(base, current))
    assert rows["x", "rps"]["ratio"] == 0.5
    assert rows["y", "rps"]["ratio"] == 2.0
    assert [row["setting"] for row in compare.compare(base, current)] == ["y", "x"]


@pytest.mark.unit
def test_rows_are_keyed_by_the_first_column_whatever_its_name() -> None:
    base = [result({"workers": 1, "rps": 10.0}, {"workers": 2, "rps": 18.0},
                   columns=["workers", "rps"])]
    current = [result({"workers": 2, "rps": 27.0}, columns=["workers", "rps"])]
    rows = by_key(compare.compare(base, current))
    assert rows["2", "rps"]["ratio"] == 1.5
    assert "workers" not in {figure for _, figure in rows}  # the key is not a figure


@pytest.mark.unit
def test_a_repeated_setting_is_told_apart_not_merged() -> None:
    run = result({"setting": "a", "rps": 1.0}, {"setting": "a", "rps": 2.0})
    assert list(compare.keyed_rows(run)) == ["a", "a #2"]


@pytest.mark.unit
def test_a_setting_on_one_side_only_is_listed_without_a_ratio_and_noted() -> None:
    base = [result({"setting": "old", "rps": 10.0}, {"setting": "both", "rps": 1.0})]
    current = [result({"setting": "new", "rps": 12.0}, {"setting": "both", "rps": 1.0})]
    rows = by_key(compare.compare(base, current))
    assert rows["old", "rps"] == {"setting": "old", "figure": "rps", "baseline": 10.0,
                                  "current": None, "ratio": None}
    assert rows["new", "rps"]["baseline"] is None and rows["new", "rps"]["ratio"] is None
    assert compare.unmatched(base, current) == ["only in baseline: old", "only in current: new"]


@pytest.mark.unit
def test_missing_and_non_numeric_values_are_skipped_not_counted_as_zero() -> None:
    base = [
        result({"setting": "a", "rps": 10.0, "p99_ms": None, "note": "warm", "ok": True,
                "commands": {"get": 3}}),
        result({"setting": "a", "rps": 30.0, "p99_ms": 4.0}),
        result({"setting": "a", "rps": None}),
    ]
    current = [result({"setting": "a", "rps": 40.0, "p99_ms": "n/a"})]
    rows = by_key(compare.compare(base, current))
    assert rows["a", "rps"]["baseline"] == 20.0  # median of 10 and 30; None is not a round
    assert rows["a", "p99_ms"]["baseline"] == 4.0
    assert rows["a", "p99_ms"]["current"] is None and rows["a", "p99_ms"]["ratio"] is None
    assert {figure for _, figure in rows} == {"rps", "p99_ms"}


@pytest.mark.unit
def test_a_zero_baseline_keeps_both_values_and_gives_no_ratio() -> None:
    base = [result({"setting": "a", "failed": 0})]
    current = [result({"setting": "a", "failed": 3})]
    assert compare.compare(base, current) == [
        {"setting": "a", "figure": "failed", "baseline": 0, "current": 3, "ratio": None}
    ]


@pytest.mark.unit
def test_figures_follow_the_suite_columns_then_the_other_keys() -> None:
    run = result({"setting": "a", "extra": 1.0, "p99_ms": 2.0, "rps": 3.0},
                 columns=["setting", "rps", "p99_ms"])
    figures = [row["figure"] for row in compare.compare([run], [run])]
    assert figures == ["rps", "p99_ms", "extra"]


@pytest.mark.unit
def test_the_table_writes_each_setting_once_and_dashes_for_nothing() -> None:
    rows = compare.compare(
        [result({"setting": "a", "rps": 1000.0, "p99_ms": 0})],
        [result({"setting": "a", "rps": 1500.0, "p99_ms": 2.5})],
    )
    lines = compare.format_comparison(rows).splitlines()
    assert lines[0].split() == compare.COLUMNS
    assert lines[2].split() == ["a", "rps", "1,000", "1,500", "1.500"]
    assert lines[3].split() == ["p99_ms", "0", "2.5", "-"]


def test_a_rev_that_is_not_a_commit_is_refused() -> None:
    with pytest.raises(compare.CompareError, match="not a commit"):
        compare.resolve_commit("no-such-branch-anywhere")
    with pytest.raises(compare.CompareError, match="not a commit"):
        compare.resolve_commit("HEAD^{tree}")
    assert compare.resolve_commit("HEAD") == subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()


# ------------------------------------------------------------ through run.py


@pytest.mark.usefixtures("own_worktree_list")
def test_run_py_refuses_a_bad_rev_in_one_line_and_creates_nothing() -> None:
    before = worktrees()
    completed = subprocess.run(
        [sys.executable, str(RUN), "overhead", "--size", "tiny", "--baseline", "nope^^^"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines() == [
        f"run.py: error: --baseline 'nope^^^' is not a commit in {REPO_ROOT}"
    ]
    assert worktrees() == before


@pytest.mark.usefixtures("own_worktree_list")
def test_the_baseline_imports_its_own_tree_and_the_worktree_goes_away() -> None:
    before = worktrees()
    with compare.baseline_tree(compare.resolve_commit("HEAD")) as (tree, overlay):
        assert str(tree) in worktrees()
        compare.check_imports("baseline", compare.side_env(overlay), tree)
        with pytest.raises(compare.CompareError, match="resolves to"):
            compare.check_imports("current", compare.side_env(None), tree)
        compare.check_imports("current", compare.side_env(None), REPO_ROOT)
    assert worktrees() == before
    assert not tree.exists() and not overlay.exists()


@pytest.mark.usefixtures("own_worktree_list")
def test_the_worktree_goes_away_when_the_comparison_fails() -> None:
    before = worktrees()
    with pytest.raises(RuntimeError), compare.baseline_tree(compare.resolve_commit("HEAD")):
        raise RuntimeError("a suite failed")
    assert worktrees() == before


@pytest.mark.usefixtures("own_worktree_list")
@pytest.mark.slow
def test_a_suite_against_head_end_to_end(tmp_path: Path) -> None:
    """One round of each side of the ``cpu`` suite at tiny size (the shortest suite with
    real workers and Redis: ~6 s on the 2-core box, where ``overhead`` took 25)."""
    before = worktrees()
    out = tmp_path / "compare.json"
    process = subprocess.Popen(
        [sys.executable, str(RUN), "cpu", "--size", "tiny", "--baseline", "HEAD",
         "--rounds", "1", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
    )
    try:
        output, _ = process.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        process.terminate()  # SIGTERM: run.py stops its runs and removes the worktree
        output, _ = process.communicate(timeout=120)
        pytest.fail(f"no comparison in 150 s (a baseline that hangs?):\n{output}")
    finally:
        assert worktrees() == before
    assert process.returncode == 0, output
    assert "vs baseline HEAD" in output
    record = json.loads(out.read_text())
    assert len(record["baseline"]["runs"]) == len(record["current"]["runs"]) == 1
    assert record["baseline"]["commit"] == compare.resolve_commit("HEAD")
    rows = by_key(record["rows"])
    worker = rows["worker", "cpu_us_per_request"]
    assert worker["baseline"] > 0 and worker["current"] > 0
    assert worker["ratio"] == round(worker["current"] / worker["baseline"], 4)
    settings = {row["setting"] for row in record["current"]["runs"][0]["rows"]}
    assert settings <= {setting for setting, _ in rows}


BASELINE_PYPROJECT = """
[project]
dependencies = ["redis>=5", "pydantic-settings>=2.3"]
[project.optional-dependencies]
worker = ["torch>=2.1"]
"""
CURRENT_PYPROJECT = """
[project]
dependencies = ["redis>=5", "pydantic-settings>=2.3", "hiredis>=2.0 ; python_version >= '3.8'"]
[project.optional-dependencies]
worker = ["torch>=2.1", "Zope.Interface[extra]"]
"""


@pytest.mark.unit
def test_the_libraries_only_the_current_tree_declares_are_found_by_import_name() -> None:
    assert compare.declared_libraries(BASELINE_PYPROJECT) == {"redis", "pydantic_settings", "torch"}
    assert compare.newly_declared(BASELINE_PYPROJECT, CURRENT_PYPROJECT) == [
        "hiredis", "zope_interface",
    ]


def test_a_library_the_baseline_did_not_declare_cannot_be_imported_on_its_side(
    tmp_path: Path,
) -> None:
    tree, overlay = tmp_path / "tree", tmp_path / "overlay"
    tree.mkdir()
    overlay.mkdir()
    (tree / "pyproject.toml").write_text(
        (compare.REPO_ROOT / "pyproject.toml").read_text().replace('"hiredis', '"not-hiredis')
    )
    compare.hide_undeclared(tree, overlay)
    assert compare.hidden_libraries(overlay) == ["hiredis"]
    env = compare.side_env(overlay)
    probe = "import redis.utils, sys; sys.exit(0 if not redis.utils.HIREDIS_AVAILABLE else 3)"
    assert subprocess.run([sys.executable, "-c", probe], env=env).returncode == 0
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 3
