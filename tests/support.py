"""Helpers the end-to-end tests share: the sim workers they start, the vectors those
owe, a ``fleet`` fixture, and waiting on Redis or on a condition.

Plain functions the tests import (pytest injects only what ``conftest.py`` and
plugins define, and a test module should not import ``conftest``); each is
written here once so the suite's many worker-process tests cannot drift apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from tests.workers import Fleet, WorkerProcess
from tokenq.shared import keys
from tokenq.worker.backends.sim import expected_vector

DIM = 32
MAX_INPUT = 2048
FAST_BEAT = ("--heartbeat-s", "0.5")


@dataclass(frozen=True)
class SimModel:
    """The shape of the sim backend a test's workers run: what starts them and what they owe.

    One value gives both the worker flags and the vector check, so a test's
    workers and its assertions cannot disagree on ``dim`` or ``max_input``.
    """

    dim: int = DIM
    max_input: int = MAX_INPUT

    def flags(self, *extra: str, backend: str = "sim") -> tuple[str, ...]:
        """Worker flags for this shape (``backend`` may name a plugin built on the sim)."""
        return ("--backend", backend, "--sim-dim", str(self.dim),
                "--sim-max-input-tokens", str(self.max_input), *extra)

    def vector_ok(self, embedding: Any, text: str) -> bool:
        """Whether ``embedding`` (wire bytes or a ``Result``'s float array) is ``text``'s vector."""
        if embedding is None:
            return False
        got = np.frombuffer(bytes(embedding), dtype="<f4")
        want = expected_vector(text, self.dim, self.max_input)
        return got.shape == want.shape and bool(np.allclose(got, want, rtol=0, atol=1e-6))


SIM_FLAGS = SimModel().flags()


def fleet_fixture(*flags: str) -> Any:
    """A module's ``fleet`` fixture (``fleet = fleet_fixture(*FLAGS)``): workers on this
    test's queue, each started with ``flags``, all ended after the test."""

    @pytest.fixture(name="fleet")
    def fleet(worker_env: dict[str, str], tmp_path: Path) -> Iterator[Fleet]:
        group = Fleet(worker_env, tmp_path, flags, ready_timeout=60)
        yield group
        group.close()

    return fleet


StartWorker = Callable[..., WorkerProcess]


def starter_fixture(name: str, *flags: str) -> Any:
    """A module's fixture ``name`` giving ``start(*more, name=None, wait=True)``: a worker
    on this test's queue, started with ``flags`` and ``more``, whose heartbeat it waits
    for unless ``wait`` is false; all end after the test."""

    @pytest.fixture(name=name)
    def starter(worker_env: dict[str, str], tmp_path: Path, r: redis.Redis,
                queue_name: str) -> Iterator[StartWorker]:
        group = Fleet(worker_env, tmp_path, flags)

        def start(*more: str, name: str | None = None, wait: bool = True) -> WorkerProcess:
            return group.start(*more, name=name, ready=r if wait else None, queue=queue_name)

        yield start
        group.close()

    return starter


def wait_lane_ready(worker: WorkerProcess, check: redis.Redis, queue: str, shards: int,
                    timeout: float = 30.0) -> None:
    """Block until a worker of a ``shards``-sharded queue beats on its first lane (what
    ``WorkerProcess.wait_ready`` looks for is the unsharded queue's key)."""
    lane = keys.lanes_of(keys.QueueRef(queue), shards)[0]
    deadline = time.monotonic() + timeout
    while not check.exists(keys.worker_alive(lane, worker.name)):
        assert worker.process.poll() is None, worker.output()
        assert time.monotonic() < deadline, worker.output()
        time.sleep(0.05)


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, what: str = "", *,
             poll: float = 0.05, fleet: Fleet | None = None) -> None:
    """Poll ``predicate`` until it is true; past ``timeout`` seconds fail naming ``what``
    (with ``fleet``'s worker logs, where given, to show why)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            logs = f"\n{fleet.logs()}" if fleet is not None else ""
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what or predicate}{logs}")
        time.sleep(poll)


def blpop_within(r: redis.Redis, key: str, timeout: float) -> bytes | None:
    """BLPOP in short waits (redis-py's default socket timeout is 5 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        popped = r.blpop([key], timeout=1)
        if popped is not None:
            return popped[1]
    return None


def pending_tokens(
    r: redis.Redis, q: keys.QueueRef, tenants: Sequence[str] = (keys.DEFAULT_TENANT,)
) -> tuple[int, int]:
    """(the queue's pending-token sum, the sum of ``tokens`` over its ``tenants``' streams'
    entries), read in one MULTI so no script runs between them; for streams only tokenq's
    clients wrote. Each tenant's own part is checked against its stream's on the way."""
    with r.pipeline(transaction=True) as pipe:
        pipe.hgetall(keys.pending(q))
        for tenant in tenants:
            pipe.xrange(keys.tenant_requests(q, tenant))
        held, *streams = pipe.execute()
    own = {tenant: sum(int(fields.get(b"tokens", 0)) for _, fields in entries)
           for tenant, entries in zip(tenants, streams, strict=True)}
    shares = keys.tenant_pending(held)
    assert shares == {t: n for t, n in own.items() if n or t == keys.DEFAULT_TENANT}, (held, own)
    return int(held.get(keys.PENDING_TOTAL.encode(), 0)), sum(own.values())
