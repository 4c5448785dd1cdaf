"""A worker stopped (SIGSTOP) for longer than its stage deadlines is not hung once continued.

A stopped process's threads all stand still, the watchdog's and the loop
guard's too, while ``time.monotonic`` keeps counting; so the stages running
at the stop (an XREADGROUP, a batch on the device) looked overdue on
SIGCONT and the worker exited 3 although nothing in it was stuck. The
stages' clock (:class:`~tokenq.worker.loop.stages.StageClock`) leaves out
what the guard thread could not tick through. Here, a real worker process
(sim backend, real Redis) stopped for several times its deadlines keeps
serving, and a real hang after the continue still ends it with exit 3;
the clock's rule is driven directly with a fake clock.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.plugins_for_tests import COMPUTE_US_ENV
from tests.support import FAST_BEAT, SimModel, wait_for
from tests.worker.test_stage_deadlines import FakeClock
from tests.workers import Fleet, WorkerProcess
from tokenq.producer import Client, ReplyTimeout
from tokenq.worker.backends.sim import SIM_HANG_MARKER
from tokenq.worker.loop.lifecycle import Lifecycle
from tokenq.worker.loop.stages import TOKENIZING, Overdue, StageClock, Stages
from tokenq.worker.loop.watchdog import LoopGuard, patience_s

MODEL = SimModel()
BATCH_TIMEOUT_S = 3.0
SHORT_DEADLINES = (
    "--batch-timeout-s", str(BATCH_TIMEOUT_S),
    # an XREADGROUP's deadline: 2 x (0.1 s block + 0.5 s socket + 0.5 s connect) = 2.2 s
    "--block-ms", "100", "--socket-timeout-s", "0.5", "--retries", "0",
    "--sim-hang-s", "600",
)
BACKEND = "tests.plugins_for_tests:sim_computing_hanging_tokenizer"


@pytest.fixture
def fleet(worker_env: dict[str, str], tmp_path: Path) -> Iterator[Fleet]:
    """Workers whose batches compute 1 ms of CPU per padded token (a 900-token batch holds
    the device for about 0.9 s of CPU, however long the process is stopped meanwhile)."""
    group = Fleet({**worker_env, COMPUTE_US_ENV: "1000"}, tmp_path,
                  MODEL.flags(*SHORT_DEADLINES, *FAST_BEAT, backend=BACKEND), ready_timeout=60)
    yield group
    group.close()


def stop_for(worker: WorkerProcess, seconds: float) -> None:
    """SIGSTOP the worker for ``seconds``; it is continued whatever happens meanwhile."""
    os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(worker.process.pid, signal.SIGCONT)


def stopped_mid_batch_then_served(worker: WorkerProcess, client: Client, seconds: float) -> None:
    """Stop the worker while a slow batch is on the device and its XREADGROUP waits; once
    continued it answers that batch and later requests, and does not exit."""
    slow = " ".join(f"w{i}" for i in range(900))
    slow_id = client.submit(slow)
    time.sleep(0.3)  # the batch is on the device (about 0.9 s of CPU)
    stop_for(worker, seconds)
    try:
        answer = client.result(slow_id, timeout_s=30)
    except ReplyTimeout as timeout:
        raise AssertionError(worker.output()[-3000:]) from timeout
    assert MODEL.vector_ok(answer.embedding, slow)
    for index in range(20):
        text = f"after the continue {index}"
        assert MODEL.vector_ok(client.result(client.submit(text), timeout_s=30).embedding, text)
    time.sleep(2 * BATCH_TIMEOUT_S)  # several watchdog and guard periods
    assert worker.process.poll() is None, worker.output()[-3000:]
    assert "hung" not in worker.output(), worker.output()[-3000:]


def test_a_worker_stopped_past_the_guards_patience_serves_on_and_a_hung_device_still_ends_it(
    fleet: Fleet, r: redis.Redis, redis_url: str, queue_name: str,
):
    """Stopped for 24 s: over seven times the batch timeout (3 s) and ten times an
    XREADGROUP's deadline (2.2 s), the watchdog's rules, and past a stage's deadline plus
    the loop guard's patience (about 18 s here), so the guard thread too would have called
    the loop stuck. That the guard still finds a stage hung after a stop: the unit test below;
    a tokenizer hung on the event loop ended by it: tests/worker/test_stage_deadlines.py."""
    worker = fleet.start(name="stopped", ready=r, queue=queue_name)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        stopped_mid_batch_then_served(worker, client, 24.0)
        client.submit(f"{SIM_HANG_MARKER} a device that stops answering")
        assert worker.process.wait(timeout=30) == 3, worker.output()[-3000:]
    assert "device hung" in worker.output()


# ------------------------------------------------------------------ the clock


@pytest.mark.unit
def test_the_stage_clock_leaves_out_what_the_ticks_could_not_cover():
    raw = FakeClock()
    clock = StageClock(1.0, raw)
    assert clock() == 100.0  # not ticked: the monotonic clock itself
    raw.now = 110.0
    assert clock() == 110.0
    clock.tick()
    for _ in range(5):  # ticked once a second: every second counts
        raw.now += 1.0
        clock.tick()
    assert clock() == 115.0
    raw.now += 61.0  # a stop of a minute: read before the next tick, at most 1.5 s counts
    assert clock() == 116.5
    clock.tick()
    assert clock() == 116.5
    raw.now += 1.0
    clock.tick()
    assert clock() == 117.5  # after the stop, time counts again
    clock.stop_ticking()
    raw.now += 30.0  # no one ticks: every second counts again
    assert clock() == 147.5


@pytest.mark.unit
def test_a_stage_clock_with_no_gap_bound_counts_everything():
    raw = FakeClock()
    clock = StageClock(math.inf, raw)
    clock.tick()
    raw.now += 1000.0
    clock.tick()
    assert clock() == 1100.0



@pytest.mark.unit
def test_the_guard_thread_leaves_out_a_stop_it_could_not_tick_through():
    """A jump of the clock between two of the guard's ticks is a stop, however long: the
    stage running across it is not overdue, to the guard or to a watchdog reading later."""
    clock, reads = FakeClock(), []

    def raw() -> float:
        reads.append(clock.now)
        return clock.now

    ticked = StageClock(0.01, raw)
    stages = Stages(ticked)
    called: list[Overdue] = []
    guard = LoopGuard(stages=stages, lifecycle=Lifecycle(ticked), period_s=0.01,
                      on_stuck=called.append, clock=ticked)
    with stages.running(TOKENIZING, "a read", 1.0, "the limit"):
        guard.start()
        try:
            clock.now += 1000.0  # a stop of 1,000 s: the guard's thread ticked through none
            seen = len(reads)
            wait_for(lambda: reads.count(clock.now) >= 20 and len(reads) > seen + 20, 10,
                     "the guard to tick after the stop")
            assert stages.overdue(stages.now()) is None
        finally:
            guard.stop()
    assert called == []
    assert stages.now() < 100.0 + 1.0


@pytest.mark.unit
def test_after_a_stop_the_guard_still_finds_a_stage_hung_past_its_patience():
    """What the guard checks once a period: the stop is left out, the time after the
    continue counts, so a stage hung since is stuck past its deadline plus the patience."""
    raw = FakeClock()
    clock = StageClock(1.0, raw)
    stages = Stages(clock)
    guard = LoopGuard(stages=stages, lifecycle=Lifecycle(clock), period_s=1.0,
                      on_stuck=lambda late: pytest.fail(f"called stuck: {late}"), clock=clock)
    with stages.running(TOKENIZING, "a read", 1.0, "the limit"):
        clock.tick()
        raw.now += 1000.0  # a stop: 1.5 s of it counts
        clock.tick()
        assert guard.check(clock()) is None
        for _ in range(17):  # then ticked once a second: 18.5 s counted
            raw.now += 1.0
            clock.tick()
        assert patience_s(1.0) == 18.0
        assert guard.check(clock()) is None  # 17.5 s past the deadline
        raw.now += 1.0
        clock.tick()
        late = guard.check(clock())
        assert late is not None and late.stage.name == TOKENIZING
