"""The producer's I/O-free core, driven directly: no Redis, no clock."""

from __future__ import annotations

import struct
import time
from typing import Any

import pytest
import redis

from tokenq.producer import (
    BadRequest,
    DeadlineExceeded,
    RemoteError,
    ReplyTimeout,
    Result,
    calls,
)
from tokenq.producer.core import ClientCore, make_settings
from tokenq.producer.deadline import BLOCK_FLOOR_S, Deadline, block_s
from tokenq.producer.prepare import Prepared
from tokenq.producer.redis_deadlines import failure
from tokenq.producer.replies import decode, outcome, settle
from tokenq.shared import keys, wire
from tokenq.shared.errors import QueueFull
from tokenq.shared.settings import ClientSettings

pytestmark = pytest.mark.unit

NOW_MS = 1_700_000_000_000


@pytest.fixture
def core() -> ClientCore:
    return ClientCore(ClientSettings(queue="q", max_queue_length=10, socket_timeout_s=4))


def prepare(core: ClientCore, text: str, **options: Any) -> Prepared:
    """One request prepared for the plain queue, as an unsharded call prepares it."""
    return core.preparer.prepare(core.lanes.home, text, **options)


def prepare_many(core: ClientCore, texts: list[Any], **options: Any) -> list[Prepared]:
    return core.preparer.prepare_many(core.lanes.home, texts, **options)


def test_prepare_builds_wire_fields(core: ClientCore) -> None:
    prepared = prepare(core, "hello", now_ms=NOW_MS, deadline_s=1.5, opts={"a": 1})
    request = wire.decode_request(prepared.fields)
    assert request.id == prepared.id and len(prepared.id) == 32
    assert request.reply_to == prepared.reply_to == keys.reply(keys.QueueRef("q"), prepared.id)
    assert request.timeout_ms == 1500 and request.deadline_ms is None
    assert "deadline_ms" not in prepared.fields
    assert request.opts == {"a": 1}
    assert request.tokens == 3


@pytest.mark.parametrize("options", [{}, {"priority": 3, "opts": {"a": 1}}, {"deadline_s": 2}])
def test_prepared_fields_are_encode_requests_in_its_order(core: ClientCore, options: Any) -> None:
    for prepared in prepare_many(core, ["a b", ("q", "pair")], now_ms=NOW_MS, **options):
        request = wire.decode_request(prepared.fields)
        assert list(wire.encode_request(request).items()) == list(prepared.fields.items())


def test_deadlines_become_relative_timeout_ms(core: ClientCore) -> None:
    """timeout_ms counts on Redis's clock; only an absolute deadline uses the caller's."""

    def timeout_ms(**deadline: object) -> int | None:
        fields = prepare(core, "x", now_ms=NOW_MS, **deadline).fields  # type: ignore[arg-type]
        return wire.decode_request(fields).timeout_ms

    assert timeout_ms(deadline_s=0.0001) == 1  # rounded up, never 0
    assert timeout_ms(deadline_s=2.0005) == 2001
    assert timeout_ms(deadline_ms=NOW_MS + 1) == 1
    assert timeout_ms(deadline_ms=NOW_MS + 90_000) == 90_000
    assert timeout_ms(deadline_s=wire.MAX_TIMEOUT_MS / 1000) == wire.MAX_TIMEOUT_MS
    assert timeout_ms(deadline_ms=NOW_MS + wire.MAX_TIMEOUT_MS) == wire.MAX_TIMEOUT_MS
    assert timeout_ms() is None
    with pytest.raises(BadRequest, match="already passed"):
        timeout_ms(deadline_ms=NOW_MS)
    with pytest.raises(BadRequest, match="out of range"):
        timeout_ms(deadline_ms=NOW_MS + wire.MAX_TIMEOUT_MS + 1)
    with pytest.raises(BadRequest, match="out of range"):
        timeout_ms(deadline_s=wire.MAX_TIMEOUT_MS / 1000 + 1)

    # infer's own deadline: what is left of its timeout, capped at the protocol's largest.
    def infer_deadline(remaining_s: float, **given: Any) -> Any:
        request = calls._infer_request(Deadline.after(remaining_s), given)  # type: ignore[arg-type]
        return request.get("deadline_s"), request.get("deadline_ms")

    assert infer_deadline(2.5) == (pytest.approx(2.5, abs=0.5), None)
    assert infer_deadline(-1.0) == (0.001, None)
    assert infer_deadline(1e12) == (wire.MAX_TIMEOUT_MS / 1000, None)
    assert infer_deadline(2.5, deadline_s=9.0) == (9.0, None)
    assert infer_deadline(2.5, deadline_ms=NOW_MS) == (None, NOW_MS)


def test_token_estimates_past_the_protocol_limit_are_refused() -> None:
    core = ClientCore(ClientSettings(), lambda text: wire.MAX_TOKENS + 1)
    with pytest.raises(BadRequest, match="over the protocol's limit"):
        prepare(core, "a", now_ms=NOW_MS)
    at_limit = ClientCore(ClientSettings(), lambda text: wire.MAX_TOKENS)
    assert prepare(at_limit, "a", now_ms=NOW_MS).fields["tokens"] == str(wire.MAX_TOKENS)


def test_ids_are_unique(core: ClientCore) -> None:
    batch = prepare_many(core, ["a"] * 100, now_ms=NOW_MS)
    assert len({p.id for p in batch}) == 100


def test_script_args_layout(core: ClientCore) -> None:
    batch = prepare_many(core, ["a", ("b", "c")], now_ms=NOW_MS, reply_to="k")
    lane = core.lanes.home
    arguments = calls.enqueue_arguments(core, lane, batch)
    args = arguments["args"]
    # max_len, n, dedupe TTL (ms) of one seen key for this call of fresh ids
    assert args[:3] == [10, 2, "call:60000"]
    assert arguments["keys"] == [lane.stream_key, keys.seen_call(lane.queue, [p.id for p in batch])]
    named = prepare_many(core, ["a", "b"], now_ms=NOW_MS, unique=["1" * 32, "2" * 32])
    arguments = calls.enqueue_arguments(core, lane, named)
    assert arguments["args"][:3] == [10, 2, 60_000]  # the caller's ids: a key each
    assert arguments["keys"] == [lane.stream_key, *(keys.seen(lane.queue, p.id) for p in named)]
    first = args[3]
    assert first == len(batch[0].fields)
    second_at = 4 + 2 * first
    assert args[second_at] == len(batch[1].fields)
    assert len(args) == second_at + 1 + 2 * args[second_at]
    assert "text_pair" in args[second_at + 1 :]


@pytest.mark.parametrize(
    ("refusal", "shown"),
    [
        ("QUEUEFULL 9 10 2", "2 more"),  # 2 of the 3 were new to the script
        ("QUEUEFULL 9 10", "3 more"),  # an older script's answer
    ],
)
def test_queue_full_message(core: ClientCore, refusal: str, shown: str) -> None:
    core.config.take({}, time.monotonic())
    call = calls.submit_many(core, ["a", "b", "c"])
    calls.resume(call)
    with pytest.raises(QueueFull, match="holds 9 of at most 10") as full:
        calls.resume(call, failure(redis.ResponseError(refusal)))
    assert shown in str(full.value)


def test_block_stays_under_the_socket_timeout() -> None:
    assert block_s(100, 4) == 2.0
    assert block_s(0.5, 4) == 0.5
    assert block_s(0, 4) == BLOCK_FLOOR_S  # never BLPOP 0, which blocks forever


def test_outcome_of_an_embedding() -> None:
    reply = wire.decode_reply(
        wire.encode_reply(wire.embedding_reply("r", struct.pack("<2f", 0.5, -1.0), 2, tokens=7))
    )
    result = outcome(reply)
    assert isinstance(result, Result)
    assert list(result.embedding) == [0.5, -1.0] and result.dim == 2 and result.tokens == 7


def test_outcome_of_errors() -> None:
    late = outcome(wire.error_reply("r", "deadline_exceeded", "too late"))
    assert isinstance(late, DeadlineExceeded) and late.request_id == "r"
    failed = outcome(wire.error_reply("r", "out_of_memory", "too big"))
    assert type(failed) is RemoteError and failed.code == "out_of_memory"


def test_decode_drops_garbage() -> None:
    assert decode(b"\x00garbage") is None


def test_settle_orders_and_raises_first_error() -> None:
    ok = Result(id="a", embedding=None, dim=None, scores=(1.0,), tokens=None)
    boom = RemoteError("too_long", "x", "b")
    late = ReplyTimeout(["c"], 1.0)
    outcomes = {"a": ok, "b": boom, "c": late}
    assert settle(["c", "a"], outcomes, True) == [late, ok]
    with pytest.raises(ReplyTimeout):
        settle(["a", "c", "b"], outcomes, False)


def test_reply_timeout_names_ids_and_seconds() -> None:
    error = ReplyTimeout([f"id{i}" for i in range(8)], 2.5)
    assert "2.50s" in str(error) and "id0" in str(error) and "3 more" in str(error)
    assert isinstance(error, TimeoutError) and len(error.request_ids) == 8


def test_estimator_exceptions_are_not_swallowed() -> None:
    def broken(text: str) -> int:
        raise RuntimeError("estimator bug")

    core = ClientCore(ClientSettings(), broken)
    with pytest.raises(RuntimeError, match="estimator bug"):
        prepare(core, "a", now_ms=NOW_MS)


def test_builtin_estimator_is_accepted() -> None:
    core = ClientCore(ClientSettings(), len)
    prepared = prepare(core, "abcd", now_ms=NOW_MS, text_pair="ef")
    assert prepared.fields["tokens"] == "6"


def test_make_settings_overrides_only_what_is_given() -> None:
    base = ClientSettings(queue="base", timeout_s=3)
    merged = make_settings(base, queue="other", timeout_s=None)
    assert merged.queue == "other" and merged.timeout_s == 3
    with pytest.raises(BadRequest, match="queue"):
        make_settings(base, queue="no spaces allowed")


def test_priority_travels_and_bad_priorities_are_refused(core: ClientCore) -> None:
    prepared = prepare(core, "hello", now_ms=NOW_MS, priority=3)
    assert prepared.fields["priority"] == "3"
    assert wire.decode_request(prepared.fields).priority == 3
    default = prepare(core, "hello", now_ms=NOW_MS)
    assert "priority" not in default.fields  # 0 is the default: today's entries unchanged
    assert wire.decode_request(default.fields).priority == 0
    for bad in (-1, wire.MAX_PRIORITY + 1, True, 1.5, "2"):
        with pytest.raises(BadRequest, match="priority must be an integer from 0 to 9"):
            prepare(core, "hello", now_ms=NOW_MS, priority=bad)
