"""Shared fixtures: a real redis-server per test session, a fresh queue per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.redis_server import RedisServer

REPO_ROOT = Path(__file__).resolve().parent.parent


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
