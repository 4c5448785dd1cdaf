"""Helpers the operator-command tests share (fixtures are in tests/cli_fixtures.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

from tests.workers import WorkerProcess

DIM = 32
MAX_INPUT = 2048
SIM_FLAGS = ("--backend", "sim", "--sim-dim", str(DIM), "--sim-max-input-tokens", str(MAX_INPUT))
FAST_BEAT = ("--heartbeat-s", "0.5")

StartWorker = Callable[..., WorkerProcess]


def tokenq(*args: str, env: dict[str, str] | None = None, timeout: float = 120.0,
           stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``tokenq ARGS`` in a subprocess (the console script's own entry point)."""
    return subprocess.run(
        [sys.executable, "-m", "tokenq.shared.cli", *args], env=env, capture_output=True,
        text=stdin is None, timeout=timeout, input=stdin,
    )


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
