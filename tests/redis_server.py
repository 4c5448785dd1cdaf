"""The tests' own redis-server (the launcher ``tokenq up`` uses), free ports, process trees.

Ports: :func:`free_ports` finds ``count`` consecutive ports that nothing
holds, below the kernel's ephemeral range, so no outgoing connection (a
Redis client's) takes one between the check and the bind of the process
under test — the race that made ``--metrics-port P`` with ``--devices``
(child *i* on ``P + i``) flaky when P came from the ephemeral range. Under
pytest-xdist each worker picks from its own slice of that range.

Processes: :func:`descendants` walks ``/proc/<pid>/stat`` parent links;
:func:`kill_tree` SIGKILLs a process and every descendant it had, and reaps
them; :func:`become_subreaper` makes orphans of killed parents this
process's children, so they stay findable (``tests/conftest.py`` uses it for
its end-of-session check that no test left a process behind).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from tokenq.worker.tooling.children import prctl
from tokenq.worker.tooling.embedded import find_redis_server, free_port, server_command

__all__ = [
    "RedisServer", "alive", "become_subreaper", "cmdline", "descendants", "find_redis_server",
    "free_port", "free_ports", "kill_tree", "reap", "wait_gone",
]

# ------------------------------------------------------------------ server

_PORT_TRIES = 5  # ports a RedisServer that chose its own tries before giving up


class RedisServer:
    """One redis-server process in its own directory, on loopback only."""

    def __init__(
        self, directory: Path, *, port: int | None = None, appendonly: bool = False,
        args: tuple[str, ...] = (),
    ) -> None:
        self.directory = directory
        self.port = port or free_port()
        self._movable = port is None  # a port of its own choosing that nobody was told yet
        self.appendonly = appendonly
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        self._movable = False  # handed out: someone may connect to this port later
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it answers PING; a port of its own choosing that
        another process took first is replaced (not once its URL was handed out)."""
        tries = _PORT_TRIES if self._movable else 1
        for attempt in range(1, tries + 1):
            if self._start_once(timeout):
                self._movable = False
                return
            if attempt < tries:
                self.port = free_port()
        assert self.process is not None
        raise RuntimeError(f"redis-server exited with {self.process.returncode}")

    def _start_once(self, timeout: float) -> bool:
        """Start the server; True once it answers, False when it exited first."""
        self.directory.mkdir(parents=True, exist_ok=True)
        command = server_command(self.directory, self.port, appendonly=self.appendonly,
                                 args=self.args)
        # Its own session: a terminal's Ctrl-C reaches the workers, which stop before it.
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:  # no retries: a port that does not answer is asked again after a poll
                with redis.Redis(port=self.port, socket_timeout=0.5, retry=None) as client:
                    answering = int(client.info("server")["process_id"])
                if answering == self.process.pid:  # not another process's server on the port
                    return True
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (SIGTERM, or SIGKILL with ``kill``)."""
        if self.process is None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


# ------------------------------------------------------------------- ports


def _ephemeral_low() -> int:
    try:
        low, _ = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low)
    except (OSError, ValueError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:  # no SO_REUSEADDR: exactly what the server's bind will meet
        try:
            sock.bind(("0.0.0.0", port))  # conflicts with any local address on that port
        except OSError:
            return False
    return True


def _window() -> tuple[int, int]:
    """The ports this process picks from: 10000 up to the ephemeral range, and under
    pytest-xdist only worker *i*'s *i*-th slice of it, so two workers never pick alike."""
    low, high = 10000, min(_ephemeral_low(), 65536)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and workers > 1:
        span = (high - low) // workers
        low += int(worker[2:]) % workers * span
        high = low + span
    return low, high


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports that nothing uses right now.

    Picked at random from :func:`_window`, below the ephemeral range, where
    only explicit binds go.
    """
    low, high = _window()
    for _ in range(200):
        base = random.randrange(low, max(high - count, low + 1))
        if all(_bindable(port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


# --------------------------------------------------------------- processes


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, is not)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), zombies included."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[1], []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def reap(pids: list[int] | None = None) -> None:
    """Collect exited children of this process (orphans a subreaper took in)."""
    for pid in pids if pids is not None else descendants(os.getpid()):
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def wait_gone(pids: list[int], timeout: float, *, keep: int | None = None) -> list[int]:
    """Wait until none of ``pids`` runs; those still running after ``timeout``.

    Exited ones are reaped, except ``keep`` (a Popen's own, which its wait() collects).
    """
    deadline = time.monotonic() + timeout
    while True:
        reap([pid for pid in pids if pid != keep])
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def kill_tree(process: subprocess.Popen | int, timeout: float = 10.0) -> list[int]:
    """SIGKILL ``process`` and all its descendants, reap them; the pids that were running.

    The tree is read before anything is killed (a dead parent's children
    move to init or a subreaper and are no longer its descendants), parent
    first, so a supervisor cannot restart what is being killed; and read
    again in case a child was being started just then.
    """
    pid = process if isinstance(process, int) else process.pid
    keep = None if isinstance(process, int) else pid
    killed: list[int] = []
    for _ in range(5):
        tree = [p for p in [pid, *descendants(pid)] if alive(p) and p not in killed]
        tree += [p for p in killed if alive(p)]
        if not tree:
            break
        for target in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(target, signal.SIGCONT)  # a stopped process cannot die otherwise
                os.kill(target, signal.SIGKILL)
            if target not in killed:
                killed.append(target)
        wait_gone(tree, timeout, keep=keep)
    if isinstance(process, subprocess.Popen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout)
    reap([p for p in killed if p != keep])
    return killed


def become_subreaper() -> bool:
    """Linux: orphaned descendants become this process's children instead of init's."""
    return prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


@contextlib.contextmanager
def frozen(server: RedisServer) -> Iterator[None]:
    """The server SIGSTOPped for the block (its connections open, nothing answered), and
    SIGCONTed whatever happens in it."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


@contextlib.contextmanager
def freezable_server(folder: Path) -> Iterator[RedisServer]:
    """A private redis-server a test may SIGSTOP or kill; thawed and stopped whatever happens."""
    own = RedisServer(folder)
    own.start()
    try:
        yield own
    finally:
        if own.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(own.process.pid, signal.SIGCONT)
            own.stop(kill=True)
