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

from tokenq.producer import BrokerUnavailable, QueueFull, ReplyTimeout, Result, calls
from tokenq.producer.connection import failure
from tokenq.producer.core import ClientCore
from tokenq.shared import wire
from tokenq.shared.settings import ClientSettings


def fresh_core(**settings: Any) -> ClientCore:
    """A core whose config copy is fresh (read, empty), so calls go straight to the enqueue."""
    core = ClientCore(ClientSettings(queue="q", **settings))
    core.take_config({}, time.monotonic())
    return core


def answer(call: calls.Call[Any], reply: Any = None) -> calls.Step | calls.Done[Any]:
    return calls.resume(call, reply)


def fail(call: calls.Call[Any], error: Exception) -> calls.Step | calls.Done[Any]:
    """Resume ``call`` as a driver does after redis-py raised ``error``."""
    return calls.resume(call, failure=failure(error))


def test_submit_reads_a_stale_config_then_enqueues_once() -> None:
    core = ClientCore(ClientSettings(queue="q"))
    call = calls.submit(core, "hello", None, {"deadline_s": 5})
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
    call = calls.submit(core, "a", None, {})
    assert isinstance(calls.resume(call), calls.Send)
    with pytest.raises(QueueFull, match="holds 9 of at most 10"):
        fail(call, redis.ResponseError("QUEUEFULL 9 10 1"))
    call = calls.submit(core, "a", None, {})
    calls.resume(call)
    with pytest.raises(redis.ResponseError, match="NOPERM"):
        fail(call, redis.ResponseError("NOPERM no access"))


def test_infer_retries_a_lost_enqueue_with_the_same_entries() -> None:
    core = fresh_core()
    call = calls.infer(core, "a", None, 5.0, {}, None)
    first = calls.resume(call)
    assert isinstance(first, calls.Send)
    pause = fail(call, redis.ConnectionError("reset"))
    assert isinstance(pause, calls.Sleep) and 0 < pause.seconds <= 0.5
    again = answer(call)
    assert isinstance(again, calls.Send) and again.kwargs == first.kwargs  # deduplicated
    wait = answer(call, [b"1-0"])
    assert isinstance(wait, calls.Send) and wait.command == "blpop"


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (redis.ConnectionError("refused"), "unreachable: refused"),
        (redis.ResponseError("BUSY Redis is busy running a script"), "busy running a script"),
    ],
)
def test_submit_gives_up_after_redis_pys_own_retries(error: Exception, shown: str) -> None:
    """No persist: one outage (a BUSY reply counts as one) is BrokerUnavailable at once."""
    call = calls.submit(fresh_core(), "a", None, {})
    calls.resume(call)
    with pytest.raises(BrokerUnavailable, match=shown):
        fail(call, error)


def test_results_wait_on_own_keys_until_the_deadline() -> None:
    core = fresh_core()
    request_id = core.new_id()
    call = calls.results(core, [request_id], 0.05, False)
    step = calls.resume(call)
    assert isinstance(step, calls.Send) and step.command == "blpop"
    assert step.args == ([core.reply_key(request_id)],)
    time.sleep(0.06)
    with pytest.raises(ReplyTimeout):
        answer(call, None)


def test_results_decode_what_blpop_popped() -> None:
    core = fresh_core()
    request_id = core.new_id()
    call = calls.results(core, [request_id], 5.0, False)
    calls.resume(call)
    raw = wire.encode_reply(wire.scores_reply(request_id, [0.5]))
    done = answer(call, (core.reply_key(request_id).encode(), raw))
    assert isinstance(done, calls.Done)
    (result,) = done.value
    assert isinstance(result, Result) and result.scores == (0.5,)


def test_async_infer_listens_before_it_enqueues() -> None:
    core = fresh_core()
    call = calls.infer_many(core, ["a", "b"], 5.0, True, {}, "client-key")
    listen = calls.resume(call)
    assert isinstance(listen, calls.Listen) and len(listen.ids) == 2
    assert isinstance(answer(call), calls.Send)
    collect = answer(call, [b"1-0", b"1-1"])
    assert isinstance(collect, calls.Collect) and collect.ids == listen.ids
    done = answer(call, ({}, None))
    assert isinstance(done, calls.Done)
    assert all(isinstance(item, ReplyTimeout) for item in done.value)


def test_an_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'reply_to'"):
        calls.resume(calls.infer(fresh_core(), "a", None, None, {"reply_to": "k"}, None))


@pytest.mark.parametrize("module", ["core.py", "calls.py", "options.py", "config.py"])
def test_the_sans_io_modules_import_no_redis_and_no_asyncio(module: str) -> None:
    path = Path(__file__).resolve().parent.parent / "producer" / module
    imported = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"redis", "asyncio", "socket"}
