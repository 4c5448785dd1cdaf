"""``tokenq dlq``, ``stats`` and ``top`` on a sharded queue: every lane, each letter on its own.

A queue of 3 shards is served on ``{q:0}`` … ``{q:2}`` and the plain
``{q}``; its workers publish ``shards`` in ``{q}``'s config hash. Letters
are written as the worker writes them (shared/dead_letter.py) straight
into each lane's dead stream, with entry ids chosen so that two lanes
share one (ids are per stream).
"""

from __future__ import annotations

import json
import time

import msgpack
import pytest
import redis

from tokenq.producer.ops import dlq
from tokenq.producer.ops.dlq import main as dlq_main
from tokenq.producer.ops.dlq import spread_ids
from tokenq.producer.ops.stats import main as stats_main
from tokenq.producer.ops.top import main as top_main
from tokenq.shared import dead_letter, keys, wire
from tokenq.shared.keys import QueueRef

SHARDS = 3
SHARED_ID = "1700000000005-0"
"""An entry id both shard 0 and shard 2 hold."""


def lane(queue: str, shard: int | None) -> QueueRef:
    return QueueRef(queue, shard=shard)


def bury(r: redis.Redis, q: QueueRef, request_id: str, entry: str) -> dict[bytes, bytes]:
    """A letter as a worker writes it, at entry id ``entry``; returns the request's fields."""
    request = {"v": "1", "id": request_id, "text": f"text of {request_id}", "tokens": "3",
               "reply_to": keys.reply(q, request_id)}
    death = dead_letter.Death(code="dead_letter", message="delivered 5 times without an answer",
                              worker="w-old", deliveries=5, at_ms=int(time.time() * 1000),
                              source_id="1-0")
    r.xadd(keys.dead(q), dict(dead_letter.encode_letter(request, death, max_bytes=1 << 16)),
           id=entry)
    return {k.encode(): v.encode() for k, v in request.items()}


@pytest.fixture
def sharded(r: redis.Redis, queue_name: str) -> dict[str, dict[bytes, bytes]]:
    """Shards 0, 1, 2 and the plain lane with letters; request id -> its fields."""
    r.hset(keys.config(QueueRef(queue_name)), mapping={"shards": str(SHARDS), "model": "sim"})
    letters = {
        "p-old": (None, "1700000000001-0"),
        "s1-a": (1, "1700000000002-0"),
        "s0-a": (0, SHARED_ID),
        "s2-a": (2, SHARED_ID),
        "s2-b": (2, "1700000000009-0"),
    }
    return {rid: bury(r, lane(queue_name, shard), keys.id_on_shard(shard, rid), entry)
            for rid, (shard, entry) in letters.items()}


def run(capsys: pytest.CaptureFixture[str], redis_url: str, queue: str, *args: str) -> tuple:
    code = dlq_main(["--redis-url", redis_url, "--queue", queue, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def dead_ids(r: redis.Redis, q: QueueRef) -> list[str]:
    return [entry.decode() for entry, _ in r.xrange(keys.dead(q))]


def where(queue: str, kind: str) -> str:
    return (f"tokenq:{{{queue}:0}}:{kind} … tokenq:{{{queue}:2}}:{kind} and "
            f"tokenq:{{{queue}}}:{kind}")


# ---------------------------------------------------------------------- dlq list


def test_list_shows_every_lane_with_a_shard_column(sharded, redis_url, queue_name, capsys):
    code, out, err = run(capsys, redis_url, queue_name, "list")
    assert code == 0, err
    head, header, *rows = out.splitlines()
    assert head == f"5 dead letters in {where(queue_name, 'dead')}"
    assert header.split()[:3] == ["shard", "entry", "request"]
    # Oldest first across the lanes; the plain {q} is "-" in the shard column.
    assert [row.split()[:2] for row in rows] == [
        ["-", "plain/1700000000001-0"], ["1", "1/1700000000002-0"],
        ["0", f"0/{SHARED_ID}"], ["2", f"2/{SHARED_ID}"], ["2", "2/1700000000009-0"]]

    code, out, _ = run(capsys, redis_url, queue_name, "list", "--count", "2")  # in all
    head, _, *rows = out.splitlines()
    assert head == f"5 dead letters in {where(queue_name, 'dead')} (showing 2)"
    assert [row.split()[1] for row in rows] == ["plain/1700000000001-0", "1/1700000000002-0"]


def test_list_json_names_the_shard_and_the_letter(sharded, redis_url, queue_name, capsys):
    code, out, _ = run(capsys, redis_url, queue_name, "list", "--json")
    assert code == 0
    letters = [json.loads(line) for line in out.splitlines()]
    assert [(one["shard"], one["entry"]) for one in letters] == [
        (None, "plain/1700000000001-0"), (1, "1/1700000000002-0"), (0, f"0/{SHARED_ID}"),
        (2, f"2/{SHARED_ID}"), (2, "2/1700000000009-0")]
    by_request = {one["request_id"]: one for one in letters}
    assert by_request["2.s2-a"]["entry_id"] == SHARED_ID  # the stream's own id, as before
    assert by_request["2.s2-a"]["request"]["reply_to"] == keys.reply(
        lane(queue_name, 2), "2.s2-a")


def test_list_by_name_and_by_bare_id(sharded, redis_url, queue_name, capsys):
    code, out, err = run(capsys, redis_url, queue_name, "list", "--id", f"2/{SHARED_ID}",
                         "--json")
    assert code == 0 and err == ""
    [letter] = [json.loads(line) for line in out.splitlines()]
    assert letter["request_id"] == "2.s2-a" and letter["shard"] == 2

    code, out, err = run(capsys, redis_url, queue_name, "list", "--id", "1700000000002-0",
                         "--json")  # bare, in one lane only
    assert code == 0 and err == ""
    assert [json.loads(line)["entry"] for line in out.splitlines()] == ["1/1700000000002-0"]

    code, out, err = run(capsys, redis_url, queue_name, "list", "--id", SHARED_ID)
    assert code == 0  # listing both is harmless, and names them apart
    assert [row.split()[1] for row in out.splitlines()[2:]] == [
        f"0/{SHARED_ID}", f"2/{SHARED_ID}"]
    assert err.strip() == (f"tokenq dlq: {SHARED_ID} is in more than one dead stream "
                           f"(0/{SHARED_ID}, 2/{SHARED_ID}): all listed")

    code, out, err = run(capsys, redis_url, queue_name, "list", "--id", "7/1-0",
                         "plain/1700000000001-0", "1/9-0", "4-0")
    assert code == 1
    assert [row.split()[1] for row in out.splitlines()[2:]] == ["plain/1700000000001-0"]
    assert err.strip() == ("tokenq dlq: not in any of the queue's dead streams: "
                           "7/1-0 (no such shard: the queue has shards 0-2 and plain), "
                           "1/9-0, 4-0")


@pytest.mark.unit
def test_spread_ids_takes_a_run_of_letter_names():
    assert spread_ids(["retry", "--id", "0/1-0", "2/3-0", "plain/4-0", "5-0", "--all"]) == [
        "retry", "--id", "0/1-0", "--id", "2/3-0", "--id", "plain/4-0", "--id", "5-0", "--all"]


# ------------------------------------------------------------- dlq retry / purge


def test_retry_all_puts_each_letter_back_on_its_own_lane(sharded, redis_url, queue_name, r,
                                                         capsys):
    code, out, err = run(capsys, redis_url, queue_name, "retry", "--all")
    assert code == 0, err
    q0, q1, q2, plain = (lane(queue_name, k) for k in (0, 1, 2, None))
    assert out.strip() == (
        f"retried 5 dead letters: 1 onto {keys.requests(q0)}, 1 onto {keys.requests(q1)}, "
        f"2 onto {keys.requests(q2)}, 1 onto {keys.requests(plain)} "
        "(in each lane, every letter up to the last there when the retry started)")
    for q in (q0, q1, q2, plain):
        assert r.xlen(keys.dead(q)) == 0
    lengths = {q.shard: r.xlen(keys.requests(q)) for q in (q0, q1, q2, plain)}
    assert lengths == {0: 1, 1: 1, 2: 2, None: 1}
    # Exactly the request as its producer wrote it: its id and reply key are its lane's.
    back = {f[b"id"].decode(): (q, f) for q in (q0, q1, q2, plain)
            for _, f in r.xrange(keys.requests(q))}
    for rid, fields in sharded.items():
        q, found = back[fields[b"id"].decode()]
        assert as_written(found) == fields
        assert found[b"reply_to"].decode() == keys.reply(q, found[b"id"].decode())
        assert keys.shard_in_id(found[b"id"].decode()) == q.shard, rid


def as_written(fields: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """A retried entry's fields less the count the retry writes first (docs/PROTOCOL.md)."""
    assert next(iter(fields)) == wire.COUNTED_FIELD.encode()
    return {name: value for name, value in fields.items() if name != b"counted"}


def test_retry_by_name_bare_id_and_ambiguity(sharded, redis_url, queue_name, r, capsys):
    q0, q1, q2 = (lane(queue_name, k) for k in (0, 1, 2))
    code, out, err = run(capsys, redis_url, queue_name, "retry", "--id", SHARED_ID)
    assert code == 1
    assert out.strip() == f"retried 0 dead letters onto {where(queue_name, 'requests')}"
    assert err.strip() == (f"tokenq dlq: {SHARED_ID} is in more than one dead stream "
                           f"(0/{SHARED_ID}, 2/{SHARED_ID}): not retried; name the one you mean")
    assert r.xlen(keys.requests(q0)) == r.xlen(keys.requests(q2)) == 0

    code, out, err = run(capsys, redis_url, queue_name, "retry", "--id", f"2/{SHARED_ID}",
                         "1700000000002-0", "0/1-0")
    assert code == 1
    assert out.strip() == (f"retried 2 dead letters: 1 onto {keys.requests(q1)}, "
                           f"1 onto {keys.requests(q2)}")
    assert err.strip() == "tokenq dlq: not in any of the queue's dead streams: 0/1-0"
    [(_, fields)] = r.xrange(keys.requests(q2))
    assert as_written(fields) == sharded["s2-a"]
    assert dead_ids(r, q0) == [SHARED_ID] and dead_ids(r, q2) == ["1700000000009-0"]
    assert r.xlen(keys.dead(q1)) == 0


def test_retry_keeps_each_lanes_own_limit(sharded, redis_url, queue_name, r, capsys):
    q2 = lane(queue_name, 2)
    r.xadd(keys.requests(q2), {"v": "1", "id": "2.busy", "text": "t"})
    code, out, err = run(capsys, redis_url, queue_name, "retry", "--all",
                         "--max-queue-length", "2")
    assert code == 1
    assert out.startswith("retried 3 dead letters: ")  # shards 0, 1 and plain had room
    assert (f"tokenq dlq: shard 2 of queue {queue_name!r} holds 1 of at most 2 requests; "
            "moved 0 dead letters before it filled") in err
    assert r.xlen(keys.dead(q2)) == 2 and r.xlen(keys.requests(q2)) == 1


def test_retry_counts_what_a_lane_moved_before_it_filled(redis_url, queue_name, r, capsys):
    r.hset(keys.config(QueueRef(queue_name)), "shards", str(SHARDS))
    q0, q1 = lane(queue_name, 0), lane(queue_name, 1)
    for i in range(dlq._PAGE + 50):  # two pages on shard 0; the second does not fit
        bury(r, q0, f"0.r{i}", f"1700000000000-{i}")
    bury(r, q1, "1.r", "1700000000000-0")
    code, out, err = run(capsys, redis_url, queue_name, "retry", "--all",
                         "--max-queue-length", str(dlq._PAGE + 10))
    assert code == 1
    assert out.startswith(f"retried {dlq._PAGE + 1} dead letters: "
                          f"{dlq._PAGE} onto {keys.requests(q0)}, 1 onto ")
    assert f"moved {dlq._PAGE} dead letters before it filled" in err
    assert r.xlen(keys.dead(q0)) == 50 and r.xlen(keys.dead(q1)) == 0


def test_purge_by_name_and_all_lanes(sharded, redis_url, queue_name, r, capsys):
    q0, q1, q2, plain = (lane(queue_name, k) for k in (0, 1, 2, None))
    code, out, err = run(capsys, redis_url, queue_name, "purge", "--id", f"0/{SHARED_ID}",
                         "plain/1700000000001-0")
    assert code == 0, err
    assert out.strip() == (f"purged 2 dead letters: 1 from {keys.dead(q0)}, "
                           f"1 from {keys.dead(plain)}")
    assert dead_ids(r, q2) == [SHARED_ID, "1700000000009-0"] and r.xlen(keys.dead(q0)) == 0

    code, out, err = run(capsys, redis_url, queue_name, "purge", "--id", SHARED_ID)
    assert code == 0 and dead_ids(r, q2) == ["1700000000009-0"]  # unique now: shard 2's

    code, out, _ = run(capsys, redis_url, queue_name, "purge", "--all")
    assert code == 0 and out.strip() == (f"purged 2 dead letters: 1 from {keys.dead(q1)}, "
                                         f"1 from {keys.dead(q2)}")
    assert not any(r.exists(keys.dead(q)) for q in (q0, q1, q2, plain))
    code, out, _ = run(capsys, redis_url, queue_name, "purge", "--all")
    assert out.strip() == f"purged 0 dead letters from {where(queue_name, 'dead')}"


def test_an_unsharded_queue_lists_as_it_always_did(redis_url, queue_name, r, capsys):
    q = QueueRef(queue_name)
    r.hset(keys.config(q), "shards", "1")
    bury(r, q, "only", "1700000000001-0")
    bury(r, lane(queue_name, 1), "1.stray", "1700000000002-0")  # no shards published: unseen
    code, out, _ = run(capsys, redis_url, queue_name, "list")
    head, header, row = out.splitlines()
    assert head == f"1 dead letter in {keys.dead(q)}" and header.split()[0] == "entry"
    assert row.startswith("1700000000001-0  only  ")
    code, out, _ = run(capsys, redis_url, queue_name, "list", "--json")
    letter = json.loads(out)
    assert "shard" not in letter and "entry" not in letter
    code, _, err = run(capsys, redis_url, queue_name, "retry", "--id", "0/1700000000001-0")
    assert code == 1 and "0/1700000000001-0 (not a stream entry id)" in err


# ------------------------------------------------------------------ stats / top


def _beat(r: redis.Redis, q: QueueRef, name: str, at: float, **counters: int) -> None:
    r.hset(keys.workers(q), name, msgpack.packb({"at": at, "started_at": at - 10, **counters}))
    r.set(keys.worker_alive(q, name), "1", ex=30)


def _serve(r: redis.Redis, queue: str) -> None:
    """Backlogs on every lane, one worker heartbeating on all of them, one gone on shard 1."""
    r.hset(keys.config(QueueRef(queue)), "shards", str(SHARDS))
    seconds, micros = r.time()
    now = seconds + micros / 1e6
    for shard, waiting in ((0, 2), (1, 3), (2, 0), (None, 1)):
        q = lane(queue, shard)
        r.xgroup_create(keys.requests(q), keys.GROUP, id="$", mkstream=True)
        for i in range(waiting):
            r.xadd(keys.requests(q), {"v": "1", "id": keys.id_on_shard(shard, f"r{i}"),
                                      "text": "t"})
        r.hset(keys.pending(q), keys.PENDING_TOTAL, 10 * waiting)  # as enqueue.lua keeps it
        _beat(r, q, "w1", now, requests_ok=10, tokens=100, padded_tokens=100)
    r.xreadgroup(keys.GROUP, "w1", {keys.requests(lane(queue, 1)): ">"}, count=1)
    r.hset(keys.workers(lane(queue, 1)), "ghost", msgpack.packb({"at": now - 60}))
    bury(r, lane(queue, 0), "0.d", "1700000000001-0")
    bury(r, QueueRef(queue), "d", "1700000000002-0")


def test_stats_json_adds_a_total_per_sharded_queue(redis_url, queue_name, r, capsys):
    _serve(r, queue_name)
    assert stats_main(["--redis-url", redis_url, "--json", "--queue", queue_name]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [row["label"] for row in doc["queues"]] == [
        queue_name, f"{queue_name}:0", f"{queue_name}:1", f"{queue_name}:2"]
    [whole] = doc["totals"]
    assert whole["queue"] == queue_name and whole["label"] == f"{queue_name} (3 shards)"
    assert whole["shards"] == 3 and whole["lanes"] == [row["label"] for row in doc["queues"]]
    assert (whole["length"], whole["pending"], whole["lag"], whole["dead"]) == (6, 1, 5, 2)
    assert [row["pending_tokens"] for row in doc["queues"]] == [10, 20, 30, 0]
    assert whole["pending_tokens"] == 60
    assert whole["oldest_pending_ms"] is not None
    assert whole["stale_workers"] == ["ghost"]
    assert whole["totals"]["workers"] == 1 and whole["totals"]["requests_ok"] == 10

    # Found by SCAN too, among whatever other queues the server holds.
    assert stats_main(["--redis-url", redis_url, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    [again] = [one for one in found["totals"] if one["queue"] == queue_name]
    assert {**again, "oldest_pending_ms": None} == {**whole, "oldest_pending_ms": None}


def test_stats_and_top_show_the_whole_queue_after_its_lanes(redis_url, queue_name, r, capsys):
    _serve(r, queue_name)
    assert stats_main(["--redis-url", redis_url, "--queue", queue_name]) == 0
    blocks = capsys.readouterr().out.strip().split("\n\n")
    heads = [block.splitlines()[0] for block in blocks]
    assert [head.split(": ", 1)[0] for head in heads] == [
        f"queue {queue_name}", f"queue {queue_name}:0", f"queue {queue_name}:1",
        f"queue {queue_name}:2", f"queue {queue_name} (3 shards)"]
    assert heads[-1].startswith(
        f"queue {queue_name} (3 shards): length 6 (60 tokens)  pending 1 (oldest ")
    assert "lag 5  dead 2  workers 1 (1 gone)  1.0 req/s" in heads[-1]
    assert len(blocks[-1].splitlines()) == 1  # the workers are in the lanes' tables

    assert top_main(["--redis-url", redis_url, "--queue", queue_name, "--once"]) == 0
    frame = capsys.readouterr().out
    assert frame.index(f"queue {queue_name}:2 ") < frame.index(f"queue {queue_name} (3 shards) ")
    assert "length 6 (60 tokens)  pending 1" in frame

    assert top_main(["--redis-url", redis_url, "--queue", queue_name, "--json", "--once"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [whole["label"] for whole in doc["totals"]] == [f"{queue_name} (3 shards)"]


def test_an_unsharded_snapshot_has_no_totals(redis_url, queue_name, r, capsys):
    q = QueueRef(queue_name)
    r.xadd(keys.requests(q), {"v": "1", "id": "a", "text": "t"})
    assert stats_main(["--redis-url", redis_url, "--json", "--queue", queue_name]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"version", "at", "redis_url", "queues"} and len(doc["queues"]) == 1
    assert stats_main(["--redis-url", redis_url, "--queue", queue_name]) == 0
    assert "shard" not in capsys.readouterr().out
