"""Every ``tokenq`` command against a Redis that is not there: a clear line at once, a quick stop.

Each command is pointed at a closed port (nothing listens on it) with a
password in the URL. The long-running ones (``worker``, ``up``, ``serve``)
warn within seconds of starting, naming the URL with the password masked,
keep waiting for Redis, and exit within a few seconds of SIGTERM without
logging another retry after the stop. The one-shot ones exit 1 with one line
(docs/OPERATIONS.md, "When Redis is not there").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.redis_server import free_ports
from tests.support import SIM_FLAGS
from tokenq.shared.exit_codes import EXIT_FAILED, EXIT_OK

WARNED_WITHIN_S = 8.0
"""From the spawn to the first line naming the URL (the imports take most of it)."""
STOPPED_WITHIN_S = 3.0
"""From SIGTERM to the exit (a worker waiting for Redis stops at once; up stops its workers)."""


class Lines:
    """A process's stderr, read in a thread, each line with the time it came."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.got: list[tuple[float, str]] = []
        self._process = process
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._process.stderr is not None
        for line in self._process.stderr:
            self.got.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, wanted: Callable[[str], bool], timeout: float) -> float:
        """When the first line ``wanted`` accepts came; fail after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.got):
                if wanted(line):
                    return at
            time.sleep(0.05)
        raise AssertionError(f"no such line within {timeout}s; got: {self.text()}")

    def text(self) -> str:
        self._thread.join(timeout=5)
        return "\n".join(line for _, line in self.got)


@pytest.fixture
def closed_url() -> str:
    """A Redis URL with a password, on a port nothing listens on."""
    return f"redis://ops:secret@127.0.0.1:{free_ports()}/0"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENQ_")}
    return {**env, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def _start(spawn: Callable[..., subprocess.Popen[str]], tmp_path: Path,
           *args: str) -> tuple[subprocess.Popen[str], Lines, float]:
    started = time.monotonic()
    process = spawn([sys.executable, "-m", "tokenq.shared.cli", *args], env=_env(),
                    cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return process, Lines(process), started


def _masked(url: str) -> Callable[[str], bool]:
    shown = url.replace(":secret@", ":***@")
    return lambda line: f"cannot reach Redis at {shown}" in line or (
        f"Redis at {shown} is unreachable" in line)


def _stop(process: subprocess.Popen[str]) -> float:
    """SIGTERM ``process``; the seconds it took to exit."""
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    return time.monotonic() - sent


def _no_retry_after_stopping(text: str) -> None:
    lines = text.splitlines()
    stopping = [i for i, line in enumerate(lines) if "stopping" in line]
    assert stopping, text
    assert not any("retrying" in line for line in lines[stopping[0]:]), text


@pytest.mark.parametrize(("command", "args"), [
    ("worker", SIM_FLAGS),
    ("up", ("--workers", "1", "--backend", "sim")),
])
def test_a_worker_names_the_absent_redis_at_once_waits_and_stops_at_once(
    command: str, args: tuple[str, ...], closed_url: str, spawn, tmp_path: Path,
) -> None:
    process, lines, started = _start(spawn, tmp_path, command, *args, "--redis-url", closed_url)
    assert lines.wait_for(_masked(closed_url), WARNED_WITHIN_S) - started < WARNED_WITHIN_S
    # It keeps waiting for Redis, with backoff: a second try is reported too.
    lines.wait_for(lambda line: "retrying in 1.0s" in line, WARNED_WITHIN_S)
    assert process.poll() is None
    assert _stop(process) < STOPPED_WITHIN_S
    assert process.returncode == EXIT_OK
    text = lines.text()
    assert "secret" not in text and "Traceback" not in text
    _no_retry_after_stopping(text)


def test_the_gateway_names_the_absent_redis_at_once_and_stops_at_once(
    closed_url: str, spawn, tmp_path: Path,
) -> None:
    process, lines, started = _start(spawn, tmp_path, "serve", "--port", str(free_ports()),
                                     "--redis-url", closed_url)
    at = lines.wait_for(_masked(closed_url), WARNED_WITHIN_S)
    assert at - started < WARNED_WITHIN_S
    assert process.poll() is None  # it serves 503s until Redis answers
    assert _stop(process) < STOPPED_WITHIN_S
    text = lines.text()
    assert "secret" not in text and "Traceback" not in text
    assert "every route answers 503" in text


@pytest.mark.parametrize("argv", [
    ["stats"], ["top", "--once"], ["top", "--json"], ["dlq", "list"], ["functions", "load"],
    ["quotas", "show"],
    ["embed", "in.txt", "--output", "out.jsonl"],
], ids=" ".join)
def test_a_one_shot_command_exits_1_with_one_line(
    argv: list[str], closed_url: str, tmp_path: Path,
) -> None:
    (tmp_path / "in.txt").write_text("hello\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tokenq.shared.cli", *argv,
                           "--redis-url", closed_url], env=_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < WARNED_WITHIN_S
    assert done.returncode == EXIT_FAILED, done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
    assert _masked(closed_url)(done.stderr) and done.stderr.startswith(f"tokenq {argv[0]}: ")
