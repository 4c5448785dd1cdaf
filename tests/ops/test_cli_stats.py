"""``tokenq stats`` and ``tokenq top`` against a real Redis and live sim workers."""

from __future__ import annotations

import json
import time

import msgpack
import pytest
import redis

from tests.cli_support import tokenq
from tests.support import wait_for
from tokenq.producer import Client
from tokenq.producer.ops.snapshot import (
    SNAPSHOT_VERSION,
    counter_delta,
    discover_queues,
    heartbeat_counters,
)
from tokenq.producer.ops.stats import main as stats_main
from tokenq.producer.ops.top import main as top_main
from tokenq.shared import keys
from tokenq.shared.cli import main as dispatch
from tokenq.shared.keys import QueueRef
from tokenq.shared.keys import queue_of as parse_queue_key

pytest_plugins = ("tests.cli_fixtures",)

QUEUE_FIELDS = {
    "queue", "shard", "label", "stream", "length", "pending_tokens", "pending",
    "oldest_pending_ms", "lag",
    "lag_exact", "dead", "cache_bytes", "group", "consumers", "workers", "stale_workers",
    "totals", "config", "tenants",
}
WORKER_FIELDS = {
    "consumer", "host", "pid", "model", "max_batch_tokens", "configured_batch_tokens",
    "max_batch_size", "buffered", "requests_ok", "requests_failed", "batches", "tokens",
    "padded_tokens", "device_ms", "oom_splits", "padding_efficiency", "uptime_s",
    "requests_per_s", "tokens_per_s", "heartbeat_age_s", "at", "cache_hits", "cache_misses",
    "coalesced", "tenants",
}


def stats_json(capsys: pytest.CaptureFixture[str], redis_url: str, *args: str) -> dict:
    assert stats_main(["--redis-url", redis_url, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_stats_json_reports_backlog_workers_and_dead_letters(
    sim_worker, redis_url, queue_name, r, capsys
):
    q = QueueRef(queue_name)
    sim_worker("--max-batch-tokens", "8192", name="live")
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.infer_many([f"text number {i}" for i in range(40)], timeout_s=20)
        # A backlog nobody reads yet: written past the consumer group's last id.
        r.xadd(keys.dead(q), {"v": "1", "id": "gone", "text": "x", "dead_error_code": "x"})
        # A heartbeat entry whose worker died (no liveness key).
        r.hset(keys.workers(q), "ghost", msgpack.packb({"requests_ok": 5, "at": time.time()}))
    wait_for(lambda: stats_json(capsys, redis_url, "--queue", queue_name)["queues"][0]
             ["totals"]["requests_ok"] >= 40, what="a heartbeat counting the 40 requests")

    doc = stats_json(capsys, redis_url, "--queue", queue_name)
    assert doc["version"] == SNAPSHOT_VERSION
    assert set(doc) == {"version", "at", "redis_url", "queues"}
    [queue] = doc["queues"]
    assert set(queue) == QUEUE_FIELDS
    assert queue["queue"] == queue_name and queue["stream"] == keys.requests(q)
    assert queue["length"] == 0 and queue["pending"] == 0 and queue["lag"] == 0
    assert queue["dead"] == 1 and queue["group"] is True
    assert queue["stale_workers"] == ["ghost"]
    assert queue["config"]["model"] == "sim"
    assert [c["name"] for c in queue["consumers"]] == ["live"]
    assert queue["consumers"][0]["idle_ms"] >= 0
    [worker] = queue["workers"]
    assert set(worker) == WORKER_FIELDS
    assert worker["consumer"] == "live"
    assert worker["max_batch_tokens"] == worker["configured_batch_tokens"] == 8192
    assert worker["requests_ok"] == 40 and worker["requests_failed"] == 0
    assert worker["batches"] >= 1
    assert 0 < worker["padding_efficiency"] <= 1.0
    assert worker["tokens"] <= worker["padded_tokens"]
    assert worker["requests_per_s"] > 0 and worker["tokens_per_s"] > 0
    assert worker["heartbeat_age_s"] < 5
    assert queue["totals"]["workers"] == 1 and queue["totals"]["requests_ok"] == 40


def test_stats_shows_backlog_pending_and_lag(sim_worker, redis_url, queue_name, r, capsys):
    q = QueueRef(queue_name)
    worker = sim_worker(name="w")
    worker.terminate()
    # The group exists now; a worker that reads but never answers leaves entries pending.
    for i in range(5):
        r.xadd(keys.requests(q), {"v": "1", "id": f"r{i}", "text": "hello"})
    r.xreadgroup(keys.GROUP, "stuck", {keys.requests(q): ">"}, count=2)
    [queue] = stats_json(capsys, redis_url, "--queue", queue_name)["queues"]
    assert queue["length"] == 5 and queue["pending"] == 2 and queue["lag"] == 3
    assert queue["oldest_pending_ms"] is not None and queue["oldest_pending_ms"] >= 0
    assert {c["name"]: c["pending"] for c in queue["consumers"]} == {"stuck": 2}
    assert queue["workers"] == []


def test_stats_discovers_queues_and_shards_by_scan(redis_url, r, queue_name, capsys):
    for q in (QueueRef(queue_name), QueueRef(queue_name, shard=3)):
        r.xadd(keys.requests(q), {"v": "1", "id": "a", "text": "b"})
    labels = [q["label"] for q in stats_json(capsys, redis_url)["queues"]]
    assert queue_name in labels and f"{queue_name}:3" in labels
    assert QueueRef(queue_name, shard=3) in discover_queues(r, "tokenq")
    assert parse_queue_key("tokenq:{a:x}:requests", "tokenq") is None
    assert parse_queue_key("other:{a}:requests", "tokenq") is None


def test_stats_text_top_once_and_the_dispatcher(sim_worker, redis_url, queue_name, capsys):
    sim_worker(name="shown")
    assert stats_main(["--redis-url", redis_url, "--queue", queue_name]) == 0
    text = capsys.readouterr().out
    assert f"queue {queue_name}:" in text and "shown" in text and "padding" in text
    assert top_main(["--redis-url", redis_url, "--queue", queue_name, "--once"]) == 0
    frame = capsys.readouterr().out
    assert "tokenq top" in frame and "shown" in frame and "budget" in frame
    assert dispatch(["--help"]) == 0
    listing = capsys.readouterr().out
    for name in ("worker", "up", "embed", "stats", "top", "dlq"):
        assert f"  {name} " in listing


def test_every_subcommand_has_help_and_stats_stays_light():
    for name in ("stats", "top", "dlq", "embed", "up", "worker"):
        done = tokenq(name, "--help")
        assert done.returncode == 0, done.stderr
        assert "--redis-url" in done.stdout
    # stats must not pay for the worker side (torch, numpy, the model code).
    probe = tokenq("stats", "--redis-url", "redis://127.0.0.1:1/0", "--socket-timeout-s", "0.2")
    assert probe.returncode == 1 and "cannot reach Redis" in probe.stderr
    import subprocess
    import sys

    code = (
        "import sys; from tokenq.shared.cli import main\n"
        "import tokenq.producer.ops.stats, tokenq.producer.ops.top, tokenq.producer.ops.dlq\n"
        "import tokenq.producer.ops.embed\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers', 'tokenq.worker')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bad_flags_exit_2_with_the_flag_named(redis_url):
    done = tokenq("stats", "--redis-url", "http://nope")
    assert done.returncode == 2
    assert "--redis-url" in done.stderr and "TOKENQ_REDIS_URL" in done.stderr


def test_heartbeat_deltas_count_only_what_changed(r: redis.Redis, queue_name: str):
    q = QueueRef(queue_name)
    r.hset(keys.workers(q), "a", msgpack.packb({"batches": 2, "tokens": 10, "padded_tokens": 20}))
    before = heartbeat_counters(r, q)
    r.hset(keys.workers(q), "a", msgpack.packb({"batches": 5, "tokens": 40, "padded_tokens": 50}))
    r.hset(keys.workers(q), "b", msgpack.packb({"batches": 1, "tokens": 10, "padded_tokens": 10}))
    delta = counter_delta(before, heartbeat_counters(r, q))
    assert delta["batches"] == 4 and delta["tokens"] == 40 and delta["padded_tokens"] == 40
    assert delta["padding_efficiency"] == 1.0


def _beat(r: redis.Redis, q: QueueRef, name: str, *, alive: bool, at: float, **counters) -> None:
    r.hset(keys.workers(q), name, msgpack.packb({"at": at, "started_at": at - 10, **counters}))
    if alive:
        r.set(keys.worker_alive(q, name), "1", ex=30)


def _redis_time(r: redis.Redis) -> float:
    seconds, micros = r.time()
    return seconds + micros / 1e6


@pytest.mark.parametrize("skew_s", [-3600.0, 3600.0])
def test_ages_use_redis_clock_when_the_operator_clock_is_off(
    skew_s, redis_url, queue_name, r, capsys, monkeypatch
):
    q = QueueRef(queue_name)
    r.xgroup_create(keys.requests(q), keys.GROUP, id="$", mkstream=True)
    r.xadd(keys.requests(q), {"v": "1", "id": "a", "text": "hello"})
    r.xreadgroup(keys.GROUP, "busy", {keys.requests(q): ">"}, count=1)
    # A worker whose clock agrees with Redis's, which is what the age is measured on.
    _beat(r, q, "busy", alive=True, at=_redis_time(r), requests_ok=3)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew_s)
    doc = stats_json(capsys, redis_url, "--queue", queue_name)
    [queue] = doc["queues"]
    assert 0 <= queue["oldest_pending_ms"] < 5000
    [worker] = queue["workers"]
    assert worker["heartbeat_age_s"] < 5
    assert abs(doc["at"] - _redis_time(r)) < 5
    assert top_main(["--redis-url", redis_url, "--queue", queue_name, "--once"]) == 0
    assert "oldest" in capsys.readouterr().out


def test_heartbeat_rows_without_a_liveness_key_are_gone_not_workers(
    redis_url, queue_name, r, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "400")  # one header line, whatever width the run inherits
    q = QueueRef(queue_name)
    now = _redis_time(r)
    r.xadd(keys.requests(q), {"v": "1", "id": "a", "text": "hello"})
    _beat(r, q, "live", alive=True, at=now, requests_ok=10, tokens=100, padded_tokens=100)
    _beat(r, q, "ghost", alive=False, at=now - 60, requests_ok=500, tokens=9, padded_tokens=90)
    # Rows no worker could have written: not msgpack, and numbers that are not numbers.
    r.hset(keys.workers(q), "junk", b"\xc1\xc1")
    r.hset(keys.workers(q), "odd", msgpack.packb({"at": "yesterday", "requests_ok": [1]}))
    for name in ("junk", "odd"):
        r.set(keys.worker_alive(q, name), "1", ex=30)
    assert set(heartbeat_counters(r, q)) == {"live", "ghost"}
    [queue] = stats_json(capsys, redis_url, "--queue", queue_name)["queues"]
    assert [w["consumer"] for w in queue["workers"]] == ["live"]
    assert queue["stale_workers"] == ["ghost", "junk", "odd"]
    assert queue["totals"]["workers"] == 1 and queue["totals"]["requests_ok"] == 10
    assert queue["totals"]["padding_efficiency"] == 1.0

    assert stats_main(["--redis-url", redis_url, "--queue", queue_name]) == 0
    text = capsys.readouterr().out
    assert "workers 1 (3 gone)" in text
    [table_row] = [line for line in text.splitlines() if line.strip().startswith("live")]
    assert "ghost" not in table_row
    assert ("gone (heartbeat row without a liveness key, or unreadable; not counted): "
            "ghost, junk, odd") in text
    assert top_main(["--redis-url", redis_url, "--queue", queue_name, "--once"]) == 0
    frame = capsys.readouterr().out
    assert "workers 1 (3 gone)" in frame and "ghost" in frame


def test_a_queue_redis_will_not_read_is_named_and_hides_no_other(redis_url, r, queue_name,
                                                                 capsys):
    """A stray key under tokenq's prefix (another program's) makes one queue unreadable:
    stats and top show every other queue, name that one's key on stderr, and exit 1."""
    prefix = f"p{queue_name}"  # discovery sees only this test's queues
    good, bad = QueueRef(queue_name, prefix), QueueRef(queue_name + "b", prefix)
    for q in (good, bad):
        r.xadd(keys.requests(q), {"v": "1", "id": "a", "text": "b"})
    r.set(keys.config(bad), "not a hash")
    base = ["--redis-url", redis_url, "--prefix", prefix]
    named = f"queue {bad.name}: "
    try:
        assert stats_main([*base, "--json"]) == 1
        out, err = capsys.readouterr()
        doc = json.loads(out)
        assert [q["label"] for q in doc["queues"]] == [good.name]
        (unreadable,) = doc["unreadable"]
        assert unreadable["label"] == bad.name and keys.config(bad) in unreadable["error"]
        assert err.startswith(f"tokenq stats: {named}") and keys.config(bad) in err

        assert stats_main(base) == 1
        out, err = capsys.readouterr()
        assert f"queue {good.name}:" in out and bad.name not in out
        assert keys.config(bad) in err

        assert top_main([*base, "--once"]) == 1  # not a terminal: one frame
        out, err = capsys.readouterr()
        assert f"queue {good.name}" in out
        assert err.startswith(f"tokenq top: {named}") and keys.config(bad) in err

        assert top_main([*base, "--json", "--once"]) == 1
        out, err = capsys.readouterr()
        line = json.loads(out)
        assert [q["label"] for q in line["unreadable"]] == [bad.name]
        assert [q["label"] for q in line["queues"]] == [good.name]
        assert keys.config(bad) in err
    finally:
        r.delete(keys.config(bad), keys.requests(good), keys.requests(bad))


# ----------------------------------------------------------------- a queue that is not there


@pytest.mark.parametrize("command", ["stats", "top", "dlq list", "dlq purge"])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_queue_with_no_keys_is_named_not_shown_empty(redis_url, r, queue_name, command,
                                                       as_json):
    """``--queue embd`` (a typo) showed an empty queue (no dead letters) and exited 0."""
    r.xadd(keys.requests(QueueRef(queue_name)), {"v": "1"})  # a real queue beside it
    typo = queue_name + "-typo"
    flags = ["--json"] if as_json else []
    if command == "top":
        flags.append("--once")
    if command == "dlq purge":
        flags = ["--all"]
    done = tokenq(*command.split(), "--redis-url", redis_url, "--queue", typo, *flags)
    assert done.returncode == 1, done.stdout
    assert done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    prog = command.split()[0]
    assert line.startswith(f"tokenq {prog}: queue '{typo}'") and "no keys" in line
    assert queue_name in line  # the queues that do exist, to spot the typo


@pytest.mark.parametrize("key", ["requests", "config", "workers", "dead"])
def test_a_queue_with_any_of_its_keys_is_shown_even_empty(redis_url, r, queue_name, capsys,
                                                          key):
    """An existing queue with nothing in it (a worker's consumer group on an empty stream,
    only dead letters, only a config hash) is still shown, exit 0."""
    q = QueueRef(queue_name)
    if key == "requests":
        r.xgroup_create(keys.requests(q), "workers", id="0", mkstream=True)
    elif key == "dead":
        r.xadd(keys.dead(q), {"v": "1", "id": "gone", "text": "x", "dead_error_code": "x"})
    else:
        r.hset(getattr(keys, key)(q), "x", "1")
    doc = stats_json(capsys, redis_url, "--queue", queue_name)
    [row] = doc["queues"]
    assert row["queue"] == queue_name and row["length"] == 0


def test_a_sharded_queue_counts_as_there_by_any_lane(redis_url, r, queue_name, capsys):
    q = QueueRef(queue_name)
    r.hset(keys.config(q), "shards", "2")
    r.xadd(keys.requests(keys.shards_of(q, 2)[1]), {"v": "1"})
    doc = stats_json(capsys, redis_url, "--queue", queue_name)
    assert {row["queue"] for row in doc["queues"]} == {queue_name}


def test_no_batches_yet_reads_as_a_dash_and_waiting_requests_without_a_worker_are_flagged(
    sim_worker, redis_url, queue_name, r, capsys
):
    """A worker that has run no batch has no padding ratio (``-``, null), not 100%; once it
    is gone, the requests left waiting are flagged in ``stats`` and ``top``."""
    q = QueueRef(queue_name)
    worker = sim_worker(name="idle")
    [queue] = stats_json(capsys, redis_url, "--queue", queue_name)["queues"]
    [idle] = queue["workers"]
    assert idle["batches"] == 0
    assert idle["padding_efficiency"] is None and queue["totals"]["padding_efficiency"] is None
    assert stats_main(["--redis-url", redis_url, "--queue", queue_name]) == 0
    text = capsys.readouterr().out
    assert "padding -" in text and "%" not in text and "no live worker" not in text
    [row] = [line for line in text.splitlines() if line.strip().startswith("idle")]
    assert " - " in row
    assert top_main(["--redis-url", redis_url, "--queue", queue_name, "--once"]) == 0
    assert "%" not in capsys.readouterr().out

    worker.terminate()
    for i in range(3):
        r.xadd(keys.requests(q), {"v": "1", "id": f"r{i}", "text": "hello"})
    assert stats_main(["--redis-url", redis_url, "--queue", queue_name]) == 0
    assert "no live worker: 3 waiting" in capsys.readouterr().out
    assert top_main(["--redis-url", redis_url, "--queue", queue_name, "--once"]) == 0
    assert "no live worker: 3 waiting" in capsys.readouterr().out
