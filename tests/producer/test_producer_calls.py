"""The producer's call sequences, driven step by step: no Redis, no client.

Each test plays the driver's part (h11's shape): it resumes a call with the
answer it would have got from Redis and checks what the call asks for next.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from redis._parsers.base import BaseParser

from tokenq.producer import (
    BrokerOutOfMemory,
    BrokerUnavailable,
    NotReplicated,
    QueueFull,
    ReplyTimeout,
    Result,
    calls,
)
from tokenq.producer.core import ClientCore
from tokenq.producer.redis_deadlines import failure
from tokenq.shared import keys, redis_refusal, wire
from tokenq.shared.settings import ClientSettings

pytestmark = pytest.mark.unit


def fresh_core(**settings: Any) -> ClientCore:
    """A core whose config copy is fresh (read, empty), so calls go straight to the enqueue."""
    core = ClientCore(ClientSettings(queue="q", **settings))
    core.config.take({}, time.monotonic())
    return core


def answer(call: calls.Call[Any], reply: Any = None) -> calls.Step | calls.Done[Any]:
    return calls.resume(call, reply)


def fail(call: calls.Call[Any], error: Exception) -> calls.Step | calls.Done[Any]:
    """Resume ``call`` as a driver does after redis-py raised ``error``."""
    return calls.resume(call, failure(error))


def test_submit_reads_a_stale_config_then_enqueues_once() -> None:
    core = ClientCore(ClientSettings(queue="q"))
    call = calls.submit(core, "hello", deadline_s=5)
    assert isinstance(step := calls.resume(call), calls.ShareConfigRead)
    step = answer(call)
    assert isinstance(step, calls.Send) and step.command == calls.ENQUEUE
    fields = wire.decode_request(
        dict(zip(step.kwargs["args"][4::2], step.kwargs["args"][5::2], strict=False))
    )
    assert fields.text == "hello" and fields.timeout_ms == 5000
    done = answer(call, [b"1-0"])
    assert isinstance(done, calls.Done) and done.value == fields.id


def test_queue_full_is_refused_and_other_error_replies_stay_redis_errors() -> None:
    core = fresh_core()
    call = calls.submit(core, "a")
    assert isinstance(calls.resume(call), calls.Send)
    with pytest.raises(QueueFull, match="holds 9 of at most 10"):
        fail(call, redis.ResponseError("QUEUEFULL 9 10 1"))
    call = calls.submit(core, "a")
    calls.resume(call)
    with pytest.raises(redis.ResponseError, match="NOPERM"):
        fail(call, redis.ResponseError("NOPERM no access"))


def test_a_durable_enqueue_waits_within_the_call_and_refuses_a_shortfall() -> None:
    """One step carries the script and WAIT (one connection); WAIT never outlasts the call."""
    core = fresh_core(durable_replicas=2, durable_timeout_ms=5000, timeout_s=1)
    call = calls.submit(core, "a")
    step = calls.resume(call)
    assert isinstance(step, calls.Send) and step.command == calls.DURABLE_ENQUEUE
    assert step.kwargs["replicas"] == 2 and 1 <= step.kwargs["timeout_ms"] <= 1000
    done = answer(call, ([b"1-0"], 2))
    assert isinstance(done, calls.Done)
    call = calls.submit(core, "a")
    calls.resume(call)
    with pytest.raises(NotReplicated, match="1 of 2 replicas") as info:
        answer(call, ([b"1-0"], 1))
    assert len(info.value.request_ids) == 1
    call = calls.submit(fresh_core(), "a")  # not durable: the plain script
    assert calls.resume(call).command == calls.ENQUEUE  # type: ignore[union-attr]


def test_infer_retries_a_lost_enqueue_with_the_same_entries() -> None:
    core = fresh_core()
    call = calls.infer(core, "a", timeout_s=5.0)
    first = calls.resume(call)
    assert isinstance(first, calls.Send)
    pause = fail(call, redis.ConnectionError("reset"))
    assert isinstance(pause, calls.Sleep) and 0 < pause.seconds <= 0.5
    again = answer(call)
    assert isinstance(again, calls.Send) and again.kwargs == first.kwargs  # deduplicated
    wait = answer(call, [b"1-0"])
    assert isinstance(wait, calls.Send) and wait.command == "blmove"


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (redis.ConnectionError("refused"), "unreachable: refused"),
        (redis.ResponseError("BUSY Redis is busy running a script"), "busy running a script"),
    ],
)
def test_submit_gives_up_after_redis_pys_own_retries(error: Exception, shown: str) -> None:
    """No persist: one outage (a BUSY reply counts as one) is BrokerUnavailable at once."""
    call = calls.submit(fresh_core(), "a")
    calls.resume(call)
    with pytest.raises(BrokerUnavailable, match=shown):
        fail(call, error)


@pytest.mark.parametrize("code", redis_refusal.KNOWN_NOW)
def test_every_refusal_for_redis_own_state_reaches_a_producer_by_name(code: str) -> None:
    """A command Redis did not run for its own state (read-only, no disk, too few replicas,
    full...) is retried as an outage, then ``BrokerUnavailable`` (or ``BrokerOutOfMemory``)
    naming it: never a bare ``ResponseError``."""
    error = BaseParser.parse_error(f"{code} refused for the test")  # as redis-py raises it
    call = calls.submit(fresh_core(), "a")
    calls.resume(call)
    with pytest.raises((BrokerUnavailable, BrokerOutOfMemory)):
        while True:  # out of memory, the call asks whether an earlier try was written
            fail(call, error)


def test_results_wait_on_own_keys_until_the_deadline() -> None:
    core = fresh_core()
    request_id = core.lanes.home.new_id()
    call = calls.results(core, [request_id], 0.05)
    step = calls.resume(call)
    key = core.lanes.home.reply_key(request_id)
    assert isinstance(step, calls.Send) and step.command == "blmove"
    assert step.args[:2] == (key, key) and step.kwargs == {"src": "LEFT", "dest": "RIGHT"}
    time.sleep(0.06)
    check = answer(call, None)  # nothing read, so nothing to delete; then: is anyone alive?
    assert isinstance(check, calls.Send) and check.command == "hkeys"
    assert check.args == (core.lanes.home.workers_key,)
    alive = answer(call, [b"w1", b"w2"])
    assert isinstance(alive, calls.Send) and alive.command == "exists"
    assert alive.args == tuple(keys.worker_alive(keys.QueueRef("q"), w) for w in ["w1", "w2"])
    with pytest.raises(ReplyTimeout) as raised:
        answer(call, 1)  # one of them is: the timeout gives no reason
    assert raised.value.why is None and "no live worker" not in str(raised.value)


@pytest.mark.parametrize("workers", [[], [b"w1"]])
def test_a_timeout_with_no_live_worker_says_so(workers: list[bytes]) -> None:
    core = fresh_core()
    call = calls.results(core, [core.lanes.home.new_id()], 0.01)
    calls.resume(call)
    time.sleep(0.02)
    check = answer(call, None)
    assert isinstance(check, calls.Send) and check.command == "hkeys"
    with pytest.raises(ReplyTimeout, match="no live worker serves queue 'q'") as raised:
        if workers:  # named in the hash, but its liveness key has expired
            step = answer(call, workers)
            assert isinstance(step, calls.Send) and step.command == "exists"
            answer(call, 0)
        else:  # nobody ever registered: no EXISTS needed
            answer(call, workers)
    assert "tokenq worker --queue q" in str(raised.value)


def test_a_liveness_check_that_fails_gives_the_plain_timeout() -> None:
    core = fresh_core()
    call = calls.results(core, [core.lanes.home.new_id()], 0.01)
    calls.resume(call)
    time.sleep(0.02)
    answer(call, None)
    with pytest.raises(ReplyTimeout) as raised:
        fail(call, redis.ResponseError("NOPERM this user has no permissions to run 'hkeys'"))
    assert raised.value.why is None


def test_results_delete_a_reply_key_only_once_its_reply_is_in_hand() -> None:
    core = fresh_core()
    request_id = core.lanes.home.new_id()
    key = core.lanes.home.reply_key(request_id)
    call = calls.results(core, [request_id], 5.0)
    calls.resume(call)
    raw = wire.encode_reply(wire.scores_reply(request_id, [0.5]))
    delete = answer(call, raw)
    assert isinstance(delete, calls.Send) and delete.command == "delete"
    assert delete.args == (key,)
    done = answer(call, 1)
    assert isinstance(done, calls.Done)
    (result,) = done.value
    assert isinstance(result, Result) and result.scores == (0.5,)


def test_a_read_lost_on_its_way_is_read_again_since_nothing_was_removed() -> None:
    """The class of failure: Redis answered, the answer never arrived (restart, reset)."""
    core = fresh_core()
    request_id = core.lanes.home.new_id()
    key = core.lanes.home.reply_key(request_id)
    call = calls.results(core, [request_id], 5.0)
    first = calls.resume(call)
    pause = fail(call, redis.ConnectionError("reset after the reply was sent"))
    assert isinstance(pause, calls.Sleep)
    again = answer(call)
    assert isinstance(again, calls.Send) and (again.command, again.args) == (
        first.command,
        first.args,
    )
    raw = wire.encode_reply(wire.scores_reply(request_id, [0.25]))
    delete = answer(call, raw)
    assert isinstance(delete, calls.Send) and (delete.command, delete.args) == ("delete", (key,))
    done = answer(call, 1)
    assert isinstance(done, calls.Done) and done.value[0].scores == (0.25,)


def test_results_of_many_read_every_missing_key_at_once_then_wait_on_one() -> None:
    core = fresh_core()
    ids = [core.lanes.home.new_id() for _ in range(3)]
    reply_keys = [core.lanes.home.reply_key(i) for i in ids]
    raws = [wire.encode_reply(wire.scores_reply(i, [float(n)])) for n, i in enumerate(ids)]
    call = calls.results(core, ids, 5.0)
    peek = calls.resume(call)
    assert isinstance(peek, calls.Send) and peek.command == calls.PEEK
    assert peek.kwargs == {"keys": reply_keys}
    peek = answer(call, [None, raws[1], None])  # one landed: taken, the rest read again
    assert isinstance(peek, calls.Send) and peek.kwargs == {"keys": [reply_keys[0], reply_keys[2]]}
    wait = answer(call, [None, None])  # none landed: wait on the first missing key
    assert isinstance(wait, calls.Send) and wait.command == "blmove"
    assert wait.args[:2] == (reply_keys[0], reply_keys[0])
    last = answer(call, raws[0])
    assert isinstance(last, calls.Send) and last.command == "blmove"  # one key left: no peek
    delete = answer(call, raws[2])
    assert isinstance(delete, calls.Send) and delete.command == "delete"
    assert sorted(delete.args) == sorted(reply_keys)
    done = answer(call, 3)
    assert isinstance(done, calls.Done)
    assert [result.scores for result in done.value] == [(0.0,), (1.0,), (2.0,)]


def test_infer_many_reads_its_shared_key_then_trims_what_it_read() -> None:
    core = fresh_core()
    call = calls.infer_many(core, ["a", "b"], timeout_s=5.0)
    enqueue = calls.resume(call)
    assert isinstance(enqueue, calls.Send) and enqueue.command == calls.ENQUEUE
    read = answer(call, [b"1-0", b"1-1"])
    assert isinstance(read, calls.Send) and read.command == "lrange"
    reply_key = read.args[0]
    wait = answer(call, [])
    assert isinstance(wait, calls.Send) and wait.command == "blmove"
    assert wait.args[:2] == (reply_key, reply_key)
    read = answer(call, b"whatever arrived first")
    assert isinstance(read, calls.Send) and read.command == "lrange"
    args = [a.decode() if isinstance(a, bytes) else a for a in enqueue.kwargs["args"]]
    ids = [args[i + 1] for i, value in enumerate(args) if value == "id"]
    assert len(ids) == 2
    raws = [wire.encode_reply(wire.scores_reply(i, [1.0])) for i in ids]
    trim = answer(call, [raws[0]])
    assert isinstance(trim, calls.Send) and trim.command == "ltrim"
    assert trim.args == (reply_key, 1, -1)
    again = fail(call, redis.ConnectionError("reset"))  # the trim failed: read again
    assert isinstance(again, calls.Send) and again.command == "lrange"
    trim = answer(call, [raws[0], raws[1]])  # the first is read twice, matched once
    assert isinstance(trim, calls.Send) and trim.args == (reply_key, 2, -1)
    done = answer(call, True)
    assert isinstance(done, calls.Done)
    assert [result.scores for result in done.value] == [(1.0,), (1.0,)]


def test_async_infer_listens_before_it_enqueues() -> None:
    core = fresh_core()
    core.listener = lambda lane: "client-key"
    call = calls.infer_many(core, ["a", "b"], timeout_s=5.0, return_exceptions=True)
    listen = calls.resume(call)
    assert isinstance(listen, calls.Listen) and len(listen.ids) == 2
    assert listen.key == "client-key"
    assert isinstance(answer(call), calls.Send)
    collect = answer(call, [b"1-0", b"1-1"])
    assert isinstance(collect, calls.Collect) and collect.ids == listen.ids
    check = answer(call, ({}, None))
    assert isinstance(check, calls.Send) and check.command == "hkeys"
    done = answer(call, [])
    assert isinstance(done, calls.Done)
    assert all(isinstance(item, ReplyTimeout) for item in done.value)


def test_an_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'reply_to'"):
        calls.resume(calls.infer(fresh_core(), "a", reply_to="k"))  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "module",
    [
        "core.py",
        "calls.py",
        "call_options.py",
        "config.py",
        "shards.py",
        "lanes.py",
        "prepare.py",
        "replies.py",
        "deadline.py",
    ],
)
def test_the_sans_io_modules_import_no_redis_and_no_asyncio(module: str) -> None:
    path = Path(__file__).resolve().parents[2] / "producer" / module
    imported = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"redis", "asyncio", "socket"}
