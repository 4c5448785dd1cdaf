"""The ``unit`` tier's guard: a test marked ``unit`` starts no process and opens no TCP socket.

``pytest -m unit`` must run without a redis-server, a worker, a gateway or a
model, so a unit test that asks for a fixture which starts one (directly or
through another fixture: the check reads the whole fixture closure) fails at
setup naming it, and one that starts a subprocess, forks or connects over TCP
itself fails at that call. fakeredis (in memory) is allowed. ``tests/conftest.py``
imports these hooks.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

UNIT = "unit"

PROCESS_FIXTURES = frozenset({
    "redis_server", "spawn", "full", "redis_cluster", "redis_sentinel", "sim_worker",
    "start_worker", "fleet", "starter",
})
"""Fixtures that start a redis-server, a worker, a gateway or another subprocess (the
fixtures built on them, ``redis_url``, ``r``, ``worker_env`` and the rest, are caught
through the closure)."""


def _is_unit(item: pytest.Item) -> bool:
    return item.get_closest_marker(UNIT) is not None


def _refuse(what: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(f"a test marked {UNIT!r} may not {what}; take the mark off "
                    "(or use fakeredis in place of a server)", pytrace=False)
    return refused


def _tcp_refused(connect: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            _refuse(f"connect over TCP (to {address!r})")()
        return connect(sock, address)
    return guarded


@contextlib.contextmanager
def _no_processes() -> Iterator[None]:
    """Subprocesses, forks and TCP connections fail the test for the block."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", _refuse("start a subprocess"))
        patch.setattr(os, "fork", _refuse("fork"))
        patch.setattr(multiprocessing.util, "spawnv_passfds", _refuse("start a process"))
        patch.setattr(socket.socket, "connect", _tcp_refused(socket.socket.connect))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """A unit test whose fixtures would start a process fails before any is set up; the
    others are set up under :func:`_no_processes`."""
    if not _is_unit(item):
        yield
        return
    starting = sorted(PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())))
    if starting:
        pytest.fail(f"{item.nodeid} is marked {UNIT!r} but uses {', '.join(starting)}, which "
                    "start(s) a process; take the mark off or drop the fixture", pytrace=False)
    with _no_processes():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A unit test runs under :func:`_no_processes`."""
    if not _is_unit(item):
        yield
        return
    with _no_processes():
        yield
