"""The layout's rules, checked on the source (docs/ARCHITECTURE.md, "Rules").

* ``producer`` and ``worker`` never import each other; ``shared`` imports neither;
* no module imports a private name (``_x``) of another package;
* torch (and transformers) stay out of the producer and the operator commands.

Imports are read from the syntax tree, function-level ones included, so a
lazy import cannot slip past.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
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


def test_the_source_tree_is_found() -> None:
    found = {name for name, _, _ in modules()}
    assert {"tokenq.producer.client", "tokenq.worker.loop", "tokenq.shared.wire"} <= found


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
