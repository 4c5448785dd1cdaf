"""A redis-server that can be filled to its ``maxmemory`` (``noeviction``) and emptied again.

What RELIABILITY.md asks of production: ``maxmemory`` with ``noeviction``,
so a full Redis refuses writes that grow memory (``OOM``) instead of evicting
someone's queue. :func:`full_server` starts a private server set that way,
small (:data:`MAXMEMORY`) so it fills in a fraction of a second;
:func:`fill` writes junk until Redis refuses a write, and :func:`free` drops
the junk so writes go through again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.redis_server import RedisServer

MAXMEMORY = "16mb"
JUNK = "tokenq-test:junk:"
"""Prefix of the filler keys (no tokenq key starts with it)."""
_CHUNK = 256 * 1024
_BELOW = 2 * 1024 * 1024
"""How far under Redis's use a filled server's maxmemory is set."""


@contextlib.contextmanager
def full_server(folder: Path) -> Iterator[RedisServer]:
    """A private redis-server with ``maxmemory`` :data:`MAXMEMORY` and ``noeviction``."""
    server = RedisServer(
        folder, args=("--maxmemory", MAXMEMORY, "--maxmemory-policy", "noeviction"),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop(kill=True)


def full_fixture() -> Any:
    """A module's ``full`` fixture (``full = full_fixture()``): the test's own
    :func:`full_server`, as (its url, a client)."""

    @pytest.fixture
    def full(tmp_path: Path) -> Iterator[tuple[str, redis.Redis]]:
        with full_server(tmp_path / "full") as server:
            client = redis.Redis.from_url(server.url)
            yield server.url, client
            client.close()

    return full


def fill(client: redis.Redis) -> int:
    """Write junk until Redis refuses a write for lack of memory; the number of junk keys.

    Each junk key is :data:`_CHUNK` bytes, then smaller ones top it up. Then
    ``maxmemory`` is lowered to :data:`_BELOW` under what Redis uses, so that
    the few kilobytes a connection's buffers give back now and then cannot
    let a write through: every write that grows memory is refused until
    :func:`free`.
    """
    written, size = 0, _CHUNK
    while size >= 256:
        try:
            client.set(f"{JUNK}{written}", b"x" * size)
            written += 1
        except redis.exceptions.OutOfMemoryError:
            size //= 4
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(used - _BELOW))
    assert is_full(client), "filled Redis still takes writes"
    return written


def is_full(client: redis.Redis) -> bool:
    """Whether Redis refuses a write that grows memory now."""
    try:
        client.set(f"{JUNK}probe", b"y" * 1024)
    except redis.exceptions.OutOfMemoryError:
        return True
    client.delete(f"{JUNK}probe")
    return False


def free(client: redis.Redis) -> None:
    """Drop the junk and restore ``maxmemory``: writes go through again."""
    names = list(client.scan_iter(match=f"{JUNK}*", count=1000))
    for start in range(0, len(names), 500):
        client.delete(*names[start:start + 500])
    client.config_set("maxmemory", MAXMEMORY)
    assert not is_full(client)
