"""Start and stop real worker processes for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tokenq.shared import keys


class WorkerProcess:
    """``python -m tokenq.worker`` in a subprocess, with its stderr kept in a file."""

    def __init__(self, env: dict[str, str], log_dir: Path, *flags: str, name: str = "w") -> None:
        self.log_path = log_dir / f"{name}.log"
        self.batch_log = log_dir / f"{name}.batches.jsonl"
        self.command = [
            sys.executable, "-m", "tokenq.worker",
            "--consumer", name, "--batch-log", str(self.batch_log), *flags,
        ]
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            self.command, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.name = name

    def wait_ready(self, client: redis.Redis, queue: str, timeout: float = 30.0) -> None:
        """Block until the worker's heartbeat appears (it has joined the group)."""
        q = keys.QueueRef(queue)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if client.exists(keys.worker_alive(q, self.name)):
                return
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited early:\n{self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"worker not ready in {timeout}s:\n{self.output()}")

    def terminate(self, timeout: float = 30.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def batches(self) -> list[dict]:
        if not self.batch_log.exists():
            return []
        return [json.loads(line) for line in self.batch_log.read_text().splitlines() if line]

    def close(self) -> None:
        if self.process.poll() is None:
            self.kill()
        self._log.close()


@dataclass
class Fleet:
    """The worker processes one test started; ``close`` ends all of them.

    ``flags`` go to every worker (backend, sizes, heartbeat); ``start`` adds
    per-worker flags and, given ``ready`` and ``queue``, waits for its heartbeat.
    """

    env: dict[str, str]
    log_dir: Path
    flags: tuple[str, ...] = ()
    ready_timeout: float = 30.0
    started: list[WorkerProcess] = field(default_factory=list)

    def start(self, *flags: str, name: str | None = None, env: dict[str, str] | None = None,
              ready: redis.Redis | None = None, queue: str | None = None) -> WorkerProcess:
        worker = WorkerProcess(
            env or self.env, self.log_dir, *self.flags, *flags,
            name=name or f"w{len(self.started)}",
        )
        self.started.append(worker)
        if ready is not None and queue is not None:
            worker.wait_ready(ready, queue, timeout=self.ready_timeout)
        return worker

    def start_many(self, count: int, *flags: str, ready: redis.Redis, queue: str,
                   env: dict[str, str] | None = None) -> list[WorkerProcess]:
        """``count`` workers started at once, then each waited for: their imports overlap,
        where one ``start(..., ready=...)`` after another waits out each in turn."""
        workers = [self.start(*flags, env=env) for _ in range(count)]
        for worker in workers:
            worker.wait_ready(ready, queue, timeout=self.ready_timeout)
        return workers

    def logs(self) -> str:
        return "\n".join(f"--- {w.name}\n{w.output()[-3000:]}" for w in self.started)

    def close(self) -> None:
        for worker in self.started:
            if worker.process.poll() is None:
                os.kill(worker.process.pid, signal.SIGCONT)  # a stopped one cannot die otherwise
            worker.close()
