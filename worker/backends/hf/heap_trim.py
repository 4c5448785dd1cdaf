"""A CPU worker's resident memory bounded over batch shapes: the oneDNN caches capped, the heap
trimmed once it grew a slack (docs/decisions/0042-cpu-memory-over-batch-shapes.md)."""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable, MutableMapping

LIBRARY_CACHE_CAPACITY = 256  # entries kept by each oneDNN cache

_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

MIN_TRIM_SLACK_BYTES = 256 * 2**20  # the least growth past the last trim that trims again
TRIM_SLACK_SHARE = 0.25  # the slack as a share of the size after a trim, when larger


def bound_library_caches(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Cap the oneDNN caches (an operator's value kept) before a forward creates them."""
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


def _glibc_trim() -> Callable[[], object] | None:  # malloc_trim(0), None without glibc
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


class HeapTrimmer:
    """Returns the heap's free pages to the OS when the process has grown by a slack; inert
    where resident memory or ``malloc_trim`` is unavailable; device thread only."""

    def __init__(
        self, *, resident: Callable[[], int | None] = resident_bytes,
        trim: Callable[[], object] | None = None, min_slack: int = MIN_TRIM_SLACK_BYTES,
    ) -> None:
        self._resident = resident
        self._trim = _glibc_trim() if trim is None else trim
        self._min_slack = min_slack
        self.trims = 0
        now = resident()
        self.active = now is not None and self._trim is not None
        self._limit = self._limit_after(now or 0)

    def _limit_after(self, level: int) -> int:
        return level + max(self._min_slack, int(level * TRIM_SLACK_SHARE))

    def after_forward(self) -> bool:
        """Trim if the process is over its limit; True if it did."""
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
