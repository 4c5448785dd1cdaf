"""worker/tooling/children.py: the restart policy (pure) and the Supervisor (real processes).

The supervisor's own parents here are small Python scripts, so the tests
can SIGKILL a parent and look for its children; ``tokenq worker --devices``
and ``tokenq up`` are tested end to end in tests/ops/test_cli_up.py.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cli_support import wait_for
from tests.redis_server import alive, cmdline, descendants, wait_gone
from tokenq.shared.exit_codes import EXIT_FATAL, EXIT_HUNG, EXIT_USAGE
from tokenq.worker.tooling.children import (
    RestartPolicy,
    Supervisor,
    describe_exit,
    guarded,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def exits(code: int) -> list[str]:
    return python(f"import sys; sys.exit({code})")


SLEEPS = python("import time; time.sleep(120)")


# ------------------------------------------------------------------ the policy


@pytest.mark.unit
def test_backoff_doubles_from_1s_to_30s():
    policy = RestartPolicy()
    delays: list[float] = []
    previous = None
    for _ in range(8):
        previous = policy.delay(EXIT_FATAL, ran_s=0.5, previous_s=previous)
        assert previous is not None
        delays.append(previous)
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]


@pytest.mark.unit
def test_backoff_resets_after_a_child_ran_60s():
    policy = RestartPolicy()
    assert policy.delay(1, ran_s=59.9, previous_s=16) == 30
    assert policy.delay(1, ran_s=60.0, previous_s=30) == 1
    assert policy.delay(1, ran_s=3600, previous_s=None) == 1


@pytest.mark.unit
@pytest.mark.parametrize("code", [1, EXIT_HUNG, EXIT_FATAL, 137, -signal.SIGKILL,
                                  -signal.SIGSEGV, -signal.SIGTERM])
def test_failures_are_restarted(code: int):
    assert RestartPolicy().delay(code, ran_s=0, previous_s=None) == 1


@pytest.mark.unit
@pytest.mark.parametrize("code", [0, EXIT_USAGE])
def test_clean_stops_and_usage_errors_are_final(code: int):
    policy = RestartPolicy()
    assert policy.delay(code, ran_s=0, previous_s=None) is None
    assert policy.delay(code, ran_s=1000, previous_s=30) is None


@pytest.mark.unit
def test_policy_is_configurable():
    policy = RestartPolicy(initial_s=0.5, max_s=1.5, reset_after_s=5,
                           final_codes=frozenset({0, 2, 3}))
    assert policy.delay(3, 0, None) is None
    assert [policy.delay(4, 0, p) for p in (None, 0.5, 1.0, 1.5)] == [0.5, 1.0, 1.5, 1.5]


@pytest.mark.unit
def test_exits_are_described_with_their_meaning():
    assert describe_exit(3) == "exit code 3 (a batch hung past batch_timeout_s)"
    assert describe_exit(2) == "exit code 2 (configuration or usage error)"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(77) == "exit code 77"


# ------------------------------------------------------------- the supervisor


class Clock:
    """A hand-moved monotonic clock, so backoff is tested without sleeping through it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settle(supervisor: Supervisor, until: Callable[[], bool], timeout: float = 30) -> None:
    """Poll the supervisor until ``until()`` holds."""
    def check() -> bool:
        supervisor.poll()
        return until()
    wait_for(check, timeout=timeout, what="the supervisor")


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    sup = Supervisor(stop_timeout_s=5, poll_s=0.02)
    yield sup
    sup.stop(timeout_s=1)


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog on the ``tokenq.worker`` logger itself (logs.configure stops propagation)."""
    logger = logging.getLogger("tokenq.worker")
    level = logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)


def test_a_failing_child_is_restarted_with_growing_backoff(logged):
    clock = Clock()
    sup = Supervisor(clock=clock, poll_s=0.02)
    try:
        child = sup.start("crasher", exits(EXIT_HUNG), os.environ)
        pids = [child.pid]
        for restarts, delay in enumerate([1, 2, 4, 8], start=1):
            settle(sup, lambda: not child.running)
            due = child.restart_at
            assert child.returncode == EXIT_HUNG and due == clock.now + delay
            clock.now = due - 0.01
            sup.poll()
            assert child.restarts == restarts - 1, "not before its time"
            clock.now = due
            sup.poll()
            assert child.restarts == restarts and child.running and child.pid not in pids
            pids.append(child.pid)
        assert f"crasher (pid {pids[0]}) exited with exit code 3" in logged.text
        assert "restarting in 8.0s" in logged.text
        assert f"restarted crasher (pid {pids[4]}; restart 4)" in logged.text
    finally:
        sup.stop(timeout_s=1)


def test_backoff_starts_over_after_a_long_healthy_run():
    clock = Clock()
    sup = Supervisor(clock=clock, poll_s=0.02)
    try:
        child = sup.start("flaky", exits(1), os.environ)
        child.delay_s = 30.0  # as if it had failed often before
        clock.now += 61  # ... but this process ran for a minute
        settle(sup, lambda: not child.running)
        assert child.restart_at == clock.now + 1
    finally:
        sup.stop(timeout_s=1)


@pytest.mark.parametrize("code", [0, EXIT_USAGE])
def test_exit_0_and_2_are_not_restarted(code: int, supervisor: Supervisor, logged):
    child = supervisor.start("once", exits(code), os.environ)
    supervisor.run()  # returns: nothing left running or due to restart
    assert child.finished and child.restarts == 0 and child.returncode == code
    assert supervisor.exit_code() == code
    assert f"exited with {describe_exit(code)}" in logged.text
    assert "not restarting" in logged.text


def test_parent_exits_2_only_when_every_child_has(supervisor: Supervisor):
    bad = supervisor.start("bad", exits(EXIT_USAGE), os.environ)
    good = supervisor.start("good", python("import time; time.sleep(3)"), os.environ)
    settle(supervisor, lambda: bad.finished)
    assert good.running and any(child.live for child in supervisor.children)
    supervisor.run()
    assert good.returncode == 0 and supervisor.exit_code() == EXIT_USAGE


def test_restart_false_children_are_never_restarted(supervisor: Supervisor):
    child = supervisor.start("one-shot", exits(EXIT_FATAL), os.environ, restart=False)
    supervisor.run()
    assert child.finished and child.restarts == 0 and supervisor.exit_code() == EXIT_FATAL


def test_stop_sigterms_then_sigkills_who_overstays(supervisor: Supervisor, logged):
    stubborn = supervisor.start("stubborn", python("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(120)
    """), os.environ, stdout=subprocess.PIPE)
    polite = supervisor.start("polite", SLEEPS, os.environ)
    assert stubborn.process is not None and stubborn.process.stdout is not None
    assert stubborn.process.stdout.readline() == b"ready\n"
    supervisor.stop(timeout_s=0.5)
    assert polite.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL
    assert "still running after 0.5s: stubborn; killing" in logged.text
    assert supervisor.exit_code() == 128 + signal.SIGKILL
    stubborn.process.stdout.close()


def test_nothing_restarts_once_stopping(supervisor: Supervisor):
    child = supervisor.start("crasher", exits(EXIT_FATAL), os.environ)
    supervisor.stopping = True  # what a stop signal does
    settle(supervisor, lambda: child.finished)
    assert child.restarts == 0 and child.restart_at is None


def test_the_guard_passes_exit_codes_and_signals_through(tmp_path: Path):
    assert subprocess.run(guarded(exits(EXIT_HUNG))).returncode == EXIT_HUNG
    killed = subprocess.run(guarded(python("import os, signal; os.kill(os.getpid(), 9)")))
    assert killed.returncode == -signal.SIGKILL


# ------------------------------------------------- parents that die or are told to stop

PARENT = """
import os, sys
from tokenq.worker.tooling.children import Supervisor
with Supervisor(die_with_parent=sys.argv[1], stop_timeout_s=5) as sup:
    child = sup.start("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"],
                      os.environ)
    print(child.pid, flush=True)
    sup.run()
sys.exit(sup.exit_code())
"""


def start_parent(spawn, tmp_path: Path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = spawn([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    int(parent.stdout.readline())
    # The sleeper, and in guard mode the guard above it: everything below the parent.
    wait_for(lambda: any("time.sleep(120)" in cmdline(p) for p in descendants(parent.pid)
                         if alive(p)), timeout=30, what="the sleeper")
    return parent, [p for p in descendants(parent.pid) if alive(p)]


@linux_only
@pytest.mark.parametrize("mode", ["prctl", "guard"])
def test_children_die_when_the_parent_is_killed(mode: str, spawn, tmp_path: Path):
    parent, below = start_parent(spawn, tmp_path, mode)
    assert below
    parent.kill()
    parent.wait(timeout=10)
    assert not wait_gone(below, 10), f"outlived a SIGKILLed parent ({mode})"


@linux_only
def test_without_protection_the_child_would_outlive_its_parent(spawn, tmp_path: Path):
    """The control for the test above: a plain child is orphaned (killed at teardown)."""
    parent, below = start_parent(spawn, tmp_path, "none")
    parent.kill()
    parent.wait(timeout=10)
    assert wait_gone(below, 1) == below
    for pid in below:
        os.kill(pid, signal.SIGKILL)
    wait_gone(below, 10)


@linux_only
@pytest.mark.parametrize("mode", ["prctl", "guard"])
def test_sigterm_to_the_parent_stops_the_children_and_it_exits_0(
    mode: str, spawn, tmp_path: Path,
):
    parent, below = start_parent(spawn, tmp_path, mode)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 0
    assert not wait_gone(below, 5)


def ignores_sigterm(pid: int) -> bool:
    """Whether ``pid`` ignores SIGTERM now (the ``SigIgn`` mask of /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


STUBBORN_PARENT = """
import os, sys
from tokenq.worker.tooling.children import Supervisor
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
with Supervisor(stop_timeout_s=60) as sup:
    child = sup.start("stubborn", [sys.executable, "-c", stubborn], os.environ)
    print(child.pid, flush=True)
    sup.run()
sys.exit(sup.exit_code())
"""


@linux_only
def test_a_second_signal_kills_the_children_at_once(spawn, tmp_path: Path):
    script = tmp_path / "parent.py"
    script.write_text(STUBBORN_PARENT)
    parent = spawn([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    # Its command line shows at exec, before Python has set SIGTERM aside: wait for the mask.
    wait_for(lambda: ignores_sigterm(child), timeout=30, what="the child ignoring SIGTERM")
    parent.send_signal(signal.SIGTERM)  # the child ignores it: the parent waits up to 60 s
    wait_for(lambda: alive(child), timeout=5, what="the child still running")
    time.sleep(1.5)  # past the window in which a repeat is the same stop
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=20) == 128 + signal.SIGKILL
    assert not wait_gone([child], 5)
