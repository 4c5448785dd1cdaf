"""How much memory this worker process may use: its cgroups' limits, else the machine's."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
V2_FILE = "memory.max"
V1_DIR, V1_FILE = "memory", "memory.limit_in_bytes"


def limit_in(path: Path) -> int | None:
    """The byte limit a cgroup file states, or None (no file, no limit, not a number, or
    beyond a pebibyte: cgroup v1's "no limit")."""
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    if not text.isdigit() or len(text) > 19:
        return None
    value = int(text)
    return value if 0 < value < 1 << 50 else None


def limit_files(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> list[Path]:
    """Every file that may state a memory limit on this process: for v2 and v1, the
    hierarchy's root (a container's own cgroup) and the process's cgroup and its parents."""
    v2, v1 = [PurePosixPath("/")], [PurePosixPath("/")]
    try:
        lines = proc_cgroup.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path.startswith("/"):
            continue
        own = PurePosixPath(path)
        if controllers == "":
            v2 += [own, *own.parents]
        elif "memory" in controllers.split(","):
            v1 += [own, *own.parents]
    files = [root / str(cgroup).lstrip("/") / V2_FILE for cgroup in v2]
    files += [root / V1_DIR / str(cgroup).lstrip("/") / V1_FILE for cgroup in v1]
    return list(dict.fromkeys(files))


def physical_bytes() -> int | None:  # None where the platform does not say
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def usable_bytes(files: Iterable[Path] | None = None) -> int | None:
    """The least of the machine's memory and every cgroup limit found (None: none known)."""
    found = limit_files() if files is None else files
    known = [value for value in (physical_bytes(), *map(limit_in, found))
             if value is not None]
    return min(known, default=None)
