"""``tokenq worker --devices 0,1``: supervised worker processes per GPU (one CUDA context,
GIL and budget each), each with its own ``CUDA_VISIBLE_DEVICES``, consumer name, device
share and metrics port; other flags pass on."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence

from tokenq.shared.settings import env_var, flag
from tokenq.worker.settings import WorkerSettings
from tokenq.worker.tooling.children import Supervisor

STOP_TIMEOUT_S = 30.0
"""How long children get to finish after SIGTERM before SIGKILL."""

_PER_CHILD = ("devices", "processes_per_device", "device_share", "consumer", "device",
              "metrics_port")
"""The settings each child gets its own value of; every other one is passed on."""
_PER_CHILD_FLAGS = tuple(flag(WorkerSettings, name) for name in _PER_CHILD)
PER_CHILD_ENV = tuple(env_var(name) for name in _PER_CHILD)


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
    """(name, argv, env) of each child of ``tokenq worker --devices``, device by device."""
    base = settings.consumer or f"{socket.gethostname()}-{os.getpid()}"
    common = strip_flags(argv, _PER_CHILD_FLAGS)
    per_device = settings.processes_per_device
    # The operator's share is of the whole device; its N processes split it.
    share = settings.device_share / per_device
    slots = [(device, k) for device in settings.device_list for k in range(1, per_device + 1)]
    shared_env = {k: v for k, v in env.items() if k not in PER_CHILD_ENV}
    if len(slots) > 1 and "OMP_NUM_THREADS" not in shared_env:
        shared_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(slots)))
    commands = []
    for index, (device, k) in enumerate(slots):
        name = f"{base}-gpu{device}" if per_device == 1 else f"{base}-gpu{device}-{k}"
        child_env = {**shared_env, "CUDA_VISIBLE_DEVICES": device}
        child_argv = [sys.executable, "-m", "tokenq.worker", *common, "--consumer", name]
        if settings.backend.strip() != "sim":
            child_argv += ["--device", "cuda:0"]
        if share < 1:
            child_argv += ["--device-share", repr(share)]
        if settings.metrics_port:
            child_argv += ["--metrics-port", str(settings.metrics_port + index)]
        commands.append((name, child_argv, child_env))
    return commands


def run_per_device(settings: WorkerSettings, argv: Sequence[str]) -> int:
    """Run one worker per device, restarting those that fail, until all are done or a stop;
    exit 0, 2 when every child stopped on a usage error, or the first child's failure."""
    with Supervisor(stop_timeout_s=STOP_TIMEOUT_S) as supervisor:
        for name, child_argv, child_env in device_commands(settings, argv, os.environ):
            if supervisor.stopping:
                break
            supervisor.start(name, child_argv, child_env)
        supervisor.run()
    return supervisor.exit_code()
