"""How much memory this worker process may use: its cgroup's limit, else the machine's.

Read once at start to size defaults that are a share of memory (the
read-ahead byte bound: :func:`tokenq.worker.read_ahead.auto_limit`). A
container's limit is what the kernel enforces, so it wins over the host's
memory when smaller; an unreadable, unlimited (``max``) or nonsensical file
counts as no limit, never as an error: a default must not stop a worker.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

CGROUP_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2, the container's own
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)


def limit_in(path: Path) -> int | None:
    """The byte limit a cgroup file states, or None (no file, no limit, or not a number).

    cgroup v1 states "no limit" as a huge number (about 2**63); any value
    beyond a pebibyte is read as none.
    """
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    if not text.isdigit() or len(text) > 19:
        return None
    value = int(text)
    return value if 0 < value < 1 << 50 else None


def physical_bytes() -> int | None:
    """The machine's memory, or None where the platform does not say."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def usable_bytes(limit_files: Iterable[Path] = CGROUP_LIMIT_FILES) -> int | None:
    """The least of the machine's memory and every cgroup limit found (None: none known)."""
    known = [value for value in (physical_bytes(), *map(limit_in, limit_files))
             if value is not None]
    return min(known, default=None)
