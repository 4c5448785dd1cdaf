"""``tokenq up``: a private Redis (unless ``--redis-url``; AOF, loopback, a free port) and N
supervised workers; Ctrl-C stops the workers, then Redis. Flags after ``--`` go to each."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenq.shared import keys, redis_client
from tokenq.shared.cli import run_command
from tokenq.shared.failures import error_text, failure_message
from tokenq.shared.redis_url import parse_redis_url
from tokenq.shared.settings import UpSettings, flag
from tokenq.shared.text import plural
from tokenq.worker import logs
from tokenq.worker.settings import WorkerSettings
from tokenq.worker.tooling.children import Child, Supervisor, describe_exit
from tokenq.worker.tooling.embedded import free_port, server_command
from tokenq.worker.tooling.supervise import PER_CHILD_ENV

log = logging.getLogger("tokenq.worker")

_REDIS_START_S = 10.0
_REDIS_STOP_S = 10.0
_PING_S = 1.0  # how long the check of a --redis-url waits for its answer
# ``tokenq up`` settings every worker gets unchanged (URL and metrics port are per worker)
PASSED_ON = ("queue", "prefix", "backend", "shards")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    at = args.index("--") if "--" in args else len(args)  # worker flags after "--"
    own, worker_flags = args[:at], args[at + 1:]
    return run_command(UpSettings, own, "tokenq up", lambda s: up(s, worker_flags))


def worker_command(settings: UpSettings, redis_url: str, index: int,
                   extra: Sequence[str]) -> list[str]:
    command = [sys.executable, "-m", "tokenq.worker", flag(WorkerSettings, "redis_url"), redis_url]
    for name in PASSED_ON:
        command += [flag(WorkerSettings, name), str(getattr(settings, name))]
    if settings.metrics_port:
        command += [flag(WorkerSettings, "metrics_port"), str(settings.metrics_port + index)]
    return command + list(extra)


def up(settings: UpSettings, worker_flags: Sequence[str]) -> int:
    # Its workers need the worker extra: say so now, in one line, before Redis starts.
    importlib.import_module("tokenq.worker.process")
    logs.configure("INFO", json_lines=False)
    server: Child | None = None
    workers: list[Child] = []
    # Signal handlers before anything starts: Ctrl-C always cleans up; the directory goes last.
    with (
        tempfile.TemporaryDirectory(prefix="tokenq-up-", ignore_cleanup_errors=True) as temp,
        Supervisor(stop_timeout_s=settings.stop_timeout_s) as supervisor,
    ):
        try:
            redis_url = settings.redis_url
            if redis_url is None:
                directory = settings.data_dir or Path(temp)
                directory.mkdir(parents=True, exist_ok=True)
                port = settings.port or free_port()
                redis_url = f"redis://127.0.0.1:{port}/0"
                # Its own session: a Ctrl-C at the terminal reaches the workers and
                # ``tokenq up``, which stops the server last, after the workers published.
                server = supervisor.start(
                    "redis-server", server_command(directory, port, appendonly=True),
                    os.environ, start_new_session=True, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
                if not _wait_for_redis(supervisor, server, redis_url):
                    return 0 if supervisor.stopping else 1  # a stop during start is clean
                log.info("redis-server on %s (AOF on, data in %s)", redis_url, directory)
            else:
                _say_if_unreachable(redis_url)
            # Worker settings pass through as TOKENQ_*; names, ports and devices are per worker.
            env = {k: v for k, v in os.environ.items() if k not in PER_CHILD_ENV}
            env.setdefault("PYTHONUNBUFFERED", "1")
            for index in range(settings.workers):
                if supervisor.stopping:
                    break
                command = worker_command(settings, redis_url, index, worker_flags)
                workers.append(supervisor.start(f"worker {index}", command, env))
            if not supervisor.stopping:
                print(f"tokenq up: enqueue to {redis_url} queue {settings.queue}", flush=True)
                _watch(supervisor, server, workers, redis_url, settings)
        finally:
            supervisor.stop(workers)  # the workers first: Redis outlives their last publish
            if server is not None:
                supervisor.stop([server], _REDIS_STOP_S)
    return supervisor.exit_code()


def _wait_for_redis(supervisor: Supervisor, server: Child, url: str) -> bool:
    """True once the new server answers PING; False if it exits or a stop comes first."""
    deadline = time.monotonic() + _REDIS_START_S
    with contextlib.closing(redis.Redis.from_url(
            url, socket_timeout=0.5, socket_connect_timeout=0.5)) as client:
        while time.monotonic() < deadline and not supervisor.stopping:
            with contextlib.suppress(redis.RedisError):
                client.ping()
                return True
            if server.process is not None and server.process.poll() is not None:
                log.error("redis-server exited with %s at start (port taken? see --port)",
                          describe_exit(server.process.returncode))
                return False
            time.sleep(0.05)
    if not supervisor.stopping:
        log.error("redis-server did not answer on %s within %.0fs", url, _REDIS_START_S)
    return False


def _say_if_unreachable(url: str) -> None:
    """Warn at once when ``--redis-url`` does not answer a ping (the workers start anyway)."""
    options = {"socket_timeout": _PING_S, "socket_connect_timeout": _PING_S,
               "retry": Retry(NoBackoff(), 0)}
    with contextlib.closing(redis_client.sync_client(parse_redis_url(url), options)) as client:
        try:
            client.ping()
        except redis.RedisError as exc:
            log.warning("%s; starting the workers, which wait for it",
                        (failure_message(exc, url, _PING_S) or error_text(exc)).rstrip("."))


def _watch(supervisor: Supervisor, server: Child | None, workers: list[Child],
           redis_url: str, settings: UpSettings) -> None:
    """Report when the workers are ready; return on a stop, when all are done, or Redis is."""
    q = keys.QueueRef(settings.queue, settings.prefix)
    ready = not workers

    def done() -> bool:
        nonlocal ready
        if server is not None and server.finished:
            log.error("redis-server exited with %s; stopping", describe_exit(server.returncode))
            return True
        if workers and not any(worker.live for worker in workers):
            log.warning("every worker exited; stopping")
            return True
        if not ready:
            with contextlib.suppress(redis.RedisError):  # Redis busy starting: ask again
                ready = client.hlen(keys.workers(q)) >= len(workers)
            if ready:
                print(f"tokenq up: {plural(len(workers), 'worker')} ready "
                      f"(tokenq stats --redis-url {redis_url})", flush=True)
        return False

    with contextlib.closing(redis.Redis.from_url(redis_url, socket_timeout=2.0)) as client:
        supervisor.run(done)
