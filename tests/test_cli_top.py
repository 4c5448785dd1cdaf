"""``tokenq top`` for the three kinds of reader: a terminal, a pipe, and a program (--json)."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys

import pytest

from tests.cli_support import tokenq
from tokenq.producer import Client
from tokenq.producer.ops.top import main as top_main

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
    assert process.wait(timeout=20) == 0


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


def test_json_needs_no_terminal_and_reports_redis_failures_in_one_line():
    done = tokenq("top", "--json", "--once", "--redis-url", "redis://127.0.0.1:1/0",
                  "--socket-timeout-s", "0.2")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().startswith("tokenq top: cannot reach Redis")
