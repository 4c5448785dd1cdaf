"""A CPU worker's resident memory, kept bounded whatever batch shapes it is given.

Each new (rows, length) shape grows the oneDNN caches and glibc's heap
(docs/BENCHMARKS.md, "host memory";
docs/decisions/0042-cpu-memory-over-batch-shapes.md). So a CPU worker caps both
caches (an operator's setting wins) and trims the heap after a forward once it
grew a slack past the last trim: resident memory stays under the last trim's
level plus the slack plus one forward's working set.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable, MutableMapping

__all__ = [
    "LIBRARY_CACHE_CAPACITY",
    "HeapTrimmer",
    "bound_library_caches",
    "resident_bytes",
]

LIBRARY_CACHE_CAPACITY = 256
"""Entries kept by each oneDNN cache: the last few dozen shapes (64 was 25 % slower)."""

_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

MIN_TRIM_SLACK_BYTES = 256 * 2**20
"""The least growth above the last trim's level that triggers the next trim."""

TRIM_SLACK_SHARE = 0.25
"""The slack as a share of the process's size after a trim, when that is larger:
a large model's process may leave more behind per batch without fragmenting."""


def bound_library_caches(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Cap the oneDNN caches before the first forward creates them (read at first use, an
    operator's value kept); what is in effect.
    """
    env = os.environ if environ is None else environ
    for name in _CACHE_VARIABLES:
        env.setdefault(name, str(LIBRARY_CACHE_CAPACITY))
    return {name: env[name] for name in _CACHE_VARIABLES}


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux ``/proc/self/statm``; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _glibc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


class HeapTrimmer:
    """Returns the heap's free pages to the OS when the process has grown by a slack.

    Inert where resident memory or ``malloc_trim`` is unavailable; device thread only.
    """

    def __init__(
        self,
        *,
        resident: Callable[[], int | None] = resident_bytes,
        trim: Callable[[], object] | None = None,
        min_slack: int = MIN_TRIM_SLACK_BYTES,
    ) -> None:
        self._resident = resident
        self._trim = _glibc_trim() if trim is None else trim
        self._min_slack = min_slack
        self.trims = 0
        """How many times it trimmed (scripts/bench/host_memory.py reports it)."""
        now = resident()
        self.active = now is not None and self._trim is not None
        self._limit = self._limit_after(now or 0)

    def _limit_after(self, level: int) -> int:
        return level + max(self._min_slack, int(level * TRIM_SLACK_SHARE))

    def after_forward(self) -> bool:
        """Trim if the process is over its limit (one read of /proc, ~10 µs); True if it did."""
        if not self.active:
            return False
        now = self._resident()
        if now is None or now <= self._limit:
            return False
        assert self._trim is not None
        self._trim()
        self.trims += 1
        self._limit = self._limit_after(self._resident() or now)
        return True
