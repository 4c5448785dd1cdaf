"""``tokenq up`` (private Redis + workers) and ``tokenq worker --devices`` (one per GPU).

Both are supervisors (worker/tooling/children.py): these tests kill their children
and the parents themselves with SIGKILL, and check that failed children are
restarted, that exit codes 0 and 2 are final, and that no child outlives its
parent. Every process is started through the ``spawn`` fixture, which kills
it and its descendants at teardown, pass or fail.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis

from tests.redis_server import alive, descendants, free_ports, wait_gone
from tests.support import DIM, MAX_INPUT, wait_for
from tokenq.producer import Client
from tokenq.shared import keys
from tokenq.shared.flags import parse_settings
from tokenq.shared.keys import QueueRef
from tokenq.shared.settings import UpSettings
from tokenq.worker.backends.sim import expected_vector
from tokenq.worker.settings import WorkerSettings
from tokenq.worker.tooling import supervise
from tokenq.worker.tooling.supervise import auto_processes, device_commands, strip_flags
from tokenq.worker.tooling.up import main as up_main
from tokenq.worker.tooling.up import worker_command

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


def children_of(pid: int) -> list[int]:
    """Live direct children of ``pid``."""
    return [child for child in descendants(pid)
            if alive(child) and Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1]
            .split()[1] == str(pid)]


def beat_pid(r: redis.Redis, q: QueueRef, name: str) -> int | None:
    """The pid in ``name``'s heartbeat entry, while its liveness key exists."""
    raw = r.hget(keys.workers(q), name)
    if raw is None or not r.exists(keys.worker_alive(q, name)):
        return None
    return int(msgpack.unpackb(raw, raw=False)["pid"])


@contextlib.contextmanager
def ports_taken(base: int, count: int) -> Iterator[None]:
    """Listen on ``count`` ports from ``base``, so a worker's metrics endpoint cannot bind."""
    sockets = []
    try:
        for port in range(base, base + count):
            sock = socket.socket()
            sock.bind(("0.0.0.0", port))
            sock.listen()
            sockets.append(sock)
        yield
    finally:
        for sock in sockets:
            sock.close()


def exit_status(process: subprocess.Popen, log: Path, timeout: float) -> int:
    """``process.wait(timeout)``, failing with the tail of its log when it does not exit."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        tail = log.read_text()[-4000:]
        raise AssertionError(f"still running after {timeout}s:\n{tail}") from None


Spawn = Callable[..., subprocess.Popen]


def start_up(spawn: Spawn, log: Path, *flags: str, workers: int = 2,
             worker_flags: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """``tokenq up`` with a private Redis; the process and its URL (from its first line)."""
    with log.open("w") as stderr:  # the child has its own copy of the descriptor
        process = spawn(
            [sys.executable, "-m", "tokenq.shared.cli", "up", "--backend", "sim",
             "--workers", str(workers), *flags, "--", "--sim-dim", str(DIM),
             "--heartbeat-s", "0.2", *worker_flags],
            env=clean_env(), stdout=subprocess.PIPE, stderr=stderr, text=True,
        )
    match = URL_LINE.match(read_line(process, 30))
    assert match, f"the first line must say where to enqueue:\n{log.read_text()}"
    return process, match.group(1)


def start_devices(spawn: Spawn, log: Path, redis_url: str, queue: str, *flags: str,
                  devices: str = "0,1") -> subprocess.Popen:
    """``tokenq worker --devices`` with the sim backend, consumer base name ``box``."""
    with log.open("w") as stderr:
        return spawn(
            [sys.executable, "-m", "tokenq.worker", "--redis-url", redis_url, "--queue", queue,
             "--backend", "sim", "--devices", devices, "--consumer", "box",
             "--heartbeat-s", "0.2", *flags],
            env=clean_env(), stdout=subprocess.DEVNULL, stderr=stderr,
        )


# ------------------------------------------------------------------- tokenq up


def test_up_starts_redis_and_workers_prints_the_url_and_stops_on_ctrl_c(
    tmp_path: Path, spawn: Spawn,
):
    data, log = tmp_path / "data", tmp_path / "up.log"
    process, url = start_up(spawn, log, "--queue", "demo", "--data-dir", str(data))
    assert url.startswith("redis://127.0.0.1:")
    with Client(redis_url=url, queue="demo") as client:
        result = client.infer("hello from tokenq up", timeout_s=30)
    np.testing.assert_allclose(list(result.embedding),
                               expected_vector("hello from tokenq up", DIM, MAX_INPUT),
                               atol=1e-6)
    assert read_line(process, 30).startswith("tokenq up: 2 workers ready")
    assert redis.Redis.from_url(url).config_get("appendonly")["appendonly"] == "yes"
    children = children_of(process.pid)
    assert len(children) == 3  # redis-server and two workers
    process.send_signal(signal.SIGINT)
    assert exit_status(process, log, 30) == 0
    assert not wait_gone(children, 5)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    assert any(data.iterdir()), "the AOF lives in --data-dir"
    stderr = log.read_text()
    assert "signal SIGINT: stopping" in stderr and " stopped after " in stderr


@pytest.mark.slow
def test_up_with_an_existing_redis_starts_only_workers(redis_url, queue_name, r, spawn):
    process = spawn(
        [sys.executable, "-m", "tokenq.shared.cli", "up", "--redis-url", redis_url,
         "--queue", queue_name, "--workers", "1", "--", "--consumer", "from-up"],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert read_line(process, 30) == f"tokenq up: enqueue to {redis_url} queue {queue_name}"
    wait_for(lambda: r.exists(keys.worker_alive(QueueRef(queue_name), "from-up")),
             timeout=30, what="the worker's heartbeat")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert r.ping()  # not ours: left running


def test_up_children_die_with_it_on_kill_9(tmp_path: Path, spawn: Spawn):
    log = tmp_path / "up.log"
    # Redis gets its SIGTERM at the same moment as the workers, so each worker's last
    # read and deregistration fail and are retried: --retries 2 keeps that short (with
    # the default 10 a worker takes about 25 s to give up and exit).
    # --data-dir: a killed ``tokenq up`` cannot remove its temporary directory.
    process, _ = start_up(spawn, log, "--data-dir", str(tmp_path / "data"),
                          worker_flags=("--retries", "2"))
    assert read_line(process, 30).startswith("tokenq up: 2 workers ready")
    children = children_of(process.pid)
    assert len(children) == 3, log.read_text()
    process.kill()
    process.wait(timeout=10)
    left = wait_gone(children, 20)
    assert not left, f"outlived tokenq up: {left}\n{log.read_text()}"


def test_up_restarts_a_killed_worker_and_a_killed_redis(tmp_path: Path, spawn: Spawn):
    log = tmp_path / "up.log"
    process, url = start_up(spawn, log, "--queue", "demo", workers=1)
    assert read_line(process, 30).startswith("tokenq up: 1 worker ready")
    client = redis.Redis.from_url(url, socket_timeout=2)
    q = QueueRef("demo")
    (name,) = [n.decode() for n in client.hkeys(keys.workers(q))]
    worker = beat_pid(client, q, name)
    assert worker is not None
    os.kill(worker, signal.SIGKILL)
    # A new worker process (a new consumer name: it is a new process) heartbeats.
    wait_for(lambda: any(pid not in (None, worker) and alive(pid)
                         for pid in (beat_pid(client, q, n.decode())
                                     for n in client.hkeys(keys.workers(q)))),
             timeout=30, what="a restarted worker's heartbeat")
    (server,) = [pid for pid in children_of(process.pid) if "redis-server" in Path(
        f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
    os.kill(server, signal.SIGKILL)

    def answers() -> bool:
        with contextlib.suppress(redis.RedisError):
            return bool(client.ping())
        return False

    wait_for(answers, timeout=30, what="the restarted redis-server")
    with Client(redis_url=url, queue="demo") as producer:
        assert producer.infer("after both restarts", timeout_s=30).embedding
    client.close()
    process.send_signal(signal.SIGTERM)
    assert exit_status(process, log, 30) == 0
    text = log.read_text()
    assert "exited with signal SIGKILL" in text and "restarting in 1.0s" in text
    assert "restarted worker 0" in text and "restarted redis-server" in text


def test_up_exits_2_when_its_workers_exit_2(tmp_path: Path, spawn: Spawn):
    log, port = tmp_path / "up.log", free_ports(1)
    with ports_taken(port, 1):
        process, url = start_up(spawn, log, "--metrics-port", str(port), workers=1)
        assert exit_status(process, log, 60) == 2
    text = log.read_text()
    assert "exit code 2" in text and "restarted" not in text
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()


# ---------------------------------------------------- tokenq worker --devices


def test_worker_devices_runs_one_child_per_gpu(redis_url, queue_name, r, spawn, tmp_path):
    port = free_ports(2)  # child i serves metrics on port + i
    log = tmp_path / "parent.log"
    parent = start_devices(spawn, log, redis_url, queue_name,
                           "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    q = QueueRef(queue_name)
    for name in ("box-gpu0", "box-gpu1"):
        wait_for(lambda name=name: r.exists(keys.worker_alive(q, name)), timeout=30,
                 what=f"{name}'s heartbeat")
    for index, name in enumerate(("box-gpu0", "box-gpu1")):
        beat = msgpack.unpackb(r.hget(keys.workers(q), name), raw=False)
        environ = Path(f"/proc/{beat['pid']}/environ").read_bytes().split(b"\0")
        assert f"CUDA_VISIBLE_DEVICES={index}".encode() in environ
        cmdline = Path(f"/proc/{beat['pid']}/cmdline").read_bytes().split(b"\0")
        # the sim has no device to pick (and refuses --device); an hf child gets cuda:0
        assert b"cuda:0" not in cmdline and b"--devices" not in cmdline
        text = urllib.request.urlopen(f"http://127.0.0.1:{port + index}/metrics").read()
        assert f'consumer="{name}"'.encode() in text
    parent.send_signal(signal.SIGTERM)
    assert exit_status(parent, log, 30) == 0
    time.sleep(0.1)
    assert not r.hkeys(keys.workers(q)), "children deregistered on the way out"


def test_worker_devices_children_die_with_the_parent_on_kill_9(
    redis_url, queue_name, r, spawn, tmp_path,
):
    parent = start_devices(spawn, tmp_path / "parent.log", redis_url, queue_name)
    q = QueueRef(queue_name)
    for name in ("box-gpu0", "box-gpu1"):
        wait_for(lambda name=name: beat_pid(r, q, name), timeout=30, what=f"{name}'s heartbeat")
    children = children_of(parent.pid)
    assert sorted(children) == sorted(beat_pid(r, q, n) for n in ("box-gpu0", "box-gpu1"))
    parent.kill()
    parent.wait(timeout=10)
    assert not wait_gone(children, 10), "the children outlived their parent"
    # They got SIGTERM: each finished and deregistered.
    assert not r.hkeys(keys.workers(q))


def test_worker_devices_restarts_a_child_that_dies(redis_url, queue_name, r, spawn, tmp_path):
    log = tmp_path / "parent.log"
    parent = start_devices(spawn, log, redis_url, queue_name)
    q = QueueRef(queue_name)
    for name in ("box-gpu0", "box-gpu1"):
        wait_for(lambda name=name: beat_pid(r, q, name), timeout=30, what=f"{name}'s heartbeat")
    first, other = beat_pid(r, q, "box-gpu1"), beat_pid(r, q, "box-gpu0")
    assert first is not None
    os.kill(first, signal.SIGKILL)  # a non-zero exit, as a crash would be
    wait_for(lambda: beat_pid(r, q, "box-gpu1") not in (None, first), timeout=30,
             what="the restarted child's heartbeat")
    second = beat_pid(r, q, "box-gpu1")
    assert second in children_of(parent.pid) and not alive(first)
    assert beat_pid(r, q, "box-gpu0") == other, "the other child was left alone"
    parent.send_signal(signal.SIGTERM)
    assert exit_status(parent, log, 30) == 0
    text = log.read_text()
    assert f"box-gpu1 (pid {first}) exited with signal SIGKILL" in text
    assert f"restarted box-gpu1 (pid {second}; restart 1)" in text


def test_processes_per_device_share_one_gpu_and_lose_nothing_when_one_is_killed(
    redis_url, queue_name, r, spawn, tmp_path,
):
    """``--processes-per-device 2``: two consumers on GPU 0 under stable names, each
    planning on half the memory; the one SIGKILLed while it holds entries comes back
    under its own name, and every request is answered with its own vector."""
    log = tmp_path / "parent.log"
    parent = start_devices(spawn, log, redis_url, queue_name, "--processes-per-device", "2",
                           "--sim-batch-ms", "100", "--max-batch-size", "16", devices="0")
    q = QueueRef(queue_name)
    names = ("box-gpu0-1", "box-gpu0-2")
    for name in names:
        wait_for(lambda name=name: beat_pid(r, q, name), timeout=30, what=f"{name}'s heartbeat")
    for name in names:
        pid = beat_pid(r, q, name)
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=0" in environ
        assert any(item.startswith(b"OMP_NUM_THREADS=") for item in environ), \
            "co-located children divide the cores instead of each taking all of them"
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"--device-share") + 1] == b"0.5"
        assert b"--processes-per-device" not in cmdline
    texts = [f"request number {i} for two processes" for i in range(300)]
    stream = keys.requests(q)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        ids = client.submit_many(texts)
        victim = beat_pid(r, q, names[0])
        wait_for(lambda: r.xpending_range(stream, keys.GROUP, "-", "+", 1,
                                          consumername=names[0]),
                 timeout=30, what=f"{names[0]} holding entries")
        os.kill(victim, signal.SIGKILL)
        results = client.results(ids, timeout_s=90)
    for text, result in zip(texts, results, strict=True):
        np.testing.assert_allclose(list(result.embedding), expected_vector(text, DIM, MAX_INPUT),
                                   atol=1e-6)
    def consumers() -> set[str]:
        return {n.decode() if isinstance(n, bytes) else n
                for n in (info["name"] for info in r.xinfo_consumers(stream, keys.GROUP))}

    # The restarted child rejoins on its own clock: under load, after the other answered all.
    wait_for(lambda: beat_pid(r, q, names[0]) not in (None, victim)
             and set(names) <= consumers(), timeout=60, what=f"{names[0]} back under its own name")
    assert r.xpending(stream, keys.GROUP)["pending"] == 0
    parent.send_signal(signal.SIGTERM)
    assert exit_status(parent, log, 30) == 0
    assert f"{names[0]} (pid {victim}) exited with signal SIGKILL" in log.read_text()


def test_worker_devices_exit_2_is_final_and_the_parent_exits_2(
    redis_url, queue_name, spawn, tmp_path,
):
    log, port = tmp_path / "parent.log", free_ports(2)
    with ports_taken(port, 2):  # neither child can serve its metrics: a configuration error
        parent = start_devices(spawn, log, redis_url, queue_name, "--metrics-port", str(port))
        assert exit_status(parent, log, 60) == 2
    text = log.read_text()
    assert text.count("exit code 2") == 2 and "restarted" not in text


def test_worker_devices_exit_0_is_final(redis_url, queue_name, spawn, tmp_path):
    log = tmp_path / "parent.log"
    parent = start_devices(spawn, log, redis_url, queue_name, "--exit-when-idle-s", "0.5")
    assert exit_status(parent, log, 60) == 0
    text = log.read_text()
    assert text.count("exited with exit code 0") == 2 and "restarted" not in text


@pytest.mark.unit
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
    sim = WorkerSettings(devices="0", consumer="n", backend="sim")
    (_, sim_argv, _), = device_commands(sim, ["--devices", "0", "--backend", "sim"], env)
    assert "--device" not in sim_argv  # the sim refuses an option of --backend hf
    with pytest.raises(ValueError):
        WorkerSettings(devices=",")


@pytest.mark.unit
def test_processes_per_device_names_each_child_and_shares_the_device():
    settings = WorkerSettings(devices="0,3", processes_per_device=2, consumer="n",
                              metrics_port=9100, device_share=0.9)
    argv = ["--devices", "0,3", "--processes-per-device", "2", "--consumer", "n",
            "--metrics-port", "9100", "--device-share", "0.9", "--backend", "hf"]
    commands = device_commands(settings, argv, {"TOKENQ_PROCESSES_PER_DEVICE": "2"})
    assert [name for name, _, _ in commands] == ["n-gpu0-1", "n-gpu0-2", "n-gpu3-1", "n-gpu3-2"]
    for index, (name, child_argv, child_env) in enumerate(commands):
        assert child_env["CUDA_VISIBLE_DEVICES"] == name.split("-gpu")[1].split("-")[0]
        assert "TOKENQ_PROCESSES_PER_DEVICE" not in child_env
        assert int(child_env["OMP_NUM_THREADS"]) == max(1, (os.cpu_count() or 1) // 4)
        # The parent's own share is of the whole GPU: its two children split it.
        assert child_argv.count("--device-share") == 1
        assert float(child_argv[child_argv.index("--device-share") + 1]) == pytest.approx(0.45)
        assert child_argv[-2:] == ["--metrics-port", str(9100 + index)]
        assert "--processes-per-device" not in child_argv
    # The operator's own thread count wins; one child per GPU keeps its plain name.
    one = WorkerSettings(devices="1", consumer="n")
    (name, one_argv, one_env), = device_commands(one, ["--devices", "1"],
                                                 {"OMP_NUM_THREADS": "3"})
    assert name == "n-gpu1" and one_env["OMP_NUM_THREADS"] == "3"
    assert "--device-share" not in one_argv
    # One child per GPU keeps the operator's share rather than the whole device.
    halved = WorkerSettings(devices="0,1", consumer="n", device_share=0.5)
    for _, child_argv, _ in device_commands(halved, ["--devices", "0,1", "--device-share=0.5"],
                                            {}):
        assert child_argv.count("--device-share") == 1
        assert child_argv[child_argv.index("--device-share") + 1] == "0.5"


@pytest.mark.unit
@pytest.mark.parametrize(("given", "refusal"), [
    ({"devices": "0,1,0"}, "devices lists 0 more than once"),
    ({"devices": "GPU-a, GPU-a"}, "devices lists GPU-a more than once"),
    ({"processes_per_device": 2}, "processes_per_device 2 needs --devices"),
    ({"processes_per_device": "auto"}, "processes_per_device auto needs --devices"),
    ({"devices": "0", "processes_per_device": "two"}, "Input should be 'auto'"),
    ({"devices": "0", "processes_per_device": 9}, "less than or equal to 8"),
    ({"devices": "0", "processes_per_device": 0}, "greater than or equal to 1"),
    ({"device_share": 0}, "greater than 0"),
    ({"device_share": 1.5}, "less than or equal to 1"),
    ({"device_share": "nan"}, "less than or equal to 1"),
    ({"devices": ",".join(map(str, range(65)))}, "devices lists 65 GPUs; at most 64"),
])
def test_devices_a_gpu_twice_or_processes_without_devices_are_refused_by_name(given, refusal):
    """Two children under one consumer name would take each other's entries on a restart."""
    with pytest.raises(ValueError, match=refusal):
        WorkerSettings(**given)


GIB = 1 << 30


@pytest.mark.unit
@pytest.mark.parametrize(("weights", "device", "share", "count"), [
    (90 << 20, 80 * GIB, 1.0, 2),  # MiniLM on an H100
    (2 * GIB, 8 * GIB, 1.0, 2),  # the largest small model, two copies just fit
    (14 * GIB, 140 * GIB, 1.0, 1),  # a 7B model keeps the GPU busy alone
    (1 * GIB, 8 * GIB, 0.5, 1),  # small, but two copies do not fit in its share
    (90 << 20, None, 1.0, 1),  # no CUDA
    (None, 80 * GIB, 1.0, 1),  # weights not found
])
def test_processes_per_device_auto_rule(weights, device, share, count):
    assert auto_processes(weights, device, share)[0] == count


def _fake_model(folder: Path, weights: int) -> str:
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with open(folder / "model.safetensors", "wb") as file:
        file.truncate(weights)  # sparse: no disk used
    return str(folder)


@pytest.mark.unit
def test_processes_per_device_auto_reads_the_model_folder_and_the_device(
        monkeypatch, tmp_path, caplog):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: type("Props", (), {"total_memory": (80 + index) * GIB}))
    tiny, big = _fake_model(tmp_path / "tiny", 1 << 20), _fake_model(tmp_path / "big", 3 * GIB)
    assert supervise.processes_per_device(WorkerSettings(devices="0", model=big,
                                                         processes_per_device="auto")) == 1
    assert supervise.processes_per_device(WorkerSettings(devices="0", backend="sim",
                                                         processes_per_device="auto")) == 1
    assert supervise.processes_per_device(WorkerSettings(devices="0", processes_per_device=3)) == 3
    settings = WorkerSettings(devices="0,3", processes_per_device="auto", model=tiny,
                              consumer="n", device_share=0.9)
    caplog.set_level("INFO", logger="tokenq.worker")
    commands = device_commands(settings, ["--processes-per-device", "auto"], {})
    assert "--processes-per-device auto: 2 per device (0.00 GiB of weights, 72.0 GiB" in caplog.text
    assert [name for name, _, _ in commands] == ["n-gpu0-1", "n-gpu0-2", "n-gpu3-1", "n-gpu3-2"]
    for _, child_argv, _ in commands:
        assert float(child_argv[child_argv.index("--device-share") + 1]) == pytest.approx(0.45)
        assert "auto" not in child_argv
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert len(device_commands(settings, [], {})) == 2
    assert "auto: 1 per device (no CUDA device)" in caplog.text
    # Without --model: the hf backend's bundled model, a small one.
    assert supervise._weights_bytes(None) == pytest.approx(90 << 20, rel=0.1)


def test_the_cli_refuses_a_repeated_device_with_exit_2(redis_url, queue_name):
    done = subprocess.run(
        [sys.executable, "-m", "tokenq.worker", "--redis-url", redis_url, "--queue", queue_name,
         "--backend", "sim", "--devices", "0,0"],
        env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "devices lists 0 more than once" in done.stderr
    assert "--processes-per-device" in done.stderr


@pytest.mark.unit
def test_up_passes_its_settings_on_as_the_worker_flags_they_are(monkeypatch):
    for name in [n for n in os.environ if n.upper().startswith("TOKENQ_")]:
        monkeypatch.delenv(name)
    settings = UpSettings(queue="q1", prefix="p", backend="sim", metrics_port=9100)
    argv = worker_command(settings, "redis://127.0.0.1:1/0", 2, ["--sim-dim", "5"])
    assert argv[1:3] == ["-m", "tokenq.worker"]
    worker = parse_settings(WorkerSettings, argv[3:], "tokenq worker")
    assert (worker.redis_url, worker.queue, worker.prefix, worker.backend, worker.metrics_port,
            worker.sim_dim) == ("redis://127.0.0.1:1/0", "q1", "p", "sim", 9102, 5)


@pytest.mark.unit
def test_up_refuses_bad_settings_before_starting_anything(capsys):
    assert up_main(["--workers", "-1", "--queue", "bad q"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "tokenq up: invalid settings:"
    assert sorted(line.split(":")[0].strip() for line in err[1:]) == [
        "--queue / TOKENQ_QUEUE", "--workers / TOKENQ_WORKERS"]
