"""Where a read is admitted (``AdmitPlace``, ``worker/loop/reader.py``) and the guard behind a
stuck loop.

The rule is pure, so it is driven with plain numbers: nothing before a read
was measured, a cheap tokenizer moves to the loop, one expensive read sends
the next ones back to a thread at once, and cheap reads bring them back
only slowly. The guard (``worker/loop/watchdog.py``) runs with a fake clock and
a fake exit; the whole path, a real worker whose tokenizer hangs on the
loop, is in ``test_stage_deadlines.py``.
"""

from __future__ import annotations

import math
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.worker.test_stage_deadlines import FakeClock
from tokenq.shared.settings import BaseWorkerSettings
from tokenq.worker.loop.lifecycle import Lifecycle
from tokenq.worker.loop.reader import FALL, REQUEST_UNITS, AdmitPlace
from tokenq.worker.loop.stages import TOKENIZING, Overdue, StageClock, Stages
from tokenq.worker.loop.watchdog import LoopGuard, patience_s

pytestmark = pytest.mark.unit

MS = 0.001


def test_a_read_goes_to_a_thread_until_one_was_measured():
    place = AdmitPlace(1 * MS)
    assert not place.on_loop(1)
    place.learn(AdmitPlace.units(100, 2000), 0.1 * MS)
    assert place.on_loop(AdmitPlace.units(100, 2000))


def test_units_count_requests_and_characters():
    assert AdmitPlace.units(3, 10) == 3 * REQUEST_UNITS + 10


def test_a_read_predicted_over_the_budget_goes_to_a_thread():
    place = AdmitPlace(1 * MS)
    place.learn(1000, 0.5 * MS)  # 0.5 µs a unit
    assert place.on_loop(2000)  # 1 ms: at the budget
    assert not place.on_loop(2001)


def test_one_expensive_read_sends_the_next_to_a_thread_at_once_and_cheap_ones_return_slowly():
    place = AdmitPlace(1 * MS)
    place.learn(1000, 0.1 * MS)
    assert place.on_loop(1000)
    place.learn(1000, 5 * MS)  # a slow read (long text, a slow tokenizer): at once
    assert not place.on_loop(1000)
    reads = 0
    while not place.on_loop(1000):
        place.learn(1000, 0.1 * MS)
        reads += 1
    # from 5 µs to 1 µs a unit at a tenth of the way per read
    assert reads > 10
    assert place.seconds_per_unit == pytest.approx(
        0.1e-6 + (5e-6 - 0.1e-6) * (1 - FALL) ** reads)


@pytest.mark.parametrize("place", [AdmitPlace(0.0), AdmitPlace(1 * MS, threads_only=True)],
                         ids=["budget 0", "tokenizer processes"])
def test_a_zero_budget_or_tokenizer_processes_always_use_a_thread(place: AdmitPlace):
    place.learn(1000, 1e-9)
    assert not place.on_loop(1)


def test_a_negative_budget_is_refused_and_nonsense_measures_are_ignored():
    with pytest.raises(ValueError, match="budget_s"):
        AdmitPlace(-1.0)
    place = AdmitPlace(1 * MS)
    place.learn(0, 1.0)
    place.learn(10, -1.0)
    assert place.seconds_per_unit is None


@given(st.lists(st.tuples(st.integers(1, 10**7), st.floats(0, 10)), min_size=1, max_size=50))
def test_the_rate_is_never_below_the_last_read_and_never_above_the_dearest(
    reads: list[tuple[int, float]],
):
    """Whatever the reads, the rate covers the latest one (so a read like it is predicted
    at least at its cost) and never exceeds the dearest seen (no runaway)."""
    place = AdmitPlace(1 * MS)
    for units, seconds in reads:
        place.learn(units, seconds)
        assert place.seconds_per_unit is not None
        assert place.seconds_per_unit >= seconds / units * (1 - 1e-12)
    assert place.seconds_per_unit <= max(s / u for u, s in reads) * (1 + 1e-12)


def test_the_setting_has_a_default_a_range_and_zero():
    assert BaseWorkerSettings(queue="q").admit_inline_ms == 2.0
    assert BaseWorkerSettings(queue="q", admit_inline_ms=0).admit_inline_ms == 0
    with pytest.raises(ValueError, match="admit_inline_ms"):
        BaseWorkerSettings(queue="q", admit_inline_ms=-1)


# ------------------------------------------------------------------------- guard


def test_the_guard_waits_for_the_watchdog_before_calling_the_loop_stuck():
    clock = FakeClock()
    stages = Stages(clock)
    guard = LoopGuard(stages=stages, lifecycle=Lifecycle(clock), period_s=1.0,
                      on_stuck=lambda late: None, clock=StageClock(1.0, clock))
    with stages.running(TOKENIZING, "a read of 3 requests being tokenized on the event loop",
                        2.0, "the limit"):
        assert guard.check(clock.now + 2.0) is None  # overdue, but the watchdog's turn
        assert guard.check(clock.now + 2.0 + patience_s(1.0) - 0.01) is None
        late = guard.check(clock.now + 2.0 + patience_s(1.0))
        assert late is not None and late.stage.name == TOKENIZING
    assert guard.check(clock.now + 1000.0) is None  # the stage ended: nothing is stuck


def test_a_stop_shortens_the_guards_wait_for_a_tokenizing_stage():
    clock = FakeClock()
    stages, lifecycle = Stages(clock), Lifecycle(clock)
    guard = LoopGuard(stages=stages, lifecycle=lifecycle, period_s=1.0,
                      on_stuck=lambda late: None, clock=StageClock(1.0, clock))
    with stages.running(TOKENIZING, "a read", 300.0, "batch_timeout_s", shortened_by_stop=True):
        lifecycle.stop_started = clock.now
        late = guard.check(clock.now + 5.0 + patience_s(1.0))
        assert late is not None and "stop grace" in late.reason


def test_the_guard_thread_calls_on_stuck_once_and_stop_ends_it():
    clock = FakeClock()
    ticked = StageClock(math.inf, clock)  # the fake clock's jump is time the guard ticked through
    stages = Stages(ticked)
    called: list[Overdue] = []
    fired = threading.Event()

    def on_stuck(late: Overdue) -> None:
        called.append(late)
        fired.set()

    guard = LoopGuard(stages=stages, lifecycle=Lifecycle(clock), period_s=0.01,
                      on_stuck=on_stuck, clock=ticked)
    with stages.running(TOKENIZING, "a read", 1.0, "the limit"):
        guard.start()
        clock.now += 1.0 + patience_s(0.01) + 1.0
        assert fired.wait(10)
    guard.stop()
    assert len(called) == 1 and called[0].stage.what == "a read"

    quiet = LoopGuard(stages=Stages(ticked), lifecycle=Lifecycle(ticked), period_s=0.01,
                      on_stuck=on_stuck, clock=ticked)
    quiet.start()
    quiet.stop()
    assert len(called) == 1
