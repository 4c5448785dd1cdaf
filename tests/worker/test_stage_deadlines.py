"""Every stage that holds entries has a deadline; children never outlive their worker.

A tokenizer that never returns (``tests.plugins_for_tests:sim_hanging_tokenizer``,
in ``--tokenize-processes`` children or in the worker's own thread) used to
hold its read forever: heartbeats kept re-claiming the entries, ``/livez``
said 200, SIGTERM did not stop the worker and a SIGKILLed worker left the
child running. Here, against real worker processes and a real Redis: the
watchdog ends the worker (exit 3, ``/livez`` naming the stage) and a peer
answers every request of the hung read; SIGTERM ends it within the stop
grace; SIGKILL of the worker takes its children with it (``prctl`` and the
portable parent-pid poll both). The rules (:class:`~tokenq.worker.loop.stages.Stages`)
are driven directly with the clock as an argument.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.plugins_for_tests import TOKENIZE_HANG_MARKER, TOKENIZER_PIDS_ENV
from tests.redis_server import free_ports
from tests.support import DIM, FAST_BEAT, SIM_FLAGS, SimModel, wait_for
from tests.worker.test_health import LOCAL, get
from tests.workers import Fleet
from tokenq.producer import Client
from tokenq.shared import keys
from tokenq.worker.loop.stages import DEVICE, PUBLISH, TOKENIZING, Stages

HANGING = SimModel().flags(backend="tests.plugins_for_tests:sim_hanging_tokenizer")


def gone(pid: int) -> bool:
    """The process ended (a zombie nobody reaped yet counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.fixture
def pids(tmp_path: Path) -> Path:
    directory = tmp_path / "tokenizer-pids"
    directory.mkdir()
    return directory


@pytest.fixture
def fleet(worker_env: dict[str, str], tmp_path: Path, pids: Path) -> Iterator[Fleet]:
    group = Fleet({**worker_env, TOKENIZER_PIDS_ENV: str(pids)}, tmp_path)
    yield group
    group.close()
    for name in os.listdir(pids):  # never leave a hung child behind, whatever failed
        if not gone(int(name)):
            os.kill(int(name), signal.SIGKILL)


def hung_pid(pids: Path) -> int:
    wait_for(lambda: os.listdir(pids), 30, "the tokenizer to hang")
    return int(os.listdir(pids)[0])


def enqueue_with_poison(r: redis.Redis, queue_name: str, count: int) -> list[str]:
    """``count`` requests in one XADD pipeline, the first of which hangs the tokenizer."""
    stream = keys.requests(keys.QueueRef(queue_name))
    ids = [f"s{i}" for i in range(count)]
    with r.pipeline(transaction=False) as pipe:
        for i, request_id in enumerate(ids):
            text = f"{TOKENIZE_HANG_MARKER} poison" if i == 0 else f"held with it {i}"
            pipe.xadd(stream, {"v": "1", "id": request_id, "text": text})
        pipe.execute()
    return ids


# ---------------------------------------------------------------- real workers


@pytest.mark.parametrize("processes", ["1", "0"], ids=["child", "thread"])
def test_a_hung_tokenizer_fails_livez_exits_3_and_a_peer_answers_its_read(
    fleet: Fleet, r: redis.Redis, redis_url: str, queue_name: str, pids: Path, processes: str,
):
    port = free_ports(1)
    worker = fleet.start(*HANGING, *FAST_BEAT, "--tokenize-processes", processes,
                         "--batch-timeout-s", "2", "--metrics-port", str(port), *LOCAL,
                         name="hung", ready=r, queue=queue_name)
    ids = enqueue_with_poison(r, queue_name, 20)
    child = hung_pid(pids)
    assert (child != worker.process.pid) == (processes != "0")
    # Started now, it loads while the watchdog waits out the deadline; the read is held.
    peer = fleet.start(*SIM_FLAGS, *FAST_BEAT, name="peer")
    seen: list[tuple[int, str]] = []

    def failed() -> bool:
        seen.append(get(port, "/livez"))
        return seen[-1][0] == 503 or worker.process.poll() is not None

    wait_for(failed, 30, "/livez to fail")
    answered = [(status, body) for status, body in seen if status]  # 0: the worker was gone
    assert answered and all(status == 200 for status, _ in answered[:-1]), seen
    if processes != "0" or answered[-1][0] == 503:  # a thread's worker may go before a probe
        status, body = answered[-1]
        assert status == 503 and body.startswith("tokenizing hung: a read of"), seen
        assert "batch_timeout_s" in body
    assert worker.process.wait(timeout=30) == 3, worker.output()[-3000:]
    assert "tokenizing hung" in worker.output()
    wait_for(lambda: gone(child), 10, "the tokenizer child to end with its worker")

    # The claims were let go: a peer with a tokenizer that works answers every request.
    peer.wait_ready(r, queue_name)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        for request_id in ids:
            assert len(client.result(request_id, timeout_s=60).embedding) == DIM


def test_a_tokenizer_hung_on_the_event_loop_is_ended_by_the_guard_and_a_peer_answers(
    fleet: Fleet, r: redis.Redis, redis_url: str, queue_name: str, pids: Path,
):
    """A read predicted cheap is admitted on the event loop (``AdmitPlace``, in
    ``worker/loop/reader.py``), so a tokenizer that hangs there blocks the watchdog too: the
    loop guard's thread ends the worker (exit 3, naming the stage), and a peer answers the hung
    read."""
    worker = fleet.start(*HANGING, *FAST_BEAT, "--batch-timeout-s", "2",
                         name="hung", ready=r, queue=queue_name)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        # Reads of one cheap request each teach the worker that admitting is cheap.
        for index in range(80):
            request_id = client.submit(f"warm up {index}")
            assert len(client.result(request_id, timeout_s=30).embedding) == DIM
    ids = enqueue_with_poison(r, queue_name, 3)
    wait_for(lambda: os.listdir(pids), 30, "the tokenizer to hang")
    assert int(os.listdir(pids)[0]) == worker.process.pid  # in the worker itself
    # Started now, it loads while the guard waits out its patience; the read is held.
    peer = fleet.start(*SIM_FLAGS, *FAST_BEAT, name="peer")
    assert worker.process.wait(timeout=60) == 3, worker.output()[-3000:]
    output = worker.output()
    assert "tokenizing hung on the event loop" in output, output[-3000:]
    assert "being tokenized on the event loop" in output

    peer.wait_ready(r, queue_name)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        for request_id in ids:
            assert len(client.result(request_id, timeout_s=60).embedding) == DIM


def test_sigterm_stops_a_worker_whose_tokenizer_child_hangs(
    fleet: Fleet, r: redis.Redis, queue_name: str, pids: Path,
):
    """The stop lets a read being tokenized finish within the stop grace (5 s), not forever:
    far sooner than batch_timeout_s, and the child ends too."""
    worker = fleet.start(*HANGING, *FAST_BEAT, "--tokenize-processes", "1",
                         "--batch-timeout-s", "600", name="hung", ready=r, queue=queue_name)
    enqueue_with_poison(r, queue_name, 3)
    child = hung_pid(pids)
    started = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(timeout=30) == 3, worker.output()[-3000:]
    assert time.monotonic() - started < 20
    assert "stop grace" in worker.output()
    wait_for(lambda: gone(child), 10, "the tokenizer child to end with its worker")


def test_sigkill_of_the_worker_kills_its_hung_tokenizer_child(
    fleet: Fleet, r: redis.Redis, queue_name: str, pids: Path,
):
    worker = fleet.start(*HANGING, *FAST_BEAT, "--tokenize-processes", "2",
                         "--batch-timeout-s", "600", name="hung", ready=r, queue=queue_name)
    enqueue_with_poison(r, queue_name, 3)
    child = hung_pid(pids)
    assert not gone(child)
    worker.process.kill()
    worker.process.wait(timeout=10)
    wait_for(lambda: gone(child), 10, "the tokenizer child to die with its SIGKILLed worker")


_POOL_PARENT = textwrap.dedent("""
    import sys, threading
    from tests.plugins_for_tests import TOKENIZE_HANG_MARKER, HangingTokenizer
    from tokenq.worker.backends.base import TextInput
    from tokenq.worker.pipeline.tokenizing import TokenizerPool

    pool = TokenizerPool(HangingTokenizer, 1, use_prctl=sys.argv[1] == "prctl")
    pool.start()
    threading.Thread(target=pool.tokenize, args=([TextInput(TOKENIZE_HANG_MARKER)], None),
                     daemon=True).start()
    threading.Event().wait()
""")


@pytest.mark.parametrize("how", ["prctl", "poll"])
def test_pool_children_die_with_a_sigkilled_parent_by_prctl_and_by_polling(
    worker_env: dict[str, str], pids: Path, how: str,
):
    """Both ways a child learns its parent is gone: Linux's PR_SET_PDEATHSIG, and the
    parent-pid poll used where there is none."""
    parent = subprocess.Popen([sys.executable, "-c", _POOL_PARENT, how],
                              env={**worker_env, TOKENIZER_PIDS_ENV: str(pids)})
    try:
        child = hung_pid(pids)
    finally:
        parent.kill()
        parent.wait(timeout=10)
    try:
        wait_for(lambda: gone(child), 10, f"the child to die with its parent ({how})")
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)


# ------------------------------------------------------------------ the rules


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_a_stage_is_overdue_only_past_its_own_deadline_and_the_latest_is_named():
    clock = FakeClock()
    stages = Stages(clock)
    with stages.running(DEVICE, "a batch of 3 requests on the device", 15.0, "batch_timeout_s"):
        clock.now = 105.0
        with stages.running(PUBLISH, "publishing 3 answers", 4.0, "the Redis bound") as restart:
            assert stages.overdue(108.9) is None
            late = stages.overdue(109.5)
            assert late is not None and late.stage.name == PUBLISH
            assert late.reason == "publishing 3 answers for more than the Redis bound (4s)"
            clock.now = 109.0
            restart()  # the next attempt: its own deadline
            assert stages.overdue(112.9) is None
            late = stages.overdue(113.5)
            assert late is not None and late.stage.name == PUBLISH
            late = stages.overdue(116.0)  # both late: the one furthest past its deadline
            assert late is not None and late.stage.name == PUBLISH  # 3 s late, the device 1 s
        assert stages.overdue(114.0) is None
        late = stages.overdue(116.0)
        assert late is not None and late.stage.name == DEVICE
    assert stages.overdue(1e9) is None  # every stage ended: none is left running


@pytest.mark.unit
def test_a_stop_shortens_tokenizing_to_the_grace_but_not_the_device():
    clock = FakeClock()
    stages = Stages(clock)
    with stages.running(DEVICE, "a batch", 300.0, "batch_timeout_s"):
        with stages.running(TOKENIZING, "a read", 300.0, "batch_timeout_s",
                            shortened_by_stop=True):
            assert stages.overdue(150.0, stopped_at=None) is None
            assert stages.overdue(154.9, stopped_at=150.0, stop_grace_s=5.0) is None
            late = stages.overdue(155.1, stopped_at=150.0, stop_grace_s=5.0)
            assert late is not None and late.stage.name == TOKENIZING
            assert "stop grace (5s)" in late.reason
        clock.now = 160.0
        with stages.running(TOKENIZING, "a later read", 300.0, "batch_timeout_s",
                            shortened_by_stop=True):
            # begun after the stop: the grace counts from its start
            assert stages.overdue(164.9, stopped_at=150.0, stop_grace_s=5.0) is None
        assert stages.overdue(399.0, stopped_at=150.0, stop_grace_s=5.0) is None
        late = stages.overdue(400.1, stopped_at=150.0, stop_grace_s=5.0)
        assert late is not None and late.stage.name == DEVICE
