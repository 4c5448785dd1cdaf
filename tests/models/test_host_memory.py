"""A CPU worker's resident memory stays bounded over many batch shapes (hf/host_memory.py).

What it promises (docs/OPERATIONS.md, "Memory of a CPU worker"): oneDNN's
caches are capped unless the operator set them; after a forward, once the
process has grown by the slack above where the last trim left it, glibc is
asked to give its free pages back, and it does so even when live allocations
sit between the freed ones (the fragmentation that grew a worker by a GB).
The growth itself, over hundreds of shapes, is measured by
``scripts/bench/host_memory.py``, not here.
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.tiny_bert import SAMPLE_TEXTS, write_tiny_bert
from tokenq.worker.backends.base import TextInput
from tokenq.worker.backends.hf import host_memory
from tokenq.worker.backends.hf.backend import HFBackend, HFOptions
from tokenq.worker.backends.hf.host_memory import (
    LIBRARY_CACHE_CAPACITY,
    MIN_TRIM_SLACK_BYTES,
    HeapTrimmer,
    bound_library_caches,
    resident_bytes,
)

MiB = 2**20


def test_caches_are_capped_unless_the_operator_set_them() -> None:
    env: dict[str, str] = {"LRU_CACHE_CAPACITY": "7"}
    in_effect = bound_library_caches(env)
    assert in_effect == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(LIBRARY_CACHE_CAPACITY),
        "LRU_CACHE_CAPACITY": "7",
    }
    assert env == in_effect


class FakeProcess:
    """Resident memory as a number a test moves; trimming drops it to ``after_trim``."""

    def __init__(self, resident: int) -> None:
        self.resident = resident
        self.after_trim = resident
        self.trims = 0

    def trim(self) -> None:
        self.trims += 1
        self.resident = self.after_trim


def test_trims_only_past_the_slack_and_measures_the_next_from_where_it_left() -> None:
    process = FakeProcess(400 * MiB)
    trimmer = HeapTrimmer(resident=lambda: process.resident, trim=process.trim)
    assert trimmer.active
    process.resident = 400 * MiB + MIN_TRIM_SLACK_BYTES  # at the limit: not past it
    assert not trimmer.after_forward() and process.trims == 0
    process.resident += 1
    process.after_trim = 500 * MiB  # what glibc could not give back (caches, live tensors)
    assert trimmer.after_forward() and process.trims == 1 and trimmer.trims == 1
    process.resident = 500 * MiB + MIN_TRIM_SLACK_BYTES  # measured from 500, not from 400
    assert not trimmer.after_forward()
    process.resident += 1
    assert trimmer.after_forward() and process.trims == 2


def test_a_large_process_gets_a_proportional_slack() -> None:
    process = FakeProcess(8 * 1024 * MiB)  # a large model: a quarter of it is 2 GiB
    trimmer = HeapTrimmer(resident=lambda: process.resident, trim=process.trim)
    process.resident += MIN_TRIM_SLACK_BYTES * 4  # 1 GiB: past the floor, not the share
    assert not trimmer.after_forward()
    process.resident = 8 * 1024 * MiB + 2 * 1024 * MiB + 1
    assert trimmer.after_forward()


@pytest.mark.parametrize("where", ["no /proc", "no malloc_trim"])
def test_inert_where_it_cannot_measure_or_trim(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if where == "no malloc_trim":
        monkeypatch.setattr(host_memory, "_glibc_trim", lambda: None)
        trimmer = HeapTrimmer(resident=lambda: 10**12)
    else:
        trimmer = HeapTrimmer(resident=lambda: None, trim=lambda: pytest.fail("trimmed blind"))
    assert not trimmer.active
    assert not trimmer.after_forward()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_glibc_gives_back_pages_held_between_live_allocations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's case in small: blocks freed between blocks still live stay resident
    until a trim, which gives them back without touching the live ones."""
    # The slack from here, whatever this process's size (a full test run makes it large).
    monkeypatch.setattr(host_memory, "TRIM_SLACK_SHARE", 0.0)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 100 * 1024  # under glibc's mmap threshold: on the heap, as activations are
    trim = host_memory._glibc_trim()
    assert trim is not None
    trim()  # what earlier tests freed goes back first: the blocks below fault in fresh pages
    trimmer = HeapTrimmer(min_slack=64 * MiB)
    assert trimmer.active
    blocks = [libc.malloc(size) for _ in range(3000)]  # 293 MiB
    for block in blocks:
        ctypes.memset(block, 1, size)
    live, freed = blocks[::2], blocks[1::2]  # every other block stays: the heap cannot shrink
    try:
        filled = resident_bytes() or 0
        for block in freed:
            libc.free(block)
        held = resident_bytes() or 0
        assert held > filled - 32 * MiB, f"glibc gave {(filled - held) / MiB:.0f} MiB back itself"
        assert trimmer.after_forward() and trimmer.trims == 1
        after = resident_bytes() or 0
        assert after < held - 100 * MiB, f"{held / MiB:.0f} MiB before, {after / MiB:.0f} after"
        assert all(ctypes.string_at(block, 4) == b"\x01" * 4 for block in live[:50])
    finally:
        for block in live:
            libc.free(block)


def test_a_cpu_backend_checks_its_heap_after_each_forward(tmp_path: Path) -> None:
    backend = HFBackend.load(HFOptions(model=str(write_tiny_bert(tmp_path / "m")), device="cpu"))
    calls: list[int] = []
    assert isinstance(backend._heap, HeapTrimmer)
    backend._heap.after_forward = lambda: bool(calls.append(1))  # type: ignore[method-assign]
    encodings = backend.tokenize([TextInput(text) for text in SAMPLE_TEXTS[:3]], 64)
    backend.run(encodings[:1])
    backend.run(encodings)
    assert len(calls) == 2
