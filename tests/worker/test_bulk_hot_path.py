"""The per-request paths made cheaper in bulk keep their behaviour.

* publish.lua asks which answers are still its own with one XPENDING over
  the call's id range, and acks and deletes a call's answered entries with
  one XACK and one XDEL at the end, instead of three commands per answer: whatever mix of
  answers a call carries (an entry named twice, entries already settled,
  entries another consumer owns), each entry still pending to this consumer
  is answered exactly once and the rest are left alone;
* a call's per-answer arguments are written as RESP in bulk
  (:class:`~tokenq.shared.packing.PackedArgs`): the worker's own client sends
  them as they are, any other client spelled out, and both are the ARGV
  layout publish.lua reads;
* the embedding reply is packed without a ``wire.Reply`` in between: the same
  bytes as ``encode_reply(embedding_reply(...))``;
* an integer field is checked without the regex when it is plain digits: the
  same fields are taken and refused as before.

Behaviour only, never timings (docs/BENCHMARKS.md, "cpu", has the figures).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import uuid

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tokenq.shared import keys, wire
from tokenq.shared.errors import DecodeError
from tokenq.shared.packing import PackedArgs, takes_packed
from tokenq.worker.loop.publish import Publisher, Target, spelled_out
from tokenq.worker.pipeline.jobs import Answer
from tokenq.worker.redis_connect import connect
from tokenq.worker.settings import WorkerSettings

_PER_CALL = 12
_EXAMPLES = itertools.count()
"""A fresh queue per hypothesis example (the fixtures are made once per test)."""


def _client(redis_url: str, workers_own: bool) -> aioredis.Redis:
    """The worker's own client (it takes packed arguments) or a plain redis-py one."""
    if not workers_own:
        return aioredis.Redis.from_url(redis_url)
    client = connect(WorkerSettings(redis_url=redis_url, queue="q", backend="sim"))
    assert takes_packed(client)
    return client  # type: ignore[return-value]


def _publisher(client: aioredis.Redis, q: keys.QueueRef) -> Publisher:
    return Publisher(
        client, Target(keys.requests(q), keys.dead(q), keys.GROUP, "c1"),
        reply_ttl_ms=60_000, dead_max_len=1000, dead_max_letter_bytes=4096,
    )


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    picks=st.lists(st.integers(0, _PER_CALL - 1), min_size=1, max_size=3 * _PER_CALL),
    settled=st.sets(st.integers(0, _PER_CALL - 1), max_size=4),
    theirs=st.sets(st.integers(0, _PER_CALL - 1), max_size=4),
    dead=st.sets(st.integers(0, _PER_CALL - 1), max_size=4),
    filler=st.lists(st.integers(0, 12), min_size=_PER_CALL, max_size=_PER_CALL),
    huge_ids=st.booleans(),
    workers_own=st.booleans(),
    shared_keys=st.integers(0, 3),
    refused=st.sets(st.integers(0, _PER_CALL - 1), max_size=3),
)
def test_one_call_answers_each_entry_still_ours_exactly_once(
    redis_url: str, r: redis.Redis, queue_name: str,
    picks: list[int], settled: set[int], theirs: set[int], dead: set[int],
    filler: list[int], huge_ids: bool, workers_own: bool, shared_keys: int, refused: set[int],
) -> None:
    """Answers named in any order, repeated, already settled or owned by another consumer:
    a reply (and a letter) per entry still pending to c1, nothing for the others, and every
    entry c1 answered is acked and deleted while the others stay pending where they were.

    With ``shared_keys`` the answers share that many reply keys (pushed one RPUSH a
    key): each key holds its replies in the call's order. ``refused`` answers name a key
    of another type: they are acked and dead-lettered, and cost no one else a reply.

    c1 also holds ``filler`` entries it does not answer between the answered ones
    (up to 144: past the one range XPENDING's count, so the per-entry check is
    taken too), and with ``huge_ids`` the ids' parts are past 2^53, where a
    Lua number could no longer order them. ``workers_own``: the call goes through the
    worker's client (its per-answer arguments packed) or a plain one (spelled out)."""
    q = keys.QueueRef(f"{queue_name}{next(_EXAMPLES)}")
    stream = keys.requests(q)
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    counter = itertools.count()

    def add(fields: dict[str, str]) -> bytes:
        at = next(counter)  # three entries per millisecond: both parts ordered by digits alone
        return r.xadd(stream, fields, id=f"{2**60 + at // 3}-{2**62 + at}" if huge_ids else "*")

    ids, fillers = [], []
    for i in range(_PER_CALL):
        ids.append(add({"id": f"r{i}", "text": "hello"}))
        fillers += [add({"id": f"f{i}.{j}", "text": "unanswered"}) for j in range(filler[i])]
    r.xreadgroup(keys.GROUP, "c1", {stream: ">"})
    theirs -= settled
    for i in theirs:
        r.xclaim(stream, keys.GROUP, "c2", 0, [ids[i]])
    for i in settled:
        r.xack(stream, keys.GROUP, ids[i])
    wrong = keys.reply(q, "wrong-type")
    r.set(wrong, "a string: RPUSH refuses it")

    def reply_key(i: int) -> str:
        if i in refused:
            return wrong
        return keys.reply(q, f"k{i % shared_keys}" if shared_keys else f"r{i}")

    answers = [
        Answer(ids[i], reply_key(i), f"reply {i}".encode(), ok=i not in dead,
               dead_fields=(("id", f"r{i}"), ("dead_error_code", "dead_letter"))
               if i in dead else ())
        for i in picks
    ]

    async def scenario() -> int:
        client = _client(redis_url, workers_own)
        try:
            return await _publisher(client, q).publish_once(answers)
        finally:
            await client.aclose()

    ours = set(picks) - settled - theirs
    assert asyncio.run(scenario()) == len(ours)
    expected: dict[str, list[bytes]] = {reply_key(i): [] for i in range(_PER_CALL)}
    for i in dict.fromkeys(picks):  # each entry's first mention, in the call's order
        if i in ours and i not in refused:
            expected[reply_key(i)].append(f"reply {i}".encode())
    expected.pop(wrong, None)
    assert {key: r.lrange(key, 0, -1) for key in expected} == expected
    assert all(0 < r.pttl(key) <= 60_000 for key, replies in expected.items() if replies)
    assert r.get(wrong) == b"a string: RPUSH refuses it"
    assert r.xlen(keys.dead(q)) == len(ours & (dead | refused))
    pending = {entry["message_id"]: entry["consumer"]
               for entry in r.xpending_range(stream, keys.GROUP, "-", "+", 1000)}
    assert pending == {
        **{ids[i]: b"c1" for i in range(_PER_CALL) if i not in ours | settled | theirs},
        **{ids[i]: b"c2" for i in theirs},
        **{entry_id: b"c1" for entry_id in fillers},
    }
    left = {entry_id for entry_id, _ in r.xrange(stream)}
    assert left == {ids[i] for i in range(_PER_CALL) if i not in ours} | set(fillers)
    r.delete(stream, keys.dead(q), wrong, *expected)


@pytest.mark.parametrize("workers_own", [True, False])
@pytest.mark.parametrize("n", [1, 999, 1000, 1001, 2001, 2002, 4500])
def test_a_call_larger_than_one_ack_slice_settles_every_entry(
    redis_url: str, r: redis.Redis, queue_name: str, n: int, workers_own: bool,
) -> None:
    """XACK, XDEL and each key's RPUSH go in slices of 1,000 (Lua's stack): every
    slice is settled, and each of the two keys the answers alternate on holds its
    replies in the call's order."""
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(stream, {"id": f"r{i}", "text": "hello"})
    ids = pipe.execute()
    r.xreadgroup(keys.GROUP, "c1", {stream: ">"})
    reply_keys = [keys.reply(q, "even"), keys.reply(q, "odd")]
    answers = [Answer(entry_id, reply_keys[i % 2], b"%d" % i, ok=True)
               for i, entry_id in enumerate(ids)]

    async def scenario() -> int:
        client = _client(redis_url, workers_own)
        try:
            return await _publisher(client, q).publish_once(answers)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == n
    for parity, key in enumerate(reply_keys):
        assert r.lrange(key, 0, -1) == [b"%d" % i for i in range(parity, n, 2)]
    assert r.xlen(stream) == 0
    assert r.xpending(stream, keys.GROUP)["pending"] == 0


def _layout(answers: list[Answer], refused: dict[bytes, str]) -> tuple[list[str], list[object]]:
    """publish.lua's KEYS and ARGV as its header comment lays them out, written plainly."""
    names: list[str] = ["stream", "dead"]
    argv: list[object] = ["group", "c1", 60_000, 1000, 4096, len(answers)]
    for answer in answers:
        if answer.entry_id in refused:
            slot, payload = b"-1", refused[answer.entry_id].encode()
        elif answer.reply_to is None:
            slot, payload = b"0", answer.payload
        else:
            if answer.reply_to not in names[2:]:
                names.append(answer.reply_to)
            slot, payload = str(names.index(answer.reply_to) + 1).encode(), answer.payload
        argv += [answer.entry_id, slot, payload, str(answer.counted).encode(),
                 str(len(answer.dead_fields)).encode()]
        argv += [value.encode() if isinstance(value, str) else value
                 for pair in answer.dead_fields for value in pair]
    return names, argv


_texts = st.one_of(st.binary(max_size=40), st.text(max_size=20))


@pytest.mark.unit
@settings(max_examples=200)
@given(st.lists(st.tuples(
    st.binary(min_size=1, max_size=24), st.one_of(st.none(), st.sampled_from(["k1", "k2", "é"])),
    st.binary(max_size=300), st.lists(st.tuples(_texts, _texts), max_size=3), st.booleans(),
    st.integers(0, wire.MAX_TOKENS),
), max_size=20))
def test_a_calls_packed_arguments_are_the_layout_the_script_reads(rows: list) -> None:
    """Whatever the answers (no reply key, repeated ones, refused, dead-letter fields of
    bytes or text, empty payloads, payloads that contain CRLF, any counted tokens), the packed
    ARGV spelled out is exactly the plain layout, and the tail counts its arguments."""
    answers = [Answer(entry_id, reply_to, payload, ok=not dead, dead_fields=tuple(dead),
                      counted=counted)
               for entry_id, reply_to, payload, dead, _, counted in rows]
    refused = {row[0]: f"refused {i} ✓" for i, row in enumerate(rows) if row[4]}
    publisher = Publisher(aioredis.Redis(), Target("stream", "dead", "group", "c1"),
                          reply_ttl_ms=60_000, dead_max_len=1000,
                          dead_max_letter_bytes=4096)
    names, args = publisher.arguments(answers, refused)
    assert isinstance(args[-1], PackedArgs)
    expected_names, expected = _layout(answers, refused)
    assert names == expected_names
    assert [a if isinstance(a, bytes) else str(a).encode() for a in spelled_out(args)] == [
        a if isinstance(a, bytes) else str(a).encode() for a in expected]


@pytest.mark.unit
@given(
    request_id=st.text(min_size=1, max_size=40),
    vector=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64),
    tokens=st.one_of(st.none(), st.integers(0, 1 << 20)),
)
def test_the_embedding_reply_packed_directly_is_the_same_bytes(
    request_id: str, vector: list[float], tokens: int | None,
) -> None:
    embedding = np.asarray(vector, dtype="<f4").tobytes()
    direct = wire.encode_embedding_reply(request_id, embedding, len(vector), tokens=tokens)
    via_reply = wire.encode_reply(
        wire.embedding_reply(request_id, embedding, len(vector), tokens=tokens))
    assert direct == via_reply
    assert wire.decode_reply(direct).embedding == embedding


@pytest.mark.unit
@settings(max_examples=60)
@given(
    request_ids=st.lists(st.text(min_size=1, max_size=130), min_size=1, max_size=5),
    dim=st.sampled_from([1, 8, 63, 64, 384, 16_383, 16_384]),
    tokens=st.lists(st.sampled_from([0, 1, 127, 128, 255, 256, 65_535, 65_536, 1 << 24]),
                    min_size=5, max_size=5),
    data=st.data(),
)
def test_a_batch_of_embedding_replies_is_the_same_bytes_as_one_at_a_time(
    request_ids: list[str], dim: int, tokens: list[int], data: st.DataObject,
) -> None:
    """``encode_embedding_replies`` packs the shared parts once; each reply is still the bytes
    ``encode_embedding_reply`` gives, whatever the id, the width (msgpack's three bin headers)
    and the count (its five integer forms)."""
    rows = [data.draw(st.binary(min_size=4 * dim, max_size=4 * dim)) if dim < 100
            else bytes(range(256)) * (dim // 64) + bytes(4 * dim % 256) for _ in request_ids]
    counts = tokens[:len(request_ids)]
    together = wire.encode_embedding_replies(request_ids, b"".join(rows), dim, counts)
    assert together == [wire.encode_embedding_reply(request_id, row, dim, tokens=count)
                        for request_id, row, count in zip(request_ids, rows, counts, strict=True)]


_RESULT_KINDS = st.sampled_from(
    ["vector", "vector", "narrow", "float64", "tokens", "failure", "empty"])


@pytest.mark.unit
@settings(max_examples=80)
@given(kinds=st.lists(_RESULT_KINDS, min_size=1, max_size=12), seed=st.integers(0, 99))
def test_a_batchs_replies_are_the_bytes_each_would_get_alone(kinds: list[str], seed: int) -> None:
    """``Pipeline.encoded_replies`` (a batch's rows packed together when they are vectors
    of one width) gives every outcome exactly ``encoded_reply``'s bytes and verdict, whatever
    the mix: other widths, float64 rows, token embeddings, failures, empty rows."""
    from tokenq.worker.backends.sim import SimBackend
    from tokenq.worker.pipeline.execute import Failure
    from tokenq.worker.pipeline.pipeline import Outcome, Pipeline

    rng = np.random.default_rng(seed)
    pipeline: Pipeline[int] = Pipeline(SimBackend(dim=8, batch_ms=0.0, token_us=0.0))
    made = {
        "vector": lambda: rng.standard_normal(8).astype(np.float32),
        "narrow": lambda: rng.standard_normal(3).astype(np.float32),
        "float64": lambda: rng.standard_normal(8),
        "tokens": lambda: rng.standard_normal((2, 8)).astype(np.float32),
        "failure": lambda: Failure("inference_failed", "it broke", None),
        "empty": lambda: np.zeros(0, dtype=np.float32),
    }
    outcomes = [
        Outcome(index, wire.Request(f"id-{index}", "t", 1, "r"), made[kind](), index * 7)
        for index, kind in enumerate(kinds)
    ]
    assert pipeline.encoded_replies(outcomes) == [pipeline.encoded_reply(o) for o in outcomes]


@pytest.mark.unit
def test_a_batch_of_embedding_replies_checks_its_sizes() -> None:
    with pytest.raises(ValueError, match="need 16 bytes"):
        wire.encode_embedding_replies(["a", "b"], b"\0" * 15, 2, [1, 1])
    with pytest.raises(ValueError, match="token counts"):
        wire.encode_embedding_replies(["a", "b"], b"\0" * 16, 2, [1])


@pytest.mark.unit
def test_the_embedding_reply_packed_directly_still_checks_its_length() -> None:
    with pytest.raises(ValueError, match="expected 4"):
        wire.encode_embedding_reply("a", b"\0" * 7, 2)


_DIGITS = re.compile(rb"[0-9]{1,19}")


@pytest.mark.unit
@given(raw=st.one_of(
    st.binary(max_size=24),
    st.text(alphabet="0123456789٣۴ -+_", max_size=24).map(lambda t: t.encode()),
    st.integers(0, 10**22).map(lambda n: str(n).encode()),
))
def test_an_integer_field_is_taken_exactly_when_it_was_before(raw: bytes) -> None:
    """The plain-digits shortcut takes what the regex took, refuses what it refused."""
    expected = int(raw) if _DIGITS.fullmatch(raw) and int(raw) <= 10**18 else None
    try:
        got = wire._int_field(raw, "n", minimum=0, maximum=10**18)
    except DecodeError:
        got = None
    assert got == expected


_ID_REFUSED = re.compile(r"[\s\x00-\x1f]")
_TEXTS = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="ab-_:{}. \t\x7f\x85\u2028\u00a0\x1c", max_size=12),
    st.from_regex(r"tokenq:\{[a-z]{1,3}\}:reply:?[a-z]{0,3}", fullmatch=True),
)


@pytest.mark.unit
@example(value="a b")
@example(value="a\x7fb")
@example(value="a\u2028")
@given(value=_TEXTS)
def test_a_request_id_is_refused_exactly_when_the_regex_refuses_it(value: str) -> None:
    """The printable-ASCII shortcut of ``validate_id`` accepts only what the regex does."""
    expected = bool(value) and len(value) <= wire.MAX_ID_CHARS \
        and _ID_REFUSED.search(value) is None
    try:
        wire.validate_id(value)
        got = True
    except DecodeError:
        got = False
    assert got == expected


@pytest.mark.unit
@given(key=_TEXTS, extra=st.sampled_from([(), ("app:",), ("", "tokenq:{q}:")]),
       name=st.sampled_from(["q", "qq", "a.b"]))
def test_the_reply_to_check_answers_as_the_full_rule_does(
    key: str, extra: tuple[str, ...], name: str
) -> None:
    """``keys.reply_to_check``'s prefix shortcut gives every key the rule's own answer."""
    q = keys.QueueRef(name)
    for candidate in (key, keys.reply_prefix(q) + key, keys.reply_prefix(q)[:-1] + key):
        assert keys.reply_to_check(q, extra)(candidate) == \
            keys.reply_to_refusal(q, candidate, extra), candidate


@pytest.mark.unit
@given(raw=st.one_of(
    st.binary(max_size=12),
    st.integers(0, 10**12).map(lambda n: str(n).encode()),
    st.sampled_from([b"16777216", b"16777217", b"0", b"000000016777216", b"\xd9\xa3"]),
))
def test_a_token_count_is_read_as_the_integer_rule_reads_it(raw: bytes) -> None:
    """The inline token count takes and refuses exactly what ``_int_field`` does."""
    fields = {b"v": b"1", b"id": b"r", b"text": b"t", b"reply_to": b"x:{q}:reply:r",
              b"tokens": raw}
    try:
        expected: object = wire._int_field(raw, "tokens", minimum=0, maximum=wire.MAX_TOKENS)
    except DecodeError as exc:
        expected = str(exc)
    try:
        got: object = wire.decode_fields(fields).tokens
    except DecodeError as exc:
        got = str(exc)
    assert got == expected


@pytest.mark.unit
@given(raw=st.binary(min_size=16, max_size=16))
def test_a_request_id_is_uuid4_hex_digit_for_digit(raw: bytes) -> None:
    """The producer's ids without UUID objects are what ``uuid.UUID(bytes, version=4)``
    gives, for every 16 bytes of a block the OS handed over."""
    from unittest import mock

    from tokenq.producer import lanes

    block = raw + bytes(reversed(raw)) + raw[8:] + raw[:8]
    with mock.patch.object(lanes.os, "urandom", return_value=block):
        assert lanes._draw(3) == [uuid.UUID(bytes=block[at:at + 16], version=4).hex
                                  for at in (0, 16, 32)]


@pytest.mark.unit
@given(rows=st.lists(
    st.one_of(
        st.lists(st.floats(width=32), min_size=3, max_size=3).map(
            lambda v: np.asarray(v, dtype=np.float32)),
        st.lists(st.floats(width=32), min_size=1, max_size=4).map(
            lambda v: np.asarray(v, dtype=np.float32)),
        st.lists(st.floats(width=32), min_size=3, max_size=3).map(
            lambda v: np.asarray(v, dtype=">f4")),
        st.just([1.0, 2.0, 3.0]),
        st.just(np.zeros((2, 3), dtype=np.float32)),
        st.just("not numbers"),
    ),
    max_size=8,
))
def test_a_run_checked_in_bulk_answers_each_row_as_it_would_alone(rows: list[object]) -> None:
    """Rows a backend returns: the same vectors and the same Failures as row by row."""
    from tokenq.worker.pipeline.execute import _checked, _checked_rows

    def same(a: object, b: object) -> bool:
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
        return a == b

    bulk, alone = _checked_rows(rows), [_checked(row) for row in rows]
    assert len(bulk) == len(alone)
    assert all(same(a, b) for a, b in zip(bulk, alone, strict=True))


def test_the_producers_connections_pack_in_c_and_still_enqueue(
    redis_url: str, r: redis.Redis, queue_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both producers' commands are packed by hiredis (byte for byte redis-py's:
    tests/worker/test_worker_connection.py), and what they enqueue reads back as sent.

    Counted at the packer, not read off the class: redis-py's sync
    ``send_command`` bypasses ``pack_command``, so a mixin in the class's MRO
    once packed nothing the enqueue sent.
    """
    from tokenq.producer import AsyncClient, Client
    from tokenq.shared import packing

    packed: list[bytes] = []

    def counting(args: tuple) -> bytes:
        packed.append(args[0] if isinstance(args[0], bytes) else str(args[0]).encode())
        return real(args)

    real = packing._hiredis_pack
    assert real is not None, "hiredis is in the worker and dev extras"
    monkeypatch.setattr(packing, "_hiredis_pack", counting)
    reply_to = keys.reply(keys.QueueRef(queue_name), "mine")
    with Client(redis_url=redis_url, queue=queue_name, max_queue_length=0) as client:
        ids = client.submit_many(["héllo wörld", "a b c"], reply_to=reply_to)
    assert b"FCALL" in [name.upper() for name in packed], packed
    packed.clear()

    async def async_side() -> str:
        async with AsyncClient(redis_url=redis_url, queue=queue_name,
                               max_queue_length=0) as aclient:
            return await aclient.submit("async", reply_to=reply_to)

    ids.append(asyncio.run(async_side()))
    assert b"FCALL" in [name.upper() for name in packed], packed
    entries = r.xrange(keys.requests(keys.QueueRef(queue_name)))
    decoded = [wire.decode_request(fields) for _, fields in entries]
    texts = ["héllo wörld", "a b c", "async"]
    assert [(d.id, d.text) for d in decoded] == list(zip(ids, texts, strict=True))
