"""``tokenq up`` (private Redis + workers) and ``tokenq worker --devices`` (one per GPU)."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis

from tests.cli_support import DIM, MAX_INPUT, wait_for
from tokenq.producer import Client
from tokenq.shared import keys
from tokenq.shared.keys import QueueRef
from tokenq.shared.settings import WorkerSettings
from tokenq.worker.embedded import free_port
from tokenq.worker.sim import expected_vector
from tokenq.worker.supervise import device_commands, strip_flags

URL_LINE = re.compile(r"^tokenq up: enqueue to (redis://\S+) queue (\S+)$")


def read_line(process: subprocess.Popen[str], timeout: float) -> str:
    """One line of the process's stdout, or fail after ``timeout`` seconds."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"no output in {timeout}s")
    return process.stdout.readline().rstrip("\n")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENQ_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_up_starts_redis_and_workers_prints_the_url_and_stops_on_ctrl_c(tmp_path: Path):
    data = tmp_path / "data"
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenq.shared.cli", "up", "--backend", "sim", "--workers", "2",
         "--queue", "demo", "--data-dir", str(data), "--",
         "--sim-dim", str(DIM), "--heartbeat-s", "0.2"],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        match = URL_LINE.match(read_line(process, 30))
        assert match, "the first line must say where to enqueue"
        url, queue = match.groups()
        assert queue == "demo" and url.startswith("redis://127.0.0.1:")
        with Client(redis_url=url, queue=queue) as client:
            result = client.infer("hello from tokenq up", timeout_s=30)
        np.testing.assert_allclose(list(result.embedding),
                                   expected_vector("hello from tokenq up", DIM, MAX_INPUT),
                                   atol=1e-6)
        assert read_line(process, 30).startswith("tokenq up: 2 workers ready")
        assert redis.Redis.from_url(url).config_get("appendonly")["appendonly"] == "yes"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, process.stderr.read() if process.stderr else ""
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    assert any(data.iterdir()), "the AOF lives in --data-dir"
    stderr = process.stderr.read() if process.stderr else ""
    assert "stopping 2 workers" in stderr and "stopped:" in stderr


def test_up_with_an_existing_redis_starts_only_workers(redis_url, queue_name, r):
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenq.shared.cli", "up", "--redis-url", redis_url,
         "--queue", queue_name, "--workers", "1", "--", "--consumer", "from-up"],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert read_line(process, 30) == f"tokenq up: enqueue to {redis_url} queue {queue_name}"
        wait_for(lambda: r.exists(keys.worker_alive(QueueRef(queue_name), "from-up")),
                 timeout=30, what="the worker's heartbeat")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert r.ping()  # not ours: left running


def test_worker_devices_runs_one_child_per_gpu(redis_url, queue_name, r):
    port = free_port()
    parent = subprocess.Popen(
        [sys.executable, "-m", "tokenq.worker", "--redis-url", redis_url, "--queue", queue_name,
         "--backend", "sim", "--devices", "0,1", "--consumer", "box", "--heartbeat-s", "0.2",
         "--metrics-port", str(port)],
        env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    q = QueueRef(queue_name)
    try:
        for name in ("box-gpu0", "box-gpu1"):
            wait_for(lambda name=name: r.exists(keys.worker_alive(q, name)), timeout=30,
                     what=f"{name}'s heartbeat")
        for index, name in enumerate(("box-gpu0", "box-gpu1")):
            beat = msgpack.unpackb(r.hget(keys.workers(q), name), raw=False)
            environ = Path(f"/proc/{beat['pid']}/environ").read_bytes().split(b"\0")
            assert f"CUDA_VISIBLE_DEVICES={index}".encode() in environ
            cmdline = Path(f"/proc/{beat['pid']}/cmdline").read_bytes().split(b"\0")
            assert b"cuda:0" in cmdline and b"--devices" not in cmdline
            text = urllib.request.urlopen(f"http://127.0.0.1:{port + index}/metrics").read()
            assert f'consumer="{name}"'.encode() in text
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    time.sleep(0.1)
    assert not r.hkeys(keys.workers(q)), "children deregistered on the way out"


def test_device_commands_strip_per_child_flags():
    settings = WorkerSettings(devices="0, 3", consumer="n", metrics_port=9100)
    argv = ["--devices", "0,3", "--consumer=n", "--device", "cuda", "--metrics-port", "9100",
            "--backend", "hf"]
    assert strip_flags(argv, ("--devices", "--consumer", "--device", "--metrics-port")) == [
        "--backend", "hf"]
    env = {"TOKENQ_DEVICES": "0,3", "TOKENQ_QUEUE": "q", "PATH": "/bin"}
    commands = device_commands(settings, argv, env)
    assert [name for name, _, _ in commands] == ["n-gpu0", "n-gpu3"]
    _, second_argv, second_env = commands[1]
    assert second_env["CUDA_VISIBLE_DEVICES"] == "3" and "TOKENQ_DEVICES" not in second_env
    assert second_env["TOKENQ_QUEUE"] == "q"
    assert second_argv[-6:] == ["--consumer", "n-gpu3", "--device", "cuda:0",
                                "--metrics-port", "9101"]
    with pytest.raises(ValueError):
        WorkerSettings(devices=",")
