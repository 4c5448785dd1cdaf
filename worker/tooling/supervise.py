"""``tokenq worker --devices 0,1``: supervised worker processes per GPU, each with its own
``CUDA_VISIBLE_DEVICES``, consumer name, device share and metrics port; other flags pass on."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenq.shared.errors import ConfigError
from tokenq.shared.settings import env_var, flag
from tokenq.worker.settings import WorkerSettings
from tokenq.worker.tooling.children import Supervisor, log

STOP_TIMEOUT_S = 30.0  # how long children get to finish after SIGTERM before SIGKILL
# ``--processes-per-device auto`` starts two processes for weights at most this big (a small
# model leaves the GPU waiting on one process's Python, a 7B one keeps it busy alone), each
# with this headroom beside the weights (CUDA context, activations).
SMALL_MODEL_BYTES = 2 << 30
HEADROOM_BYTES = 2 << 30

# The settings each child gets its own value of; every other one is passed on.
_PER_CHILD = ("devices", "processes_per_device", "device_share", "consumer", "device",
              "metrics_port")
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


def auto_processes(weights: int | None, device_bytes: int | None, share: float) -> tuple[int, str]:
    """``--processes-per-device auto``'s rule: how many processes per GPU, and why."""
    if device_bytes is None:
        return 1, "no CUDA device"
    if weights is None:
        return 1, "the model's weight files were not found"
    room = share * device_bytes
    count = 2 if weights <= SMALL_MODEL_BYTES and 2 * (weights + HEADROOM_BYTES) <= room else 1
    return count, f"{weights / 2**30:.2f} GiB of weights, {room / 2**30:.1f} GiB of GPU share"


def _weights_bytes(model: str | None) -> int | None:
    """Bytes of the ``--backend hf`` model's weight files (safetensors, else .bin)."""
    from huggingface_hub import snapshot_download

    from tokenq.worker.backends.hf.load import resolve_model

    try:
        source = resolve_model(model)
        folder = Path(source.location if source.local
                      else snapshot_download(source.location, local_files_only=True))
    except (ConfigError, OSError):
        return None  # the children say why
    files = list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))
    return sum(path.stat().st_size for path in files) or None


def _device_bytes() -> int | None:
    """The smallest visible GPU's total memory (read, nothing allocated), or None."""
    import torch

    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(index).total_memory
               for index in range(torch.cuda.device_count()))


def processes_per_device(settings: WorkerSettings) -> int:
    """``--processes-per-device``, ``auto`` resolved once, here in the supervisor."""
    if settings.processes_per_device != "auto":
        return int(settings.processes_per_device)
    backend = settings.backend.strip()
    if backend != "hf":  # the sim shares no GPU; a plugin's model size is unknown
        count, why = 1, f"--backend {backend}"
    else:
        count, why = auto_processes(_weights_bytes(settings.model), _device_bytes(),
                                    settings.device_share)
    log.info("--processes-per-device auto: %d per device (%s)", count, why)
    return count


def device_commands(
    settings: WorkerSettings, argv: Sequence[str], env: Mapping[str, str]
) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv, env) of each child of ``tokenq worker --devices``, device by device."""
    base = settings.consumer or f"{socket.gethostname()}-{os.getpid()}"
    common = strip_flags(argv, _PER_CHILD_FLAGS)
    per_device = processes_per_device(settings)
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
