"""The default read-ahead room is a share of the memory the worker may use.

``worker/host_memory.py`` reads the cgroup's limit (v2 or v1) and the
machine's memory; ``intake.auto_limit`` turns that into the byte room.
Hostile files (unlimited, garbage, a v1 "no limit", a megabyte of digits, a
directory) count as no limit and never stop a worker.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenq.worker import host_memory
from tokenq.worker.backends.sim import SimBackend
from tokenq.worker.loop.intake import AUTO_MAX, AUTO_MIN, AUTO_SHARE, auto_limit
from tokenq.worker.loop.worker import Worker
from tokenq.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit

GIB = 1 << 30


@pytest.mark.parametrize(("content", "expected"), [
    ("1073741824\n", GIB),
    ("max\n", None),  # cgroup v2: no limit
    ("9223372036854771712\n", None),  # cgroup v1: "no limit" is about 2**63
    ("", None),
    ("lots", None),
    ("-5", None),
    ("0", None),
    ("9" * 1_000_000, None),  # refused by its length, before any int() of it
])
def test_a_cgroup_file_states_a_limit_or_none(tmp_path: Path, content: str,
                                              expected: int | None) -> None:
    path = tmp_path / "memory.max"
    path.write_text(content)
    assert host_memory.limit_in(path) == expected


def test_a_missing_or_unreadable_file_is_no_limit(tmp_path: Path) -> None:
    assert host_memory.limit_in(tmp_path / "absent") is None
    assert host_memory.limit_in(tmp_path) is None  # a directory


def test_usable_memory_is_the_least_of_the_machine_and_every_limit(tmp_path: Path) -> None:
    physical = host_memory.physical_bytes()
    assert physical is not None and physical > 0
    assert host_memory.usable_bytes([tmp_path / "absent"]) == physical
    small, unlimited = tmp_path / "v2", tmp_path / "v1"
    small.write_text(str(512 * 1024 * 1024))
    unlimited.write_text("max")
    assert host_memory.usable_bytes([small, unlimited]) == min(physical, 512 * 1024 * 1024)
    assert host_memory.usable_bytes([unlimited, tmp_path / "absent"]) == physical
    assert host_memory.usable_bytes() is not None  # this machine's own files, whatever they say


def test_a_services_own_cgroup_and_its_parents_are_read_for_v2_and_v1(tmp_path: Path) -> None:
    """Under systemd a service's limit sits on its own cgroup (or a slice above it), not at
    the root a container would show: every level is read, the least limit wins."""
    proc = tmp_path / "cgroup"
    proc.write_text("12:cpu,cpuacct:/elsewhere\n4:memory,hugetlb:/box/worker\n"
                    "0::/system.slice/tokenq.service\nnonsense\n3:devices:relative\n")
    root = tmp_path / "fs"
    files = host_memory.limit_files(proc, root)
    assert root / "system.slice/tokenq.service/memory.max" in files
    assert root / "system.slice/memory.max" in files and root / "memory.max" in files
    assert root / "memory/box/worker/memory.limit_in_bytes" in files
    assert root / "memory/box/memory.limit_in_bytes" in files
    assert not any("elsewhere" in str(path) or "relative" in str(path) for path in files)
    slice_limit = root / "system.slice/memory.max"
    slice_limit.parent.mkdir(parents=True)
    slice_limit.write_text(str(300 * 1024 * 1024))
    (root / "system.slice/tokenq.service").mkdir()
    (root / "system.slice/tokenq.service/memory.max").write_text("max")
    assert host_memory.usable_bytes(files) == min(300 * 1024 * 1024,
                                                   host_memory.physical_bytes() or 1 << 62)


def test_an_unreadable_proc_file_leaves_the_roots(tmp_path: Path) -> None:
    files = host_memory.limit_files(tmp_path / "absent", tmp_path)
    assert files == [tmp_path / "memory.max", tmp_path / "memory/memory.limit_in_bytes"]


@given(st.one_of(st.none(), st.integers(min_value=0, max_value=1 << 62)))
def test_the_room_is_a_32nd_of_memory_between_64_mib_and_1_gib(memory: int | None) -> None:
    room = auto_limit(memory)
    assert AUTO_MIN <= room <= AUTO_MAX
    if memory is None:
        assert room == AUTO_MIN  # nothing known: the smallest room
    elif AUTO_MIN <= memory // AUTO_SHARE <= AUTO_MAX:
        assert room == memory // AUTO_SHARE
    if memory is not None:
        assert auto_limit(memory + GIB) >= room  # more memory never means less room


def test_the_worker_uses_the_setting_when_given_and_the_share_otherwise() -> None:
    def room(**given: int) -> int:
        settings = WorkerSettings(queue="room", backend="sim", **given)
        return Worker(settings, SimBackend())._intake.limit

    assert room(read_ahead_bytes=12345) == 12345
    assert room() == auto_limit(host_memory.usable_bytes())
    with pytest.raises(ValueError, match="read_ahead_bytes"):
        WorkerSettings(queue="room", read_ahead_bytes=0)
