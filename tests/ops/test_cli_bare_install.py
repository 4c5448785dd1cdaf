"""``tokenq`` on an install without extras: every ``--help`` works, a missing extra is one line.

A fresh venv without extras is slow to build, so a bare install is simulated
in each subprocess (:mod:`tests.blocked_imports`): a finder first on
``sys.meta_path`` refuses every installed distribution outside
tokenq's own requirements (its installed metadata's, less the extras, and
what they require), so a dependency added to an extra is blocked without an edit
here. The commands come from the dispatcher's table, so a new one is covered.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import distribution, packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.blocked_imports import blocking_env
from tests.redis_server import free_ports
from tokenq.shared.cli import SUBCOMMANDS
from tokenq.shared.exit_codes import EXIT_FAILED, EXIT_USAGE

ALWAYS_THERE = ("pip", "setuptools", "wheel")
"""Distributions a bare install has too: the installers."""

def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _base_distributions() -> set[str]:
    """tokenq, what it requires and everything that requires, extras left out."""
    todo = [Requirement("tokenq")]
    found: set[str] = set()
    while todo:
        requirement = todo.pop()
        name = _normal(requirement.name)
        if name in found or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        found.add(name)
        todo += [Requirement(line) for line in distribution(name).requires or []]
    return found | {_normal(name) for name in ALWAYS_THERE}


def _blocked_modules() -> set[str]:
    """Every installed top-level module no distribution of a bare install provides."""
    base = _base_distributions()
    return {module for module, dists in packages_distributions().items()
            if not any(_normal(dist) in base for dist in dists)}


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a subprocess that sees tokenq as a bare install would."""
    blocked = _blocked_modules()
    assert {"numpy", "torch", "rich", "uvicorn"} <= blocked  # the premise: extras are out
    assert not {"redis", "msgpack", "pydantic", "pydantic_settings"} & blocked
    return blocking_env(tmp_path_factory.mktemp("bare"), blocked)


def _tokenq(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenq.shared.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_the_simulation_really_hides_the_extras(bare_env: dict[str, str], tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import numpy"], env=bare_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "No module named 'numpy'" in done.stderr
    done = subprocess.run([sys.executable, "-c", "import redis, msgpack, pydantic_settings"],
                          env=bare_env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_help_of_every_command_works_on_a_bare_install(
    name: str, bare_env: dict[str, str], tmp_path: Path,
) -> None:
    done = _tokenq(bare_env, tmp_path, name, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: tokenq {name} ")
    assert "TOKENQ_REDIS_URL" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr


def _closed_url() -> str:
    return f"redis://ops:secret@127.0.0.1:{free_ports()}/0"


RUN_ARGV: dict[str, list[str]] = {
    "worker": ["--backend", "sim"],
    "up": ["--workers", "1", "--backend", "sim"],
    "embed": ["in.txt", "--output", "out.npy"],
    "top": [],
    "serve": ["--port", "0"],
}
"""How to run each command that needs an extra, far enough to need it."""


@pytest.mark.parametrize("name", [name for name, command in SUBCOMMANDS.items() if command.extra])
def test_a_command_without_its_extra_says_which_in_one_line(
    name: str, bare_env: dict[str, str], tmp_path: Path,
) -> None:
    (tmp_path / "in.txt").write_text("hello\n")
    extra = SUBCOMMANDS[name].extra
    done = _tokenq(bare_env, tmp_path, name, *RUN_ARGV[name], "--redis-url", _closed_url())
    assert done.returncode == EXIT_USAGE, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"tokenq {name}")
    assert f"pip install 'tokenq[{extra}]'" in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("argv", [["stats"], ["dlq", "list"], ["functions", "load"],
                                  ["quotas", "show"]],
                         ids=lambda argv: argv[0])
def test_a_command_that_needs_no_extra_runs_on_a_bare_install(
    argv: list[str], bare_env: dict[str, str], tmp_path: Path,
) -> None:
    assert SUBCOMMANDS[argv[0]].extra is None
    url = _closed_url()
    done = _tokenq(bare_env, tmp_path, *argv, "--redis-url", url)
    assert done.returncode == EXIT_FAILED, done.stderr
    assert done.stderr.startswith(f"tokenq {argv[0]}: cannot reach Redis at ")
    assert "ops:***@" in done.stderr and "secret" not in done.stderr
    assert "Traceback" not in done.stderr
