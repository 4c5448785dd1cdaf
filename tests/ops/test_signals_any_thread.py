"""A stop signal that lands on any thread of a long-running command stops it at once.

Why: the kernel delivers a process's SIGINT/SIGTERM to *any* of its threads
that does not block it, and Python runs the handler only when the main
thread next runs bytecode. A main thread waiting with no time-out on a
lock, a queue or a future (``concurrent.futures.wait``, ``Queue.get``) does
not wake for a signal another thread took, so the stop waits for that wait
to end: in ``tokenq embed`` with no worker up, a request's whole
``--timeout-s``; in the benchmarks' fixed-count worker, for ever (it failed
``test_seed`` in CI: SIGKILLed after 60 s, its counters never written).

Which thread the kernel picks is up to it (usually the main one), so these
tests do not wait for luck: they send the signal with ``tgkill`` to a
thread other than the main one that does not block it (one the kernel could
pick). The commands' answer is the same everywhere: the main thread never
waits without a time-out while a signal handler is what ends the wait
(``tokenq worker``'s event loop takes signals through its wake-up fd).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import SIM_FLAGS, wait_for
from tokenq.shared import keys
from tokenq.shared.keys import QueueRef

REPO = Path(__file__).resolve().parents[2]
PROMPT_S = 10.0
"""A stop that takes longer than this waited for something other than its own work."""

_libc = ctypes.CDLL(None, use_errno=True)


def open_threads(pid: int, sig: signal.Signals) -> list[int]:
    """The threads of ``pid``, main one excluded, that do not block ``sig``: those the
    kernel may hand a process-wide ``sig`` to."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # it ended as we looked
            continue
        blocked = int(next(line.split()[1] for line in status.splitlines()
                           if line.startswith("SigBlk:")), 16)
        if int(task.name) != pid and not blocked & (1 << (int(sig) - 1)):
            found.append(int(task.name))
    return found


def thread_count(pid: int) -> int:
    try:
        return len(list(Path(f"/proc/{pid}/task").iterdir()))
    except FileNotFoundError:  # the process is gone
        return 0


def stop_time(process: subprocess.Popen, sig: signal.Signals, threads: int = 2) -> float:
    """Once the process runs ``threads`` threads, give ``sig`` to one the kernel could pick
    other than the main one (to the process when it leaves none open); how long it took
    to end."""
    wait_for(lambda: thread_count(process.pid) >= threads, timeout=60,
             what=f"{threads} threads in the process")
    time.sleep(0.5)  # let the threads reach their waits
    started = time.monotonic()
    others = open_threads(process.pid, sig)
    if others:
        if _libc.tgkill(process.pid, others[0], int(sig)) != 0:
            raise OSError(ctypes.get_errno(), f"tgkill {process.pid} {others[0]}")
    else:  # every other thread blocks it: the kernel can only pick the main thread
        process.send_signal(sig)
    try:
        process.wait(timeout=PROMPT_S * 3)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{sig.name} to thread {others[:1] or 'main'}: still running after "
                    f"{PROMPT_S * 3}s")
    return time.monotonic() - started


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_embed_stops_when_another_thread_gets_the_signal(
    sig, spawn, worker_env, tmp_path
):
    """No worker is up, so every request thread waits on Redis for its reply: the
    interruption must not wait out ``--timeout-s`` (120 s here)."""
    source = tmp_path / "in.txt"
    source.write_text("".join(f"line {i}\n" for i in range(64)))
    out = tmp_path / "out.jsonl"
    process = spawn([sys.executable, "-m", "tokenq.shared.cli", "embed", str(source),
                     "--output", str(out), "--batch-size", "8", "--max-in-flight", "32",
                     "--timeout-s", "120", "--no-progress"],
                    env=worker_env, stderr=subprocess.PIPE, text=True)
    took = stop_time(process, sig, threads=4)
    err = process.stderr.read()
    assert process.returncode == 130, err
    assert "run the same command again to resume" in err and "Traceback" not in err
    assert took < PROMPT_S, f"{sig.name} took {took:.1f}s"


def test_worker_stops_when_another_thread_gets_the_signal(spawn, worker_env, redis_url,
                                                             queue_name, r):
    """The worker's loop takes signals through its wake-up fd, whichever thread gets them."""
    process = spawn([sys.executable, "-m", "tokenq.worker", *SIM_FLAGS, "--consumer", "w"],
                    env=worker_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: r.exists(keys.worker_alive(QueueRef(queue_name), "w")), timeout=60,
             what="the worker to join")
    took = stop_time(process, signal.SIGTERM, threads=2)
    assert process.returncode == 0
    assert not r.exists(keys.worker_alive(QueueRef(queue_name), "w"))  # it left cleanly
    assert took < PROMPT_S, f"SIGTERM took {took:.1f}s"


def test_the_benchmark_fifo_worker_stops_when_another_thread_gets_the_signal(
    spawn, redis_url, queue_name, r, tmp_path
):
    """``scripts/bench/fifo_worker.py`` (the seed suite's baseline) writes its device
    counters on a clean stop; a stop it never saw left the suite a None figure."""
    bench = REPO / "scripts" / "bench"
    stats = tmp_path / "sim.json"
    env = {**os.environ, "TOKENQ_REDIS_URL": redis_url, "TOKENQ_QUEUE": queue_name,
           "BENCH_SIM_STATS": str(stats),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(bench), os.environ.get("PYTHONPATH")]))}
    process = spawn([sys.executable, str(bench / "fifo_worker.py"), "--consumer", "fifo",
                     "--batch-size", "4"], env=env, cwd=bench,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: r.exists(keys.worker_alive(QueueRef(queue_name), "fifo")), timeout=60,
             what="the fifo worker to join")
    took = stop_time(process, signal.SIGTERM, threads=3)
    assert process.returncode == 0
    assert stats.exists()
    assert took < PROMPT_S, f"SIGTERM took {took:.1f}s"
