"""``tokenq up``: a private Redis and N workers, for development and demos.

Without ``--redis-url`` it starts ``redis-server`` (AOF on, loopback only, a
free port, data in a temporary directory or ``--data-dir``), then N worker
processes, and prints one line saying where to enqueue::

    tokenq up: enqueue to redis://127.0.0.1:PORT/0 queue NAME

Ctrl-C or SIGTERM stops the workers first (each finishes and answers what it
read), then Redis, then removes the temporary directory. Flags after ``--``
go to every worker unchanged (``tokenq up -- --max-batch-tokens 4096``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from tokenq.shared import keys
from tokenq.shared.cli import run_command
from tokenq.shared.settings import UpSettings
from tokenq.worker import logs
from tokenq.worker.embedded import RedisServer
from tokenq.worker.supervise import PER_CHILD_ENV, Children

log = logging.getLogger("tokenq.worker")

_POLL_S = 0.2


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    own, worker_flags = split_passthrough(args)
    return run_command(UpSettings, own, "tokenq up", lambda s: up(s, worker_flags))


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """``tokenq up`` flags before ``--``, flags for every worker after it."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, []


def worker_command(settings: UpSettings, redis_url: str, index: int,
                   extra: Sequence[str]) -> list[str]:
    """The argv of worker ``index``."""
    command = [
        sys.executable, "-m", "tokenq.worker",
        "--redis-url", redis_url, "--queue", settings.queue, "--prefix", settings.prefix,
        "--backend", settings.backend,
    ]
    if settings.metrics_port:
        command += ["--metrics-port", str(settings.metrics_port + index)]
    return command + list(extra)


def up(settings: UpSettings, worker_flags: Sequence[str]) -> int:
    logs.configure("INFO", json_lines=False)
    server: RedisServer | None = None
    temp_dir: str | None = None
    children = Children()
    children.install_signal_handlers()  # before anything starts: Ctrl-C always cleans up
    try:
        redis_url = settings.redis_url
        if redis_url is None:
            if settings.data_dir is None:
                temp_dir = tempfile.mkdtemp(prefix="tokenq-up-")
            directory = settings.data_dir or Path(temp_dir or ".")
            server = RedisServer(directory, port=settings.port or None, appendonly=True)
            server.start()
            redis_url = server.url
            log.info("redis-server on %s (AOF on, data in %s)", redis_url, directory)
        # Worker settings pass through as TOKENQ_*; names, ports and devices are per worker.
        env = {k: v for k, v in os.environ.items() if k not in PER_CHILD_ENV}
        env.setdefault("PYTHONUNBUFFERED", "1")
        for index in range(settings.workers):
            if children.stopping:
                break
            command = worker_command(settings, redis_url, index, worker_flags)
            children.start(f"worker {index}", command, env)
        print(f"tokenq up: enqueue to {redis_url} queue {settings.queue}", flush=True)
        _watch(children, redis_url, settings)
    finally:
        if children.running:
            children.stop(settings.stop_timeout_s)
        if server is not None:
            server.stop()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        children.restore_signal_handlers()
    return children.exit_code()


def _watch(children: Children, redis_url: str, settings: UpSettings) -> None:
    """Report when the workers are ready; return when all exited or a stop signal came."""
    q = keys.QueueRef(settings.queue, settings.prefix)
    ready = settings.workers == 0
    client = redis.Redis.from_url(redis_url, socket_timeout=2.0)
    try:
        while not children.stopping and (children.running or settings.workers == 0):
            if not ready:
                with contextlib.suppress(redis.RedisError):  # Redis busy starting: ask again
                    ready = client.hlen(keys.workers(q)) >= settings.workers
                if ready:
                    print(f"tokenq up: {settings.workers} workers ready "
                          f"(tokenq stats --redis-url {redis_url})", flush=True)
            time.sleep(_POLL_S)
        if not children.stopping:
            log.warning("every worker exited; stopping")
    finally:
        client.close()
