"""Shared fixtures: a real redis-server per test session, a fresh queue per test, and
processes that never outlive the test (``spawn``) or the session (the safety net)."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.redis_server import (
    RedisServer,
    alive,
    become_subreaper,
    cmdline,
    descendants,
    kill_tree,
    reap,
    wait_gone,
)
from tests.unit_tier import pytest_runtest_call, pytest_runtest_setup  # noqa: F401  (the guard)

REPO_ROOT = Path(__file__).resolve().parent.parent

# Under xdist (-n N, what CI runs), one torch thread in every test process and every process
# a test starts (they inherit it; set before any test module imports torch): N processes
# already share the cores, and OpenMP threads that spin-wait for each other cost a tiny
# model's forward many times the CPU and wall it takes on one thread.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

_NOT_LEAKS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
_LEAK_GRACE_S = 5.0
"""A process still exiting when the last test ended (SIGTERM sent, not waited for) gets this."""


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_reaches_children() -> Iterator[None]:
    """Ctrl-C is an interrupt in every process a test starts, however pytest was started.

    A shell starts a background job (``.ci/run &``, ``nohup``) with SIGINT
    ignored, and an ignored signal stays ignored across fork and exec: every
    ``tokenq`` command a test then Ctrl-C's would ignore it, as it should for
    the job's own sake, and the test would wait out its timeout. A handled
    signal is reset to the default at exec, so handling it here gives each
    child Python's usual KeyboardInterrupt.
    """
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session", autouse=True)
def teardown_on_sigterm() -> Iterator[None]:
    """A SIGTERM to pytest (``timeout``, a CI runner giving up) still runs the teardowns.

    By default SIGTERM ends the process at once, and every redis-server and
    worker the session started is orphaned. As a KeyboardInterrupt, pytest
    stops the run and finalises its fixtures, which stop them.
    """

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """The safety net: at session end, no process a test started is still running.

    Set up before any other fixture (so torn down after all of them, the
    session's redis-server included). This process becomes a child
    subreaper (Linux), so the children of a killed parent are reparented to
    it rather than to init and are still found by walking ``/proc`` parent
    links. Whatever is still running ``_LEAK_GRACE_S`` after the last test
    is killed with its descendants, and the session fails naming each one.
    """
    become_subreaper()
    yield
    me = os.getpid()

    def running() -> list[int]:
        return [pid for pid in descendants(me)
                if alive(pid) and not any(name in cmdline(pid) for name in _NOT_LEAKS)]

    leaked = wait_gone(running(), _LEAK_GRACE_S)
    described = [f"pid {pid}: {cmdline(pid)}" for pid in leaked]
    for _ in range(3):  # a supervisor may have started one more meanwhile
        for pid in leaked:
            kill_tree(pid)
        leaked = running()
        described += [f"pid {pid}: {cmdline(pid)}" for pid in leaked]
    reap()
    if described:
        pytest.fail("tests left processes running (now killed):\n  " + "\n  ".join(described),
                    pytrace=False)


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """``spawn(argv, **popen_kwargs)``: a subprocess that, pass or fail, is SIGKILLed at
    teardown together with every descendant it has (a supervisor's children)."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str], **kwargs: object) -> subprocess.Popen:
        process = subprocess.Popen(argv, **kwargs)  # type: ignore[call-overload]
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:  # once reaped its pid may be someone else's: leave it
            kill_tree(process)
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server owned by this test session, on a free port."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    """A raw bytes client for assertions on keys."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def queue_name() -> str:
    """A queue name no other test uses, so tests never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def worker_env(redis_url: str, queue_name: str) -> dict[str, str]:
    """Environment for a worker subprocess bound to this test's queue."""
    env = dict(os.environ)
    env.update(
        TOKENQ_REDIS_URL=redis_url,
        TOKENQ_QUEUE=queue_name,
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``-n N``: each module with costly module-scoped fixtures on one process, the slowest
    tests first (``tests/scheduling.py``). An explicit ``--dist`` gets xdist's own."""
    if config.getvalue("dist") != "load":
        return None
    from tests.scheduling import SharedFixtureScheduling

    return SharedFixtureScheduling(config, log)
