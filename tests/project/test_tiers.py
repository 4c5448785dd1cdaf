"""The test tiers hold: the unit tier's guard refuses processes, and the shared and
producer tests collect on an install without the model libraries."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis

from tests import redis_server
from tests.blocked_imports import blocking_env
from tests.conftest import REPO_ROOT
from tests.redis_server import free_ports

MODEL_LIBRARIES = ("torch", "transformers", "tokenizers")


UNUSED_PLUGINS = ("-p", "no:cacheprovider", "-p", "no:langsmith_plugin", "-p", "no:schemathesis",
                  "-p", "no:anyio")
"""pyproject.toml's addopts, for a run outside the checkout too (a second of imports each)."""


def _pytest(args: list[str], env: dict[str, str] | None = None,
            cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", *UNUSED_PLUGINS, *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def test_shared_and_producer_tests_collect_without_the_model_libraries(tmp_path: Path) -> None:
    env = blocking_env(tmp_path / "bare", MODEL_LIBRARIES)
    hidden = subprocess.run([sys.executable, "-c", "import torch"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert "No module named 'torch'" in hidden.stderr  # the premise
    done = _pytest(["--collect-only", "-q", "tests/shared", "tests/producer"], env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^\d+ tests collected in ", done.stdout, re.MULTILINE), done.stdout[-3000:]


_UNIT_TESTS = '''
import re
import socket
import subprocess
import sys

import pytest


@pytest.fixture
def redis_server():
    raise AssertionError("the guard lets a unit test set up a process fixture")


@pytest.fixture
def redis_url(redis_server):
    return "redis://127.0.0.1:1/0"


@pytest.mark.unit
def test_asks_for_a_server(redis_url):
    pass


@pytest.mark.unit
def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"])


@pytest.mark.unit
def test_connects_over_tcp():
    import socket
    socket.create_connection(("127.0.0.1", 1), timeout=1)


@pytest.mark.unit
def test_pure():
    assert sum(range(4)) == 6


def test_not_unit_may_start_one():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
'''


def test_the_unit_guard_fails_a_unit_test_that_starts_a_process(tmp_path: Path) -> None:
    (tmp_path / "test_guarded.py").write_text(textwrap.dedent(_UNIT_TESTS))
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    done = _pytest(["-p", "tests.unit_tier", "-p", "no:warnings", "-rA", "-q", "test_guarded.py"],
                   env, tmp_path)
    out = done.stdout
    assert "2 failed, 2 passed, 1 error" in out, out
    assert "test_asks_for_a_server is marked 'unit' but uses redis_server" in out, out
    assert "may not start a subprocess" in out, out
    assert "may not connect over TCP" in out, out
    assert "PASSED test_guarded.py::test_pure" in out, out
    assert "PASSED test_guarded.py::test_not_unit_may_start_one" in out, out


def test_a_redis_server_whose_chosen_port_is_taken_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two test processes may pick the same free port: the server that finds it taken
    starts again on another (and answers with its own pid there)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = iter([taken, free_ports()])
        monkeypatch.setattr(redis_server, "free_port", lambda: next(ports))
        server = redis_server.RedisServer(tmp_path / "moved")
        assert server.port == taken
        server.start()
        try:
            assert server.port != taken
            with redis.Redis(port=server.port) as client:
                assert server.process is not None
                assert int(client.info("server")["process_id"]) == server.process.pid
        finally:
            server.stop()
