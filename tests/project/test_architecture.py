"""The layout's rules, checked on the source (docs/ARCHITECTURE.md, "Rules").

* ``producer`` and ``worker`` never import each other; ``shared`` imports neither;
* a lower layer imports nothing above it on its side: a backend imports no part
  of the worker outside ``worker/backends/`` (table ``LAYERS``);
* no module imports a private name (``_x``) of another package;
* torch (and transformers) stay out of the producer and the operator commands;
* exit codes (``EXIT_*``) are defined once, in ``shared/exit_codes.py``;
* docs/ARCHITECTURE.md holds its two recipes, and every repository path it
  names exists (so the map and the recipes cannot name a file that moved).

Imports are read from the syntax tree, function-level ones included, so a
lazy import cannot slip past.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SIDES = ("producer", "worker", "shared")


def modules() -> Iterator[tuple[str, str, Path]]:
    """(dotted module name, its package, path) of every module of the three sides."""
    for side in SIDES:
        for path in sorted((REPO / side).rglob("*.py")):
            parts = ["tokenq", *path.relative_to(REPO).with_suffix("").parts]
            package = ".".join(parts[:-1])
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, package, path


def imports(path: Path) -> Iterator[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every import statement in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.module, alias.name, node.lineno


def side_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "tokenq" and parts[1] in SIDES else None


def package_of(module: str) -> str:
    """The package a module belongs to (itself, for a package's ``__init__``)."""
    for side in SIDES:
        if module == f"tokenq.{side}":
            return module
    path = REPO / Path(*module.split(".")[1:])
    return module if path.is_dir() else module.rsplit(".", 1)[0]


@pytest.mark.unit
def test_the_source_tree_is_found() -> None:
    found = {name for name, _, _ in modules()}
    assert {"tokenq.producer.client", "tokenq.worker.loop.worker", "tokenq.shared.wire"} <= found


@pytest.mark.unit
@pytest.mark.parametrize(("importer", "forbidden"), [
    ("producer", {"worker"}), ("worker", {"producer"}), ("shared", {"producer", "worker"}),
])
def test_sides_do_not_import_each_other(importer: str, forbidden: set[str]) -> None:
    crossings = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for name, _, path in modules() if side_of(name) == importer
        for module, _, line in imports(path) if side_of(module) in forbidden
    ]
    assert crossings == []


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def resolved_imports(path: Path, package: str) -> Iterator[tuple[str, int]]:
    """(absolute module, line) for every import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # ``from pkg import mod`` may name a module: count it as imported too.
            yield from ((f"{module}.{alias.name}", node.lineno) for alias in node.names)


# (modules under, the part of their side they look into, what of it they may import)
LAYERS = [
    ("tokenq.worker.backends", "tokenq.worker", "tokenq.worker.backends"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("lower", "side", "allowed"), LAYERS)
def test_lower_layers_do_not_import_upward(lower: str, side: str, allowed: str) -> None:
    upward = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for name, package, path in modules() if under(name, lower)
        for module, line in resolved_imports(path, package)
        if under(module, side) and not under(module, allowed)
    ]
    assert upward == []


@pytest.mark.unit
def test_no_module_imports_a_private_name_of_another_package() -> None:
    private = []
    for _, package, path in modules():
        for module, name, line in imports(path):
            if side_of(module) is None:
                continue
            target = package_of(module)
            leaf = module.rsplit(".", 1)[-1]
            names = [leaf] if module != target else []
            if name is not None:
                names.append(name)
            if target != package and any(n.startswith("_") and n != "__future__" for n in names):
                private.append(f"{path.relative_to(REPO)}:{line} imports {module} {name or ''}")
    assert private == []



@pytest.mark.unit
def test_exit_codes_are_defined_only_in_their_home() -> None:
    """``EXIT_*`` numbers live in ``shared/exit_codes.py``; a second copy drifts from it."""
    home = REPO / "shared" / "exit_codes.py"
    again = []
    for _, _, path in modules():
        if path == home:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in tree.body:
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            again += [f"{path.relative_to(REPO)}:{node.lineno} defines {target.id}"
                      for target in targets
                      if isinstance(target, ast.Name) and target.id.startswith("EXIT_")]
    assert again == []


ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
RECIPES = ("## Recipe: adding an option end to end", "## Recipe: adding a backend")
TOP_LEVEL = ("producer/", "worker/", "shared/", "tests/", "docs/", "docker/", "scripts/")
TOP_FILES = ("setup.py", "pyproject.toml", "README.md")


def named_paths(text: str) -> list[str]:
    """Every repository path in backticks: a top-level file, or a path under a top-level
    folder (``tests/x.py:name`` names a file too; a glob such as ``*/lua/`` is not a path)."""
    paths = []
    for quoted in re.findall(r"`([^`\s]+)`", text):
        path = quoted.split(":", 1)[0]
        if path in TOP_FILES or (path.startswith(TOP_LEVEL) and "*" not in path):
            paths.append(path)
    return paths


@pytest.mark.unit
def test_the_architecture_page_holds_both_recipes() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert [recipe for recipe in RECIPES if recipe not in text] == []
    backend = text.split(RECIPES[1], 1)[1]
    # The plugin walk-through names its example and its test.
    assert "`tests/plugins_for_tests.py`" in backend
    assert "`tests/worker/test_backend_settings.py`" in backend


@pytest.mark.unit
def test_every_path_the_architecture_page_names_exists() -> None:
    named = named_paths(ARCHITECTURE.read_text(encoding="utf-8"))
    assert len(named) > 50  # the map names files; an empty list means the pattern broke
    assert sorted({path for path in named if not (REPO / path).exists()}) == []


OPERATOR_MODULES = [
    "tokenq.producer",
    "tokenq.producer.ops.stats",
    "tokenq.producer.ops.top",
    "tokenq.producer.ops.dlq",
    "tokenq.producer.ops.embed",
    "tokenq.shared.cli",
]


def test_torch_stays_out_of_the_producer_and_the_operator_commands() -> None:
    names = [name for name, _, _ in modules() if side_of(name) in ("producer", "shared")]
    assert set(OPERATOR_MODULES) <= set(names)
    probe = (
        "import importlib, json, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
