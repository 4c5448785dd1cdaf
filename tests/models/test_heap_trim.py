"""A CPU worker's resident memory stays bounded over many batch shapes (hf/heap_trim.py).

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
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.tiny_bert import SAMPLE_TEXTS, write_tiny_bert
from tokenq.worker.backends.base import TextInput
from tokenq.worker.backends.hf import heap_trim
from tokenq.worker.backends.hf.backend import HFBackend, HFOptions
from tokenq.worker.backends.hf.heap_trim import (
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
        monkeypatch.setattr(heap_trim, "_glibc_trim", lambda: None)
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
    monkeypatch.setattr(heap_trim, "TRIM_SLACK_SHARE", 0.0)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 100 * 1024  # under glibc's mmap threshold: on the heap, as activations are
    trim = heap_trim._glibc_trim()
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


_SHAPES_CHILD = """
import json, os, random, sys
import torch
from tokenq.worker.backends.hf import heap_trim
from tokenq.worker.backends.hf.backend import HFBackend, HFOptions
from tokenq.worker.backends.hf.encoding import HFEncoding

model, dtype, slack = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
backend = HFBackend.load(HFOptions(model=model, device="cpu", dtype=dtype))
heap_trim.TRIM_SLACK_SHARE = 0.0  # the slack from the given floor, as the model is tiny
backend._heap = heap_trim.HeapTrimmer(min_slack=slack)
shapes = [(rows, length) for rows in range(1, 33) for length in range(4, 129, 2)]
rng = random.Random(3)
rng.shuffle(shapes)
loaded, growth = heap_trim.resident_bytes(), []
for done, (rows, length) in enumerate(shapes, 1):
    backend.run([HFEncoding(tuple(rng.randrange(5, 60) for _ in range(length)))] * rows)
    if done % 126 == 0:
        growth.append(heap_trim.resident_bytes() - loaded)
print(json.dumps({"shapes": len(shapes), "growth": growth, "trims": backend._heap.trims,
                  "caches": os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]}))
"""

SHAPES_SLACK = 32 * MiB
"""The slack of the many-shapes test: the tiny model's heap grows by about 90 MiB over
1,000 shapes, inside the worker's 256 MiB, so a smaller slack makes the trims happen."""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_resident_memory_is_flat_over_2016_batch_shapes_in_fp32_and_bf16_mixed(
    tmp_path: Path,
) -> None:
    """Each dtype in a fresh process (the caches are process-wide, and capped only before
    their first use): 2,016 distinct (rows, length) shapes through one HFBackend, every
    one a new oneDNN product. Unbounded (caches at 1,024 entries, no trim) the tiny model
    grew +140 MiB in fp32, still rising (+42 MiB in the second half), and +819 MiB in
    bf16-mixed; bounded, +55 and +184 MiB at most, the second half adding 3 MiB to each
    half's peak. So: the growth stays under 256 MiB (the capped caches' share, bf16-mixed)
    plus the slack plus a forward, and the second half's peak within a slack of the first's."""
    from tokenq.worker.backends.hf.runtime import cpu_has_bf16_matmul

    dtypes = ["fp32"] + (["bf16-mixed"] if cpu_has_bf16_matmul() else [])
    model = str(write_tiny_bert(tmp_path / "m", max_position_embeddings=160))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        env.pop(name, None)  # the worker's own caps, as an operator who set none gets
    children = {dtype: subprocess.Popen(
        [sys.executable, "-c", _SHAPES_CHILD, model, dtype, str(SHAPES_SLACK)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) for dtype in dtypes}  # side by side: each has a thread
    for dtype, child in children.items():
        try:
            out, err = child.communicate(timeout=110)
        finally:
            child.kill()
        assert child.returncode == 0, err[-3000:]
        run = json.loads(out.strip().splitlines()[-1])
        growth = [round(grew / MiB) for grew in run["growth"]]
        assert run["caches"] == str(LIBRARY_CACHE_CAPACITY)
        assert run["trims"] > 0, (dtype, growth)
        assert max(growth) < 256 + SHAPES_SLACK // MiB + 32, (dtype, growth)
        half = len(growth) // 2
        assert max(growth[half:]) - max(growth[:half]) < SHAPES_SLACK // MiB, (dtype, growth)
