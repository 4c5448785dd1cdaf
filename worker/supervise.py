"""Several worker processes started, watched and stopped as one.

``tokenq worker --devices 0,1`` runs one worker per GPU and ``tokenq up``
runs N workers next to a private Redis; both need the same small parent:
start children, forward the first SIGTERM/SIGINT to them as SIGTERM (each
then finishes and answers what it read), SIGKILL them on a second signal or
when they overstay a grace period, and exit when all have exited.

Why processes and not threads: one worker is one CUDA context, one GIL and
one token budget; CUDA_VISIBLE_DEVICES must be set before torch starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

from tokenq.shared.settings import WorkerSettings

log = logging.getLogger("tokenq.worker")

_POLL_S = 0.1
_REPEAT_S = 1.0
"""A second stop signal within this time is the same stop, not a request to kill."""


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]


class Children:
    """Child processes with one stop switch, driven by signals or by the caller."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self._signals = 0
        self._first_signal = 0.0
        self._previous: dict[int, object] = {}

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> Child:
        child = Child(name, subprocess.Popen(list(argv), env=dict(env)))
        self.children.append(child)
        log.info("started %s (pid %d)", name, child.process.pid)
        return child

    # ----------------------------------------------------------------- signals

    def install_signal_handlers(self) -> None:
        """First SIGTERM/SIGINT: ask children to stop; a second: kill them."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self._signals and now - self._first_signal < _REPEAT_S:
            return  # the same stop sent to the whole process group (timeout(1), a shell)
        self._signals += 1
        if self._signals == 1:
            self._first_signal = now
            log.info("signal %s: stopping %d workers", signal.Signals(signum).name, self.running)
            self.send(signal.SIGTERM)
        else:
            log.warning("second signal: killing workers")
            self.send(signal.SIGKILL)

    @property
    def stopping(self) -> bool:
        return self._signals > 0

    # -------------------------------------------------------------------- state

    @property
    def running(self) -> int:
        return sum(child.process.poll() is None for child in self.children)

    def send(self, sig: int) -> None:
        for child in self.children:
            if child.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # exited just now
                    child.process.send_signal(sig)

    def wait_all(self, timeout: float | None = None) -> bool:
        """Wait until every child exited (True) or ``timeout`` passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.running:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def stop(self, grace_s: float) -> None:
        """SIGTERM every child, wait ``grace_s``, then SIGKILL whoever is left."""
        self.send(signal.SIGTERM)
        if not self.wait_all(grace_s):
            log.warning("workers still running after %.0fs; killing them", grace_s)
            self.send(signal.SIGKILL)
            self.wait_all(10.0)

    def exit_code(self) -> int:
        """0 when every child exited cleanly (a stop signal counts), else the first bad code."""
        for child in self.children:
            code = child.process.returncode
            if code not in (0, None, -signal.SIGTERM, -signal.SIGINT):
                return code if code > 0 else 128 - code
        return 0


# ---------------------------------------------------------------- one per GPU

_PER_CHILD_FLAGS = ("--devices", "--consumer", "--device", "--metrics-port")
PER_CHILD_ENV = ("TOKENQ_DEVICES", "TOKENQ_CONSUMER", "TOKENQ_DEVICE", "TOKENQ_METRICS_PORT")


def strip_flags(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``argv`` without ``flags`` (as ``--flag value`` or ``--flag=value``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def device_commands(
    settings: WorkerSettings, argv: Sequence[str], env: Mapping[str, str]
) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv, env) of each per-GPU child of ``tokenq worker --devices``."""
    base = settings.consumer or f"{socket.gethostname()}-{os.getpid()}"
    common = strip_flags(argv, _PER_CHILD_FLAGS)
    commands = []
    for index, device in enumerate(settings.device_list):
        name = f"{base}-gpu{device}"
        child_env = {k: v for k, v in env.items() if k not in PER_CHILD_ENV}
        child_env["CUDA_VISIBLE_DEVICES"] = device
        child_argv = [sys.executable, "-m", "tokenq.worker", *common,
                      "--consumer", name, "--device", "cuda:0"]
        if settings.metrics_port:
            child_argv += ["--metrics-port", str(settings.metrics_port + index)]
        commands.append((name, child_argv, child_env))
    return commands


def run_per_device(settings: WorkerSettings, argv: Sequence[str]) -> int:
    """Run one worker per device until all exit; forward stop signals to them."""
    children = Children()
    children.install_signal_handlers()
    try:
        for name, child_argv, child_env in device_commands(settings, argv, os.environ):
            children.start(name, child_argv, child_env)
        children.wait_all()
    finally:
        if children.running:
            children.stop(30.0)
        children.restore_signal_handlers()
    return children.exit_code()
