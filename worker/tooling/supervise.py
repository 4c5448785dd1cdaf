"""``tokenq worker --devices 0,1``: one worker process per GPU under one parent.

Each child gets ``CUDA_VISIBLE_DEVICES=<device>``, ``--device cuda:0`` (not
with ``--backend sim``, which has no device to pick and refuses the flag), the
consumer name ``<base>-gpu<device>`` and, with ``--metrics-port P``, port
``P + i``; every other flag is passed on unchanged. The parent is a
:class:`tokenq.worker.tooling.children.Supervisor`: a child that fails is restarted
with backoff (exit codes 0 and 2 are final), a SIGTERM/SIGINT is forwarded
as SIGTERM (SIGKILL after ``STOP_TIMEOUT_S``), and the children die with the
parent even when it is SIGKILLed.

Why processes and not threads: one worker is one CUDA context, one GIL and
one token budget; CUDA_VISIBLE_DEVICES must be set before torch starts.
"""

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


# ---------------------------------------------------------------- one per GPU

_PER_CHILD = ("devices", "consumer", "device", "metrics_port")
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
    """(name, argv, env) of each per-GPU child of ``tokenq worker --devices``."""
    base = settings.consumer or f"{socket.gethostname()}-{os.getpid()}"
    common = strip_flags(argv, _PER_CHILD_FLAGS)
    commands = []
    for index, device in enumerate(settings.device_list):
        name = f"{base}-gpu{device}"
        child_env = {k: v for k, v in env.items() if k not in PER_CHILD_ENV}
        child_env["CUDA_VISIBLE_DEVICES"] = device
        child_argv = [sys.executable, "-m", "tokenq.worker", *common, "--consumer", name]
        if settings.backend.strip() != "sim":
            child_argv += ["--device", "cuda:0"]
        if settings.metrics_port:
            child_argv += ["--metrics-port", str(settings.metrics_port + index)]
        commands.append((name, child_argv, child_env))
    return commands


def run_per_device(settings: WorkerSettings, argv: Sequence[str]) -> int:
    """Run one worker per device, restarting those that fail, until all are done or a
    stop signal; the exit status is 0, 2 when every child stopped on a usage error,
    or the first child's failure."""
    supervisor = Supervisor(stop_timeout_s=STOP_TIMEOUT_S)
    supervisor.install_signal_handlers()
    try:
        for name, child_argv, child_env in device_commands(settings, argv, os.environ):
            if supervisor.stopping:
                break
            supervisor.start(name, child_argv, child_env)
        supervisor.run()
    finally:
        supervisor.stop()
        supervisor.restore_signal_handlers()
    return supervisor.exit_code()
