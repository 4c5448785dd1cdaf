"""The wheel built from this checkout holds all of tokenq and serves requests on its own.

The editable install maps ``tokenq.producer`` (and the others) onto the
checkout's folders, so a module or Lua script the wheel leaves out still
imports in development and fails only for users. These tests build the
wheel from a copy of the checkout (``--no-build-isolation``: offline, the
venv's setuptools), check its file list against the checkout, install it
into a bare folder and run a sim worker and a producer from that folder
alone: ``python -S`` (no site-packages, so no editable-install hook), the
venv's site-packages on ``PYTHONPATH`` for the dependencies only, a
temporary working directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.cli_support import DIM, SIM_FLAGS
from tests.conftest import REPO_ROOT
from tokenq.shared import keys

ROOTS = ("producer", "worker", "shared")
"""The checkout's folders that install as ``tokenq.<folder>``."""

SOURCES = ("pyproject.toml", "setup.py", "README.md", *ROOTS)
"""What building needs; copied, so the build writes nothing into the checkout."""

_PIP_ENV = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}


def _pip(*args: str, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **_PIP_ENV})
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the checkout's packaging files and package folders."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    for name in SOURCES:
        origin = REPO_ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(origin, source / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"), str(source),
         cwd=work)
    (built,) = (work / "dist").glob("tokenq-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path) -> Path:
    """The folder the wheel was installed into (``pip install --target``), nothing else."""
    target = wheel.parent.parent / "site"
    _pip("install", "--no-deps", "--target", str(target), str(wheel), cwd=wheel.parent)
    return target


def _checkout_files() -> set[str]:
    """Every module, Lua script and typing marker of the checkout, named as in the wheel."""
    found = set()
    for root in ROOTS:
        for path in (REPO_ROOT / root).rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            relative = path.relative_to(REPO_ROOT).as_posix()
            if path.suffix in (".py", ".lua") or path.name == "py.typed":
                found.add(f"tokenq/{relative}")
    return found


def test_the_wheel_holds_every_module_and_lua_script_of_the_checkout(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(name).decode() for name in names
                            if name.endswith(".dist-info/entry_points.txt"))
    expected = _checkout_files()
    assert any(name.endswith(".lua") for name in expected)  # the walk found the scripts
    assert sorted(expected - names) == []
    strays = [name for name in names
              if not name.startswith(("tokenq/", "tokenq-")) or "__pycache__" in name]
    assert strays == []  # no tests, scripts or top-level folders of the checkout
    assert "tokenq = tokenq.shared.cli:main" in entry_points


_CLIENT = """
import json, sys, tokenq.producer, tokenq.shared, tokenq.worker
from tokenq.producer import Client

site = sys.argv[1]
with Client(redis_url=sys.argv[2], queue=sys.argv[3]) as client:
    result = client.infer("served from the wheel alone", timeout_s=60)
files = sorted({m.__file__ for n, m in sys.modules.items()
                if n.startswith("tokenq.") and getattr(m, "__file__", None)})
print(json.dumps({"dim": result.dim, "files": files, "outside": [
    f for f in files if not f.startswith(site)]}))
"""


def _bare_env(target: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a ``python -S`` run that finds tokenq only in ``target``."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("PYTHON", "TOKENQ_"))}
    paths = sysconfig.get_paths()
    dependencies = dict.fromkeys([paths["purelib"], paths["platlib"]])  # the same in most venvs
    env.update(PYTHONPATH=os.pathsep.join([str(target), *dependencies]), PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(extra or {}))
    return env


def test_the_installed_wheel_alone_serves_a_request(
    installed: Path, tmp_path: Path, redis_url: str, r: redis.Redis, queue_name: str,
    spawn: Callable[..., subprocess.Popen],
) -> None:
    script = installed / "bin" / "tokenq"
    assert script.is_file()  # the console script came with it
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    log = (tmp_path / "worker.log").open("wb")
    env = _bare_env(installed, {"TOKENQ_REDIS_URL": redis_url, "TOKENQ_QUEUE": queue_name})
    worker = spawn([sys.executable, "-S", str(script), "worker", "--consumer", "w", *SIM_FLAGS],
                   cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not r.exists(keys.worker_alive(keys.QueueRef(queue_name), "w")):
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
            time.sleep(0.05)
        done = subprocess.run(
            [sys.executable, "-S", "-c", _CLIENT, str(installed), redis_url, queue_name],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["dim"] == DIM
        assert report["files"] and report["outside"] == []
        worker.terminate()
        assert worker.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()
    finally:
        log.close()
