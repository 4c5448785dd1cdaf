"""``claim_excess.lua`` (``reader.claim_excess``) on a real Redis: which entries a
worker takes as written past the queue's length limit, and which it leaves.

The end-to-end path, under the documented ACL users, is
``tests/faults/test_acl.py::test_entries_written_around_enqueue_past_the_limit_are_refused_as_queue_full``.
"""

from __future__ import annotations

import asyncio
import functools

import pytest
import redis
import redis.asyncio as aioredis

from tokenq.shared import keys, wire
from tokenq.shared.errors import ErrorCode
from tokenq.worker.loop.reader import EXCESS_AT_MOST, claim_excess, excess_refusals
from tokenq.worker.pipeline.jobs import DeadLetterPolicy, dead_answer


def fill(r: redis.Redis, stream: str, n: int) -> list[bytes]:
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    return [r.xadd(stream, {"v": "1", "id": f"r{i}", "text": f"text {i}"}) for i in range(n)]


def claim(redis_url: str, stream: str, max_len: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
    async def run() -> list[tuple[bytes, dict[bytes, bytes]]]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await claim_excess(client, stream, "me", max_len)
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_the_newest_undelivered_entries_past_the_limit_are_taken_and_deleted(
    r: redis.Redis, redis_url: str, queue_name: str,
) -> None:
    stream = keys.requests(keys.QueueRef(queue_name))
    ids = fill(r, stream, 6)
    r.xreadgroup(keys.GROUP, "other", {stream: ">"}, count=1)  # the oldest is being run
    taken = claim(redis_url, stream, 3)
    assert [entry_id for entry_id, _ in taken] == ids[:2:-1]  # the newest three, newest first
    assert taken[0][1] == {b"v": b"1", b"id": b"r5", b"text": b"text 5"}
    assert r.xlen(stream) == 3 and [e[0] for e in r.xrange(stream)] == ids[:3]
    mine = r.xpending_range(stream, keys.GROUP, "-", "+", 10, consumername="me")
    assert sorted(p["message_id"] for p in mine) == sorted(ids[3:])
    assert claim(redis_url, stream, 3) == []  # within the limit now: nothing


def test_entries_already_delivered_are_left_to_their_worker(
    r: redis.Redis, redis_url: str, queue_name: str,
) -> None:
    stream = keys.requests(keys.QueueRef(queue_name))
    ids = fill(r, stream, 5)
    r.xreadgroup(keys.GROUP, "other", {stream: ">"}, count=4)
    taken = claim(redis_url, stream, 2)  # three past the limit, but only one unread
    assert [entry_id for entry_id, _ in taken] == [ids[4]]
    assert r.xpending(stream, keys.GROUP)["pending"] == 5
    assert claim(redis_url, stream, 2) == []


def test_at_most_a_page_is_taken_at_once(
    r: redis.Redis, redis_url: str, queue_name: str,
) -> None:
    stream = keys.requests(keys.QueueRef(queue_name))
    fill(r, stream, EXCESS_AT_MOST + 11)
    assert len(claim(redis_url, stream, 1)) == EXCESS_AT_MOST
    assert len(claim(redis_url, stream, 1)) == 10
    assert r.xlen(stream) == 1


@pytest.mark.unit
def test_a_refusal_is_a_queue_full_dead_letter_answered_on_the_callers_key(
    queue_name: str,
) -> None:
    q = keys.QueueRef(queue_name)
    policy = DeadLetterPolicy(
        worker="me", max_deliveries=5, default_reply_to=functools.partial(keys.reply, q),
        max_request_bytes=1 << 16, check_reply_to=keys.reply_to_check(q), max_letter_bytes=4096,
    )
    entries = [(b"1-0", {b"v": b"1", b"id": b"a", b"text": b"t",
                         b"reply_to": keys.reply(q, "shared").encode()}),
               (b"2-0", {b"v": b"1", b"id": b"b", b"text": b"t", b"reply_to": b"elsewhere"})]
    first, second = excess_refusals(entries, 3, policy=policy, now_epoch_ms=1)
    assert first.reply_to == keys.reply(q, "shared")
    assert second.reply_to == keys.reply(q, "b")  # never a key outside the namespace
    for answer in (first, second):
        assert answer.code == ErrorCode.QUEUE_FULL.value and not answer.ok
        letter = {_text(name): _text(value) for name, value in answer.dead_fields}
        assert letter["dead_error_code"] == ErrorCode.QUEUE_FULL.value
        assert letter["text"] == "t"  # the request as written, for `tokenq dlq`


def test_a_refusal_takes_off_no_counted_tokens_a_dead_letter_takes_off_its_own(
    queue_name: str,
) -> None:
    """docs/PROTOCOL.md, "Pending tokens": claim_excess took a taken entry's counted tokens
    off already, so its refusal's answer carries 0; any other dead letter carries what the
    entry's first field counts, for publish to take off."""
    q = keys.QueueRef(queue_name)
    policy = DeadLetterPolicy(
        worker="me", max_deliveries=5, default_reply_to=functools.partial(keys.reply, q),
        max_request_bytes=1 << 16, check_reply_to=keys.reply_to_check(q), max_letter_bytes=4096,
    )
    fields = {wire.COUNTED_FIELD.encode(): b"9", b"v": b"1", b"id": b"a", b"text": b"t",
              b"tokens": b"9"}
    [refusal] = excess_refusals([(b"1-0", fields)], 3, policy=policy, now_epoch_ms=1)
    assert refusal.counted == 0
    letter = dead_answer(b"1-0", fields, ErrorCode.BAD_REQUEST, "x", policy=policy,
                         deliveries=6, now_epoch_ms=1)
    assert letter.counted == 9
    forged_later = {b"v": b"1", b"id": b"a", wire.COUNTED_FIELD.encode(): b"9"}
    assert dead_answer(b"1-0", forged_later, ErrorCode.BAD_REQUEST, "x", policy=policy,
                       deliveries=6, now_epoch_ms=1).counted == 0


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode()
