"""The worker's containment mechanisms, each proven by the failure it closes.

One test per class of failure from the hardening issue, each against real
worker processes and a real redis-server, each failing without its
mechanism: a numeric field no float can hold; a worker restarted under a
fixed name over an entry it keeps dying on; a ``reply_to`` aimed at tokenq's
own keys or another application's; a device that hangs; a worker whose
clock is an hour off; a read-ahead of huge texts that claim no tokens;
dead letters of huge entries; heartbeat rows of workers that are gone; a
worker told to stop while Redis does not answer.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis

from tests.faults.test_faults import HEARTBEAT_S, SIM, pending_of, record, vector_ok
from tests.redis_server import RedisServer
from tests.support import blpop_within, fleet_fixture, wait_for
from tests.workers import Fleet
from tokenq.producer import Client
from tokenq.shared import keys, wire
from tokenq.shared.errors import RemoteError
from tokenq.worker.backends.sim import SIM_HANG_MARKER
from tokenq.worker.settings import WorkerSettings

pytestmark = pytest.mark.fault

DEAD_LETTER_BYTES = WorkerSettings.model_fields["dead_max_letter_bytes"].default


fleet = fleet_fixture(*SIM)


def reply_of(r: redis.Redis, key: str, timeout: float = 30) -> wire.Reply:
    raw = blpop_within(r, key, timeout)
    assert raw is not None, f"no reply on {key} within {timeout}s"
    return wire.decode_reply(raw)


# ------------------------------------------------------ 1. numbers no float holds


def test_a_400_digit_number_is_a_bad_request_not_a_dead_fleet(fleet, r, queue_name):
    """A 400-digit numeric field is refused at decode time; all three workers live on.

    Each numeric field in turn, against the same three workers: each refusal leaves a
    fleet that serves the next request and meets the next field."""
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    workers = fleet.start_many(3, ready=r, queue=queue_name)
    refused: list[bytes] = []
    for field in ["tokens", "deadline_ms", "timeout_ms", "v"]:
        huge, after = f"huge-{field}", f"after-{field}"
        r.xadd(stream, {"v": "1", "id": huge, "text": "hello", field: "1" + "0" * 400})
        reply = reply_of(r, keys.reply(q, huge))
        assert reply.error is not None and reply.error.code == "bad_request"
        assert field in reply.error.message and "out of range" in reply.error.message
        r.xadd(stream, {"v": "1", "id": after, "text": "still served"})
        assert vector_ok(reply_of(r, keys.reply(q, after)).embedding, "still served")
        assert all(worker.process.poll() is None for worker in workers)
        refused.append(huge.encode())
        assert [f[b"id"] for _, f in r.xrange(keys.dead(q))] == refused
        record(f"400-digit {field}", requests=2, workers_alive=len(workers), dead_lettered=1,
               lost=0, duplicates=0)


def test_an_entry_that_breaks_the_tokenizer_output_is_dead_lettered_alone(
    fleet, r, queue_name, tmp_path
):
    """Whatever fails while a read is taken costs only the entry it fails on."""
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    worker = fleet.start(
        "--backend", "tests.plugins_for_tests:sim_zero_length", ready=r, queue=queue_name
    )
    with r.pipeline(transaction=False) as pipe:
        for i in range(20):
            text = "<<zero-length>>" if i == 7 else f"neighbour {i}"
            pipe.xadd(stream, {"v": "1", "id": f"n{i}", "text": text})
        pipe.execute()
    for i in range(20):
        reply = reply_of(r, keys.reply(q, f"n{i}"))
        if i == 7:
            assert reply.error is not None and reply.error.code == "bad_request"
            assert "could not take" in reply.error.message
        else:
            assert reply.ok, reply
    assert worker.process.poll() is None
    assert [f[b"id"] for _, f in r.xrange(keys.dead(q))] == [b"n7"]


# ----------------------------------------- 2. delivery counts after a fixed-name restart


def test_fixed_name_restarts_over_a_crashing_entry_end_in_a_dead_letter(
    fleet, r, redis_url, queue_name
):
    """A worker that keeps its name (--consumer, --devices, PID 1) re-reads its own history
    after each crash; those reads count, so the entry is dead-lettered after max_deliveries."""
    q = keys.QueueRef(queue_name)
    hang = ("--sim-hang-s", "3600", "--max-deliveries", "3")

    def delivered() -> int:
        try:
            pending = r.xpending_range(keys.requests(q), keys.GROUP, "-", "+", 1)
        except redis.ResponseError:  # no group until the first worker made it
            return 0
        return int(pending[0]["times_delivered"]) if pending else 0

    with Client(redis_url=redis_url, queue=queue_name) as client:
        doomed = client.submit(f"{SIM_HANG_MARKER} kills whoever runs it")
        for attempt in range(1, 4):
            worker = fleet.start(*hang, name="fixed")
            # It takes the entry (fresh, then from its history) and holds it on
            # the device for ever: crash it there.
            wait_for(lambda n=attempt: delivered() == n, 60, f"delivery {attempt}")
            time.sleep(0.2)
            worker.kill()
        worker = fleet.start(*hang, name="fixed")
        with pytest.raises(RemoteError) as caught:
            client.result(doomed, timeout_s=60)
    assert caught.value.code == "dead_letter"
    (_, letter), = r.xrange(keys.dead(q))
    assert letter[b"dead_deliveries"] == b"4" and letter[b"dead_worker"] == b"fixed"
    assert worker.process.poll() is None
    assert pending_of(r, q) == 0 and r.xlen(keys.requests(q)) == 0
    record("fixed-name restarts over a crashing entry", requests=1, kills=3, dead_lettered=1,
           lost=0, duplicates=0)


def test_an_entry_deleted_while_pending_is_released_on_restart_not_dead_lettered(
    fleet, r, queue_name
):
    """A history read gives an entry deleted while pending (XDEL, a trim) with no fields:
    the restarted worker acks it and answers nobody, with no dead letter, and serves
    its neighbours."""
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    ids = [r.xadd(stream, {"v": "1", "id": f"d{i}", "text": f"pending {i}"}) for i in range(3)]
    r.xreadgroup(keys.GROUP, "fixed", {stream: ">"})  # delivered to "fixed" before a crash
    r.xdel(stream, ids[1])
    assert pending_of(r, q, "fixed") == 3

    fleet.start(name="fixed", ready=r, queue=queue_name)
    for i in (0, 2):
        assert vector_ok(reply_of(r, keys.reply(q, f"d{i}")).embedding, f"pending {i}")
    wait_for(lambda: pending_of(r, q) == 0, 30, "the deleted entry acked")
    assert r.xlen(keys.dead(q)) == 0 and r.llen(keys.reply(q, "d1")) == 0
    assert r.xlen(stream) == 0
    record("entry deleted while pending, then a restart", requests=3, deleted=1,
           dead_lettered=0, lost=0, duplicates=0)


# ------------------------------------------------------------ 3. the reply namespace


def test_reply_to_cannot_aim_at_tokenq_keys_or_foreign_keys(fleet, r, queue_name):
    """reply_to = the dead key (before it exists) must not make it a list; foreign keys
    are never written; dead letters keep flowing; the caller hears on its own key."""
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    r.rpush("app:jobs", "theirs")
    fleet.start(ready=r, queue=queue_name)
    targets = {
        "at-dead": keys.dead(q),
        "at-workers": keys.workers(q),
        "at-seen": keys.seen(q, "someone"),
        "at-other-queue": keys.reply(keys.QueueRef("other"), "x"),
        "at-foreign": "app:jobs",
        "at-new-foreign": "app:new",
    }
    for request_id, target in targets.items():
        r.xadd(stream, {"v": "1", "id": request_id, "text": "aimed", "reply_to": target})
    # Dead letters still work after all of those: a bad version.
    r.xadd(stream, {"v": "9", "id": "bad-version", "text": "x"})
    r.xadd(stream, {"v": "1", "id": "fine", "text": "answered"})
    assert vector_ok(reply_of(r, keys.reply(q, "fine")).embedding, "answered")
    for request_id in [*targets, "bad-version"]:
        reply = reply_of(r, keys.reply(q, request_id))
        assert reply.error is not None and reply.error.code == "bad_request", reply
    wait_for(lambda: r.xlen(keys.dead(q)) == len(targets) + 1, 30, "every dead letter")
    assert r.type(keys.dead(q)) == b"stream"
    assert r.type(keys.workers(q)) == b"hash"
    assert r.lrange("app:jobs", 0, -1) == [b"theirs"] and r.pttl("app:jobs") == -1
    assert not r.exists("app:new", keys.seen(q, "someone"), keys.reply(keys.QueueRef("other"), "x"))
    letters = {f[b"id"]: f for _, f in r.xrange(keys.dead(q))}
    assert b"reply namespace" in letters[b"at-foreign"][b"dead_error"]
    assert b"tokenq's own keys" in letters[b"at-dead"][b"dead_error"]
    record("reply_to aimed at tokenq's and foreign keys", requests=len(targets) + 2,
           malformed=len(targets) + 1, dead_lettered=len(targets) + 1,
           error_replies=len(targets) + 1, lost=0, duplicates=0)


def test_an_operator_can_widen_the_reply_namespace(fleet, r, queue_name):
    q = keys.QueueRef(queue_name)
    fleet.start("--reply-to-prefixes", "app:replies:", ready=r, queue=queue_name)
    r.xadd(keys.requests(q), {"v": "1", "id": "w", "text": "widened",
                              "reply_to": "app:replies:w"})
    assert vector_ok(reply_of(r, "app:replies:w").embedding, "widened")
    r.xadd(keys.requests(q), {"v": "1", "id": "d", "text": "never the dead key",
                              "reply_to": keys.dead(q)})
    assert reply_of(r, keys.reply(q, "d")).error.code == "bad_request"


# ----------------------------------------------------------------- 4. a hung device


def test_a_hung_batch_is_taken_over_by_peers_without_anyone_killing_it(fleet, r, queue_name):
    """A batch past --batch-timeout-s: the worker stops keeping its claims and exits 3;
    its peer answers everything it held, within the timeout plus a few heartbeats."""
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    timeout_s = 3.0
    hung = fleet.start("--sim-hang-s", "3600", "--batch-timeout-s", str(timeout_s),
                       "--sim-batch-ms", "50", name="hung", ready=r, queue=queue_name)
    ids = [f"h{i}" for i in range(30)]
    with r.pipeline(transaction=False) as pipe:
        for i, request_id in enumerate(ids):
            text = f"{SIM_HANG_MARKER} first" if i == 0 else f"held {i}"
            pipe.xadd(stream, {"v": "1", "id": request_id, "text": text})
        pipe.execute()
    wait_for(lambda: pending_of(r, q, "hung") == len(ids), 30, "the hung worker to take all")
    taken = time.monotonic()
    fleet.start(name="peer", ready=r, queue=queue_name)
    for request_id in ids:
        assert reply_of(r, keys.reply(q, request_id), 60).ok
    answered_after = time.monotonic() - taken
    assert answered_after <= timeout_s + 8 * HEARTBEAT_S + 10, answered_after
    assert hung.process.wait(timeout=30) == 3
    assert "batch_timeout_s" in hung.output()
    assert pending_of(r, q) == 0 and r.xlen(stream) == 0
    record("hung device (watchdog)", requests=len(ids), timeout_s=timeout_s,
           slowest_error_s=round(answered_after, 1), lost=0, duplicates=0)


# ------------------------------------------------------------------ 5. clock skew


def skewed_env(worker_env: dict[str, str], tmp_path: Path, seconds: float) -> dict[str, str]:
    """A worker environment whose time.time() runs ``seconds`` off (via sitecustomize)."""
    site = tmp_path / f"skew{int(seconds)}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import time\n_real = time.time\n"
        f"time.time = lambda: _real() + {seconds!r}\n"
    )
    path = os.pathsep.join(p for p in (str(site), worker_env.get("PYTHONPATH", "")) if p)
    return {**worker_env, "PYTHONPATH": path}


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0])
def test_deadlines_are_measured_on_redis_clock_whatever_the_worker_clock(
    fleet, r, redis_url, queue_name, worker_env, tmp_path, skew_s
):
    q = keys.QueueRef(queue_name)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        # Expires while no worker runs; an hour-behind worker must still refuse it.
        late = client.submit("too late by any clock", deadline_s=0.3)
        time.sleep(1.0)
        fleet.start(env=skewed_env(worker_env, tmp_path, skew_s), ready=r, queue=queue_name)
        with pytest.raises(RemoteError) as caught:
            client.result(late, timeout_s=30)
        assert caught.value.code == "deadline_exceeded"
        # Has a minute left; an hour-ahead worker must still run it.
        on_time = client.infer("on time by Redis's clock", timeout_s=30, deadline_s=60)
        assert vector_ok(bytes(on_time.embedding), "on time by Redis's clock")
    fields = {"v": "1", "id": "hand", "text": "hand written", "timeout_ms": "60000"}
    r.xadd(keys.requests(q), fields)
    assert reply_of(r, keys.reply(q, "hand")).ok


# ------------------------------------------------------------ 6. bounded memory


@pytest.mark.slow
def test_read_ahead_is_bounded_in_bytes_when_tokens_claim_nothing(fleet, r, queue_name):
    """200 KB texts claiming tokens=0: the worker holds about read_ahead_bytes, not 1,024."""
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    bound = 1_000_000
    size = 200_000
    fleet.start("--read-ahead-bytes", str(bound), "--sim-batch-ms", "100",
                "--max-request-bytes", str(2 * size), "--sim-max-input-tokens", "64",
                "--max-batch-size", "1", ready=r, queue=queue_name)
    text = "word " * (size // 5)
    with r.pipeline(transaction=False) as pipe:
        for i in range(40):
            pipe.xadd(stream, {"v": "1", "id": f"b{i}", "text": text, "tokens": "0"})
        pipe.execute()
    replies = [keys.reply(q, f"b{i}") for i in range(40)]
    most = 0
    deadline = time.monotonic() + 60
    while r.exists(*replies) < len(replies):  # watched until the last is answered
        assert time.monotonic() < deadline, f"{r.exists(*replies)} of 40 answered"
        most = max(most, pending_of(r, q))
        time.sleep(0.05)
    assert 1 <= most <= bound // size + 1, most
    for i in range(40):
        assert reply_of(r, keys.reply(q, f"b{i}"), 60).ok


def test_dead_letters_are_capped_in_bytes_and_say_what_they_cut(fleet, r, queue_name):
    q = keys.QueueRef(queue_name)
    fleet.start("--max-request-bytes", str(8 << 20), ready=r, queue=queue_name)
    huge = b"x" * (8 << 20)
    for i in range(3):
        r.xadd(keys.requests(q), {"v": "2", "id": f"big{i}", "text": huge, "opts": b"\x80"})
    for i in range(3):
        assert reply_of(r, keys.reply(q, f"big{i}")).error.code == "bad_request"
    letters = r.xrange(keys.dead(q))
    assert len(letters) == 3
    for _, fields in letters:
        kept = {k: v for k, v in fields.items() if not k.startswith(b"dead_")}
        assert sum(len(k) + len(v) for k, v in kept.items()) <= DEAD_LETTER_BYTES
        assert fields[b"dead_truncated"].split(b",") == [b"text", b"opts"]
        assert huge.startswith(kept[b"text"]) and len(kept[b"text"]) > 1000
    usage = r.memory_usage(keys.dead(q))
    assert usage < 3 * DEAD_LETTER_BYTES + 64 * 1024, usage


def test_heartbeat_rows_of_workers_that_are_gone_are_pruned(fleet, r, queue_name):
    q = keys.QueueRef(queue_name)
    crashed = [fleet.start(name=f"gone{i}") for i in range(2)]
    for worker in crashed:
        worker.wait_ready(r, queue_name, timeout=fleet.ready_timeout)
    for worker in crashed:
        worker.kill()
    assert {b"gone0", b"gone1"} <= set(r.hkeys(keys.workers(q)))
    r.hset(keys.workers(q), "never-in-the-group", b"\x80")  # e.g. after the group was recreated
    fleet.start(name="alive", ready=r, queue=queue_name)
    wait_for(lambda: set(r.hkeys(keys.workers(q))) == {b"alive"}, 30, "stale rows to go")
    members = {c["name"] for c in r.xinfo_consumers(keys.requests(q), keys.GROUP)}
    assert members <= {b"alive"}


def test_seen_keys_expire(r, redis_url, queue_name):
    q = keys.QueueRef(queue_name)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        request_id = client.submit("remembered for a while, not for ever")
    ttl = r.pttl(keys.seen_call(q, [request_id]))
    assert 0 < ttl <= 60_000


# -------------------------------------------------- 7. stopping while Redis is frozen


def test_a_worker_told_to_stop_while_redis_is_frozen_exits_promptly(worker_env, tmp_path):
    server = RedisServer(tmp_path / "frozen")
    server.start()
    group = Fleet({**worker_env, "TOKENQ_REDIS_URL": server.url}, tmp_path, SIM)
    client = redis.Redis(port=server.port, socket_timeout=5)
    try:
        worker = group.start(ready=client, queue=worker_env["TOKENQ_QUEUE"])
        os.kill(server.process.pid, signal.SIGSTOP)
        time.sleep(1.0)
        started = time.monotonic()
        assert worker.terminate(timeout=30) == 0
        assert time.monotonic() - started < 12
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        group.close()
        client.close()
        server.stop()
