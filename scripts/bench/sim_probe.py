"""``--backend sim_probe:factory``: tokenq's own sim backend, which reports its counters at exit.

Why: the worker's batch log says what the *packer* sent, but only the
simulated device knows what it actually held (peak memory), how often it ran
out of memory, and how long it was busy. This plugin wraps the very
:class:`~tokenq.worker.backends.sim.SimBackend` that ``--backend sim`` builds from the
same ``--sim-*`` settings (tokenize, run and windows are the sim's own); on
``close()`` (the worker's clean exit) it writes those counters as JSON to the
path in ``$BENCH_SIM_STATS``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenq.worker.backends.sim import SimBackend, build_sim_backend

if TYPE_CHECKING:  # a --baseline checkout may keep WorkerSettings elsewhere
    from tokenq.worker.settings import WorkerSettings

STATS_ENV = "BENCH_SIM_STATS"


def sim_counters(backend: SimBackend) -> dict[str, float | int]:
    """The device-side figures a benchmark reports."""
    return {
        "batches": backend.batches,
        "rows": backend.rows,
        "oom_events": backend.oom_events,
        "peak_memory_bytes": backend.peak_memory_bytes,
        "busy_s": round(backend.busy_s, 4),
    }


class ProbedSim:
    """A SimBackend whose ``close`` also writes :func:`sim_counters` to ``$BENCH_SIM_STATS``."""

    def __init__(self, inner: SimBackend) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        # Only reached for what the wrapper lacks: info, tokenize, run, windows, ...
        return getattr(self._inner, name)

    def close(self) -> None:
        path = os.environ.get(STATS_ENV)
        if path:
            Path(path).write_text(json.dumps(sim_counters(self._inner)))
        self._inner.close()


def factory(settings: WorkerSettings) -> ProbedSim:
    """The worker's plugin hook: the sim backend as ``--sim-*`` configures it."""
    return ProbedSim(build_sim_backend(settings))
