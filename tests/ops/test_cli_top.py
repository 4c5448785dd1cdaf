"""``tokenq top`` for the three kinds of reader: a terminal, a pipe, and a program (--json)."""

from __future__ import annotations

import json
import re
import select
import signal
import subprocess
import sys

import pytest

from tests.cli_support import tokenq
from tokenq.producer import Client
from tokenq.producer.ops.snapshot import connect, read_snapshot
from tokenq.producer.ops.top import UNSERVED_STYLE, render
from tokenq.producer.ops.top import main as top_main
from tokenq.shared import keys

pytest_plugins = ("tests.cli_fixtures",)


def _argv(redis_url: str, queue: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "tokenq.shared.cli", "top", "--redis-url", redis_url,
            "--queue", queue, *flags]


def test_json_once_is_one_snapshot_with_recent_rates(sim_worker, redis_url, queue_name, capsys):
    sim_worker(name="busy")
    assert top_main(["--redis-url", redis_url, "--queue", queue_name, "--json", "--once"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    doc = json.loads(line)
    [queue] = doc["queues"]
    assert queue["queue"] == queue_name and set(doc) == {"version", "at", "redis_url", "queues"}
    [worker] = queue["workers"]
    assert worker["consumer"] == "busy"
    # One look: no two heartbeats to take a rate from yet.
    assert worker["recent_requests_per_s"] is None and worker["recent_tokens_per_s"] is None


def test_json_streams_a_line_per_refresh_until_ctrl_c(sim_worker, redis_url, queue_name, spawn):
    sim_worker(name="busy")
    process = spawn(_argv(redis_url, queue_name, "--json", "--interval-s", "0.2"),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rates = None
    with Client(redis_url=redis_url, queue=queue_name) as client:
        for _ in range(100):  # each line is a refresh: ~0.2 s apart, heartbeats every 0.5 s
            client.infer_many([f"text {i}" for i in range(20)], timeout_s=20)
            ready, _, _ = select.select([process.stdout], [], [], 20)
            assert ready, "no line within 20 s"
            [worker] = json.loads(process.stdout.readline())["queues"][0]["workers"]
            if worker["recent_requests_per_s"]:
                rates = worker["recent_requests_per_s"], worker["recent_tokens_per_s"]
                break
    assert rates is not None and rates[0] > 0 and rates[1] > 0
    process.send_signal(signal.SIGINT)
    # Drained while it stops: lines not read since fill the pipe, and a top blocked
    # writing to a full pipe would never see its Ctrl-C through.
    _, err = process.communicate(timeout=20)
    assert process.returncode == 0, err


def test_without_a_terminal_top_draws_one_frame_and_exits(sim_worker, redis_url, queue_name,
                                                          spawn):
    sim_worker(name="shown")
    process = spawn(_argv(redis_url, queue_name), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("tokenq top with its stdout on a pipe never exited")
    assert process.returncode == 0, err
    assert f"queue {queue_name}" in out and "shown" in out and "budget" in out


def test_a_queue_with_requests_and_no_live_worker_is_marked_in_its_own_style(
    sim_worker, redis_url, queue_name, r
):
    sim_worker(name="gone").terminate()
    r.xadd(keys.requests(keys.QueueRef(queue_name)), {"v": "1", "id": "a", "text": "hello"})
    client = connect(redis_url)
    try:
        frame = render(read_snapshot(client, "tokenq", queue_name, redis_url))
    finally:
        client.close()
    marked = [str(part) for part in frame.renderables
              if getattr(part, "style", None) == UNSERVED_STYLE]
    assert marked == ["no live worker: 1 waiting"]


def test_json_needs_no_terminal_and_reports_redis_failures_in_one_line():
    done = tokenq("top", "--json", "--once", "--redis-url", "redis://127.0.0.1:1/0",
                  "--socket-timeout-s", "0.2")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().startswith("tokenq top: cannot reach Redis")


# ----------------------------------------------------------------- the frame's width

LONG_NAME = "worker-" + "x" * 170  # with the other 12 columns, wider than any fixed width


def _frame(argv: list[str], spawn, *, columns: int | None, terminal: bool) -> str:
    """One frame of ``tokenq top --once``, its stdout a terminal (a pty) or a pipe."""
    import os
    import pty

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    if not terminal:
        process = spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        out, err = process.communicate(timeout=30)
        assert process.returncode == 0, err
        return out
    leader, follower = pty.openpty()
    process = spawn(argv, stdout=follower, stderr=subprocess.PIPE, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the follower side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert process.wait(timeout=30) == 0, process.stderr.read()
    text = b"".join(chunks).decode()
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "")  # colours, cursor


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_a_wide_columns_shows_every_column_uncropped(sim_worker, redis_url, queue_name, spawn,
                                                     terminal):
    sim_worker(name=LONG_NAME)
    out = _frame(_argv(redis_url, queue_name, "--once"), spawn, columns=400, terminal=terminal)
    assert LONG_NAME in out and "…" not in out
    header = next(line for line in out.splitlines() if line.lstrip("┃ ").startswith("worker"))
    assert all(column in header for column in ("worker", "budget", "padding", "oom", "age"))


def test_a_narrow_terminal_gets_a_frame_no_wider_than_it(sim_worker, redis_url, queue_name,
                                                         spawn):
    sim_worker(name=LONG_NAME)
    out = _frame(_argv(redis_url, queue_name, "--once"), spawn, columns=60, terminal=True)
    assert "worker" in out
    assert max(len(line) for line in out.splitlines()) <= 60


@pytest.mark.parametrize("terminal", [True, False], ids=["sizeless-terminal", "pipe"])
def test_without_a_known_width_the_frame_is_never_cropped(sim_worker, redis_url, queue_name,
                                                          spawn, terminal):
    """``tokenq top | less``, or a terminal that reports no size (a fresh pty, as
    ``docker exec -t`` may give): no width to fit, so the table keeps its own."""
    sim_worker(name=LONG_NAME)
    out = _frame(_argv(redis_url, queue_name, "--once"), spawn, columns=None, terminal=terminal)
    assert LONG_NAME in out and "…" not in out
