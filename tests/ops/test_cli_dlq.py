"""``tokenq dlq list|retry|purge`` on dead letters written as the worker writes them."""

from __future__ import annotations

import json
import threading
import time
from typing import get_args

import msgpack
import numpy as np
import pytest
import redis

from tests.support import DIM, MAX_INPUT, wait_for
from tokenq.producer.ops import dlq
from tokenq.producer.ops.dlq import ACTIONS, spread_ids
from tokenq.producer.ops.dlq import main as dlq_main
from tokenq.shared import keys
from tokenq.shared.keys import QueueRef
from tokenq.shared.settings import DlqSettings
from tokenq.worker.backends.sim import expected_vector

pytest_plugins = ("tests.cli_fixtures",)


def bury(r: redis.Redis, q: QueueRef, request_id: str, text: str, **extra: str) -> str:
    """A dead letter with the original request fields plus the worker's dead_* fields."""
    fields = {
        "v": "1", "id": request_id, "text": text, "tokens": "3",
        "reply_to": keys.reply(q, request_id), **extra,
        "dead_error_code": "dead_letter", "dead_error": "delivered 5 times without an answer",
        "dead_worker": "w-old", "dead_deliveries": "5",
        "dead_at_ms": str(int(time.time() * 1000)), "dead_source_id": "1-0",
    }
    return r.xadd(keys.dead(q), fields).decode()


def run(capsys: pytest.CaptureFixture[str], redis_url: str, queue: str, *args: str) -> tuple:
    code = dlq_main(["--redis-url", redis_url, "--queue", queue, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_list_shows_why_each_request_died(redis_url, queue_name, r, capsys):
    q = QueueRef(queue_name)
    first = bury(r, q, "req-1", "a poisoned input " * 10)
    bury(r, q, "req-2", "another one")
    code, out, _ = run(capsys, redis_url, queue_name, "list")
    assert code == 0
    assert out.startswith(f"2 dead letters in {keys.dead(q)}")
    assert first in out and "req-1" in out and "dead_letter" in out and "w-old" in out

    code, out, _ = run(capsys, redis_url, queue_name, "list", "--json", "--count", "1")
    [line] = out.splitlines()
    letter = json.loads(line)
    assert letter["entry_id"] == first and letter["request_id"] == "req-1"
    assert letter["error_code"] == "dead_letter" and letter["deliveries"] == 5
    assert letter["worker"] == "w-old" and letter["source_id"] == "1-0"
    assert letter["request"]["text"].startswith("a poisoned input")
    assert not any(name.startswith("dead_") for name in letter["request"])


def test_retry_requeues_and_a_worker_answers_on_the_original_reply_key(
    sim_worker, redis_url, queue_name, r, capsys
):
    q = QueueRef(queue_name)
    retried = bury(r, q, "again-1", "please run me again")
    kept = bury(r, q, "stays", "not retried")
    code, out, _ = run(capsys, redis_url, queue_name, "retry", "--id", retried)
    assert code == 0 and "retried 1 dead letter " in out
    [(_, fields)] = r.xrange(keys.requests(q))
    assert next(iter(fields)) == b"counted"  # written again by the retry (docs/PROTOCOL.md)
    assert {k.decode() for k in fields} == {"counted", "v", "id", "text", "tokens", "reply_to"}
    assert [entry_id.decode() for entry_id, _ in r.xrange(keys.dead(q))] == [kept]

    sim_worker()
    popped = r.blpop([keys.reply(q, "again-1")], timeout=20)
    assert popped is not None, "the retried request was not answered"
    body = msgpack.unpackb(popped[1], raw=False)
    assert body["id"] == "again-1" and body["ok"] is True
    np.testing.assert_allclose(
        np.frombuffer(body["embedding"], dtype="<f4"),
        expected_vector("please run me again", DIM, MAX_INPUT), atol=1e-6,
    )


def test_retry_all_pages_and_drop_deadline(redis_url, queue_name, r, capsys):
    q = QueueRef(queue_name)
    for i in range(dlq._PAGE + 5):
        bury(r, q, f"r{i}", f"text {i}", deadline_ms="1")
    code, out, _ = run(capsys, redis_url, queue_name, "retry", "--all", "--drop-deadline")
    assert code == 0 and f"retried {dlq._PAGE + 5} dead letters" in out
    assert r.xlen(keys.dead(q)) == 0
    entries = r.xrange(keys.requests(q))
    assert [f[b"id"].decode() for _, f in entries] == [f"r{i}" for i in range(dlq._PAGE + 5)]
    assert all(b"deadline_ms" not in f for _, f in entries)


def test_retry_respects_the_queue_limit_and_reports_missing_ids(redis_url, queue_name, r, capsys):
    q = QueueRef(queue_name)
    ids = [bury(r, q, f"r{i}", "t") for i in range(3)]
    outcome = dlq.retry(r, q, ids, max_queue_length=2)
    assert "holds 0 of at most 2 requests; moved 0 dead letters" in str(outcome.full)
    assert r.xlen(keys.dead(q)) == 3 and r.xlen(keys.requests(q)) == 0  # nothing moved
    code, _, err = run(capsys, redis_url, queue_name, "retry", "--id", ids[0],
                       "--max-queue-length", "2")
    assert code == 0 and r.xlen(keys.requests(q)) == 1
    code, out, err = run(capsys, redis_url, queue_name, "retry", "--id", ids[0], ids[1])
    assert code == 1 and ids[0] in err and "retried 1 dead letter " in out
    code, _, err = run(capsys, redis_url, queue_name, "retry", "--all", "--max-queue-length", "2")
    assert code == 1 and "holds 2 of at most 2" in err


def test_purge_by_id_and_all(redis_url, queue_name, r, capsys):
    q = QueueRef(queue_name)
    ids = [bury(r, q, f"r{i}", "t") for i in range(4)]
    code, out, _ = run(capsys, redis_url, queue_name, "purge", "--id", ids[0], ids[1])
    assert code == 0 and "purged 2 dead letters" in out and r.xlen(keys.dead(q)) == 2
    code, out, _ = run(capsys, redis_url, queue_name, "purge", "--id", ids[2])
    assert code == 0 and out.startswith("purged 1 dead letter from")
    code, out, _ = run(capsys, redis_url, queue_name, "purge", "--all")
    assert code == 0 and "purged 1 dead letter " in out and not r.exists(keys.dead(q))


def test_list_shows_the_reason_as_text_in_the_table_and_in_json(
    sim_worker, redis_url, queue_name, r, capsys
):
    """The reason a worker wrote, even one quoting a raw field as a bytes literal."""
    q = QueueRef(queue_name)
    sim_worker()
    r.xadd(keys.requests(q), {"v": "9", "id": "future", "text": "hi"})  # as the worker writes it
    wait_for(lambda: r.xlen(keys.dead(q)) == 1, what="the worker's dead letter")
    odd = r.xadd(keys.dead(q), {"v": "1", "id": "odd", "text": "t", "dead_error_code": "x",
                                "dead_error": b"caf\xc3\xa9 \xff broke"}).decode()
    code, out, _ = run(capsys, redis_url, queue_name, "list")
    assert code == 0
    header, *rows = out.splitlines()[1:]
    assert header.split()[:4] == ["entry", "request", "code", "reason"]
    [future_row] = [row for row in rows if " future " in row]
    assert "unsupported protocol version '9'; this worker speaks 1" in future_row
    [odd_row] = [row for row in rows if row.startswith(odd)]
    assert "café \ufffd broke" in odd_row
    code, out, _ = run(capsys, redis_url, queue_name, "list", "--json")
    by_id = {letter["request_id"]: letter for letter in map(json.loads, out.splitlines())}
    assert by_id["future"]["error"] == "unsupported protocol version '9'; this worker speaks 1"
    assert by_id["odd"]["error"] == "café \ufffd broke"
    code, out, _ = run(capsys, redis_url, queue_name, "list", "--id", odd)
    assert out.startswith(f"2 dead letters in {keys.dead(q)} (showing 1)")
    run(capsys, redis_url, queue_name, "purge", "--id", odd)
    code, out, _ = run(capsys, redis_url, queue_name, "list")
    assert out.startswith(f"1 dead letter in {keys.dead(q)}\n")


@pytest.mark.unit
def test_help_lists_every_action_and_variable(capsys):
    with pytest.raises(SystemExit):
        dlq_main(["--help"])
    text = capsys.readouterr().out
    assert "{list,retry,purge}" in text.split("\n\n", 1)[0]  # in the usage line
    actions = text.split("actions:\n", 1)[1].split("\n\n", 1)[0]
    assert [line.split()[0] for line in actions.splitlines() if not line.startswith("    ")] == [
        "list", "retry", "purge"]
    assert list(ACTIONS) == list(get_args(DlqSettings.model_fields["action"].annotation))
    for variable in ("TOKENQ_QUEUE", "TOKENQ_COUNT", "TOKENQ_AS_JSON (--json)", "TOKENQ_ALL"):
        assert variable in text


def test_retry_and_purge_need_a_target(redis_url, queue_name, capsys):
    code, _, err = run(capsys, redis_url, queue_name, "purge")
    assert code == 2 and "--id ENTRY_ID" in err
    code, _, err = run(capsys, redis_url, queue_name, "retry", "--all", "--id", "1-0")
    assert code == 2


@pytest.mark.unit
def test_spread_ids_accepts_a_run_of_ids():
    assert spread_ids(["retry", "--id", "1-0", "2-0", "3", "--all"]) == [
        "retry", "--id", "1-0", "--id", "2-0", "--id", "3", "--all"]
    assert spread_ids(["--id", "1-0", "retry"]) == ["--id", "1-0", "retry"]


# ------------------------------------------------------- retry works on a snapshot


class _DyingAgain:
    """A Redis client through which every read of the dead stream first lets a "worker"
    dead-letter again whatever retried requests are on the request stream (new letters,
    new ids), as a request that still kills its workers does, up to ``cap`` times."""

    def __init__(self, r: redis.Redis, q: QueueRef, cap: int = 2000) -> None:
        self._r, self._q, self.cap, self.reburied = r, q, cap, 0

    def __getattr__(self, name: str):
        return getattr(self._r, name)

    def xrange(self, *args, **kwargs):
        for entry_id, fields in self._r.xrange(keys.requests(self._q)):
            if self.reburied >= self.cap:
                break
            self._r.xdel(keys.requests(self._q), entry_id)
            bury(self._r, self._q, fields[b"id"].decode(), fields[b"text"].decode())
            self.reburied += 1
        return self._r.xrange(*args, **kwargs)


def test_retry_all_stops_at_the_last_letter_there_when_it_started(queue_name, r):
    q = QueueRef(queue_name)
    original = [bury(r, q, f"r{i}", f"text {i}") for i in range(2 * dlq._PAGE + 50)]
    dying = _DyingAgain(r, q)
    outcome = dlq.retry(dying, q, None, max_queue_length=0)
    assert outcome.moved == original and outcome.last_id == original[-1]
    assert not outcome.missing and not outcome.skipped and not outcome.vanished
    # The letters that died again while it ran are still there, none retried twice.
    assert 0 < dying.reburied < len(original)
    left = [entry_id.decode() for entry_id, _ in r.xrange(keys.dead(q))]
    assert len(left) == dying.reburied and not set(left) & set(original)
    assert r.xlen(keys.requests(q)) + len(left) == len(original)


def test_retry_all_with_letters_dying_again_concurrently_touches_exactly_the_snapshot(
    redis_url, queue_name, r, capsys
):
    q = QueueRef(queue_name)
    original = [bury(r, q, f"r{i}", f"text {i}") for i in range(3 * dlq._PAGE)]
    stop = threading.Event()
    reburied: list[str] = []

    def worker() -> None:  # takes whatever is on the request stream and kills it again
        with redis.Redis.from_url(redis_url) as own:
            while not stop.is_set() and len(reburied) < 5000:
                for entry_id, fields in own.xrange(keys.requests(q), count=50):
                    if own.xdel(keys.requests(q), entry_id):
                        reburied.append(bury(own, q, fields[b"id"].decode(), "again"))

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        code, out, err = run(capsys, redis_url, queue_name, "retry", "--all")
    finally:
        stop.set()
        thread.join(10)
    assert code == 0, err
    assert f"retried {len(original)} dead letters" in out
    assert f"up to {original[-1]}" in out
    left = [entry_id.decode() for entry_id, _ in r.xrange(keys.dead(q))]
    assert left == reburied and not set(left) & set(original)
    assert r.xlen(keys.requests(q)) + len(left) == len(original)  # each request once


# ------------------------------------------------------------ truncated letters


def test_truncated_letters_are_listed_as_such_and_never_retried(redis_url, queue_name, r, capsys):
    q = QueueRef(queue_name)
    whole = bury(r, q, "whole", "retry me")
    cut = bury(r, q, "cut", "the beginning of a very long te", dead_truncated="text,opts")
    empty = r.xadd(keys.dead(q), {"dead_error_code": "bad_request", "dead_error": "x"}).decode()

    code, out, _ = run(capsys, redis_url, queue_name, "list")
    assert code == 0
    header, *rows = out.splitlines()[1:]
    assert "truncated" in header.split()
    [cut_row] = [row for row in rows if row.startswith(cut)]
    assert "text,opts" in cut_row
    [whole_row] = [row for row in rows if row.startswith(whole)]
    assert "text,opts" not in whole_row
    code, out, _ = run(capsys, redis_url, queue_name, "list", "--json")
    by_id = {letter["entry_id"]: letter for letter in map(json.loads, out.splitlines())}
    assert by_id[cut]["truncated"] == ["text", "opts"] and by_id[whole]["truncated"] is None
    assert "dead_truncated" not in by_id[cut]["request"]

    code, _, err = run(capsys, redis_url, queue_name, "retry", "--id", cut)
    assert code == 1 and cut in err and "truncated" in err and "text,opts" in err
    assert r.xlen(keys.requests(q)) == 0

    code, out, err = run(capsys, redis_url, queue_name, "retry", "--all")
    assert code == 1 and "retried 1 dead letter " in out
    assert f"skipped {cut}: truncated" in err and f"skipped {empty}:" in err
    assert "Traceback" not in err
    [(_, fields)] = r.xrange(keys.requests(q))
    assert fields[b"id"] == b"whole"
    assert [i.decode() for i, _ in r.xrange(keys.dead(q))] == [cut, empty]  # left in place


def test_list_ages_come_from_redis_clock_not_the_operators(
    redis_url, queue_name, r, capsys, monkeypatch
):
    q = QueueRef(queue_name)
    entry = bury(r, q, "recent", "just died")
    real = time.time
    for skew in (-7200.0, 7200.0):
        monkeypatch.setattr(time, "time", lambda skew=skew: real() + skew)
        code, out, _ = run(capsys, redis_url, queue_name, "list")
        assert code == 0
        [row] = [line for line in out.splitlines() if line.startswith(entry)]
        age = next(cell for cell in row.split() if cell.endswith("s") and cell[:-1].isdigit())
        assert int(age[:-1]) < 60, row
