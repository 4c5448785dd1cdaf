"""Helpers the operator-command tests share (fixtures are in tests/cli_fixtures.py).

The sim worker's shape and ``wait_for`` live in :mod:`tests.support`; they are
named here too for the test files that still import them from this module.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable

from tests.support import DIM, FAST_BEAT, MAX_INPUT, SIM_FLAGS, StartWorker, wait_for

__all__ = ["DIM", "FAST_BEAT", "MAX_INPUT", "SIM_FLAGS", "StartWorker", "interrupted_at",
           "tokenq", "wait_for"]

def tokenq(*args: str, env: dict[str, str] | None = None, timeout: float = 120.0,
           stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``tokenq ARGS`` in a subprocess (the console script's own entry point)."""
    return subprocess.run(
        [sys.executable, "-m", "tokenq.shared.cli", *args], env=env, capture_output=True,
        text=stdin is None, timeout=timeout, input=stdin,
    )


def interrupted_at(args: list[str], env: dict[str, str], sig: signal.Signals,
                   when: Callable[[], None]) -> tuple[int, str]:
    """Run ``tokenq ARGS``, send it ``sig`` once ``when()`` returns; (exit status, stderr).

    The process is killed (and reaped) should it outlive the test's checks.
    """
    process = subprocess.Popen([sys.executable, "-m", "tokenq.shared.cli", *args],
                               env=env, stderr=subprocess.PIPE, text=True)
    try:
        when()
        process.send_signal(sig)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, err
