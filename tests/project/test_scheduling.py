"""The xdist scheduler's tables (``tests/scheduling.py``) name modules and tests that exist.

A renamed module or test would silently leave the table: its fixtures built on both
processes again, or a slow test sent last. So each name is checked here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("xdist")
from tests.scheduling import (
    SHARED_FIXTURE_MODULES,
    SHARED_FIXTURE_TESTS,
    SLOW_FIRST,
    rank,
    unit_of,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


def functions_of(module: str) -> set[str]:
    tree = ast.parse((REPO_ROOT / module).read_text())
    return {
        node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def test_every_named_module_and_test_exists() -> None:
    for module in SHARED_FIXTURE_MODULES:
        assert (REPO_ROOT / module).is_file(), module
    for nodeid in SHARED_FIXTURE_TESTS:
        module, name = nodeid.split("::")
        assert name in functions_of(module), nodeid
    for prefix in SLOW_FIRST:
        module, _, name = prefix.partition("::")
        assert (REPO_ROOT / module).exists(), prefix
        if name:
            assert any(function.startswith(name) for function in functions_of(module)), prefix


def test_a_shared_fixture_module_is_one_unit_and_other_tests_their_own() -> None:
    assert (
        unit_of("tests/models/test_e2e_models.py::test_a[x]") == "tests/models/test_e2e_models.py"
    )
    assert unit_of("tests/shared/test_wire.py::test_b[y]") == "tests/shared/test_wire.py::test_b[y]"
    scale = unit_of("tests/project/test_bench_smoke.py::test_scale")
    assert unit_of("tests/project/test_bench_smoke.py::test_plots_from_results") == scale
    assert rank("tests/models/test_e2e_models.py") < rank("tests/shared/test_wire.py::test_b")
