"""Fixtures of the operator-command tests; load with ``pytest_plugins = ("tests.cli_fixtures",)``.

Kept apart from :mod:`tests.cli_support` (plain helpers the tests import) so
pytest can rewrite this module's asserts when it loads it as a plugin.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.cli_support import FAST_BEAT, SIM_FLAGS, StartWorker
from tests.workers import Fleet, WorkerProcess


@pytest.fixture
def sim_worker(
    worker_env: dict[str, str], tmp_path: Path, r: redis.Redis, queue_name: str
) -> Iterator[StartWorker]:
    """Start sim workers on this test's queue (heartbeat every 0.5 s); all closed after."""
    fleet = Fleet(worker_env, tmp_path, (*SIM_FLAGS, *FAST_BEAT))

    def start(*flags: str, name: str | None = None, wait: bool = True) -> WorkerProcess:
        return fleet.start(*flags, name=name, ready=r if wait else None, queue=queue_name)

    yield start
    fleet.close()
