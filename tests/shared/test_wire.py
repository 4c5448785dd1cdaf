"""The wire codec: round-trips, and garbage in means DecodeError out, never anything else.

A worker decodes whatever any producer in any language XADDed, so the one
promise that matters is that a malformed entry becomes a DecodeError (which the
worker turns into a ``bad_request`` reply) and never an exception that kills
the loop. docs/PROTOCOL.md is checked here too, so the document and the code
cannot drift apart silently.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.shared import keys, wire
from tokenq.shared.errors import DecodeError, ErrorCode
from tokenq.shared.wire import Reply, Request

pytestmark = pytest.mark.unit

PROPERTY = settings(max_examples=200, deadline=None)
PROTOCOL_MD = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"
FIELD_NAMES = [
    "v", "id", "text", "text_pair", "tokens", "reply_to", "deadline_ms", "timeout_ms", "opts"
]


def _valid_id(value: str) -> bool:
    return not any(ch.isspace() or ord(ch) < 32 for ch in value)


texts = st.text(min_size=1, max_size=300).filter(lambda t: bool(t.strip()))
ids = st.text(min_size=1, max_size=wire.MAX_ID_CHARS).filter(_valid_id)
reply_keys = st.text(min_size=1, max_size=wire.MAX_REPLY_TO_CHARS)
msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)
opts_maps = st.dictionaries(st.text(max_size=20), msgpack_values, max_size=8)


@st.composite
def requests(draw: st.DrawFn) -> Request:
    return Request(
        id=draw(ids),
        text=draw(texts),
        tokens=draw(st.integers(min_value=0, max_value=wire.MAX_TOKENS)),
        reply_to=draw(reply_keys),
        deadline_ms=draw(st.none() | st.integers(min_value=0, max_value=wire.MAX_EPOCH_MS)),
        timeout_ms=draw(st.none() | st.integers(min_value=1, max_value=wire.MAX_TIMEOUT_MS)),
        text_pair=draw(st.none() | texts),
        opts=draw(opts_maps),
    )


def as_redis_returns(fields: Mapping[str, str | bytes]) -> dict[bytes, bytes]:
    """What redis-py hands a worker from XREADGROUP: bytes keys and values."""
    return {
        key.encode(): value.encode() if isinstance(value, str) else value
        for key, value in fields.items()
    }


def decodes_or_refuses(fields: Mapping[Any, Any], **kwargs: Any) -> Request | None:
    """Decode, allowing only DecodeError; the best-effort helpers must never raise."""
    wire.request_id_of(fields)
    wire.reply_to_of(fields)
    try:
        return wire.decode_request(fields, **kwargs)
    except DecodeError:
        return None


def valid_fields(**overrides: bytes | None) -> dict[bytes, bytes]:
    """A well-formed entry with some fields replaced (or, with None, removed)."""
    fields = {
        b"v": b"1",
        b"id": b"req-1",
        b"text": b"what is a token budget?",
        b"tokens": b"7",
        b"reply_to": b"tokenq:{default}:reply:req-1",
    }
    for name, value in overrides.items():
        if value is None:
            fields.pop(name.encode(), None)
        else:
            fields[name.encode()] = value
    return fields


# ------------------------------------------------------------ request round-trip


@PROPERTY
@given(requests())
def test_request_round_trips(request: Request) -> None:
    fields = wire.encode_request(request)
    assert fields["v"] == str(wire.PROTOCOL_VERSION)
    assert set(fields) <= set(FIELD_NAMES)
    # Readable fields are str (XRANGE shows them); only opts is msgpack bytes.
    assert all(isinstance(v, str) for k, v in fields.items() if k != "opts")
    assert wire.decode_request(fields) == request
    assert wire.decode_request(as_redis_returns(fields)) == request


@PROPERTY
@given(ids, texts)
def test_missing_reply_to_uses_the_default_key(request_id: str, text: str) -> None:
    q = keys.QueueRef("default")
    fields = {b"v": b"1", b"id": request_id.encode(), b"text": text.encode()}
    decoded = wire.decode_request(fields, default_reply_to=functools.partial(keys.reply, q))
    assert decoded.reply_to == keys.reply(q, request_id) == f"tokenq:{{default}}:reply:{request_id}"
    assert (decoded.tokens, decoded.deadline_ms, decoded.text_pair, decoded.opts) == (
        0,
        None,
        None,
        {},
    )
    with pytest.raises(DecodeError, match="reply_to"):
        wire.decode_request(fields)


def test_optional_fields_may_be_empty_strings() -> None:
    """A producer that always sends every field may leave deadline_ms and opts empty."""
    decoded = wire.decode_request(valid_fields(deadline_ms=b"", opts=b""))
    assert decoded.deadline_ms is None and decoded.opts == {}


def test_encode_refuses_oversize_opts() -> None:
    request = Request(id="a", text="x", tokens=1, reply_to="r", opts={"blob": b"x" * 70_000})
    with pytest.raises(DecodeError, match="opts"):
        wire.encode_request(request)


# -------------------------------------------------------------- request garbage


@PROPERTY
@given(
    st.dictionaries(
        st.sampled_from([name.encode() for name in FIELD_NAMES]) | st.binary(max_size=12),
        st.binary(max_size=64),
        max_size=10,
    )
)
def test_random_entries_only_raise_decode_error(fields: dict[bytes, bytes]) -> None:
    decodes_or_refuses(fields)


@PROPERTY
@given(
    st.sampled_from(FIELD_NAMES),
    st.none() | st.binary(max_size=64) | st.text(max_size=64),
)
def test_one_corrupt_field_only_raises_decode_error(name: str, value: bytes | str | None) -> None:
    fields: dict[bytes | str, bytes | str] = dict(valid_fields())
    fields.pop(name.encode(), None)
    if value is not None:
        fields[name] = value
    decodes_or_refuses(fields)


@PROPERTY
@given(
    st.sets(st.sampled_from(["tokens", "reply_to"])),
    st.sets(st.sampled_from(["deadline_ms", "timeout_ms", "priority"]), min_size=1),
    st.sets(st.binary(min_size=1, max_size=8).filter(
        lambda name: name not in {known.encode() for known in (*FIELD_NAMES, "priority")}),
        max_size=2),
)
def test_an_optional_field_is_read_whatever_else_is_there(
    absent: set[str], given_fields: set[str], unknown: set[bytes],
) -> None:
    """The decoder skips the optional fields only when nothing but the named ones is
    there: whichever of the others are absent, and whatever unknown names ride along,
    each optional field given is read."""
    fields = valid_fields(**dict.fromkeys(absent), **dict.fromkeys(given_fields, b"7"))
    fields.update({name: b"x" for name in unknown})
    request = wire.decode_request(fields, default_reply_to=lambda rid: f"r:{rid}")
    for name in ("deadline_ms", "timeout_ms", "priority"):
        assert getattr(request, name) == (7 if name in given_fields else
                                          (0 if name == "priority" else None))
    assert wire.decode_fields(fields, default_reply_to=lambda rid: f"r:{rid}") == request


@given(st.sets(st.sampled_from(["tokens", "reply_to", "deadline_ms", "timeout_ms",
                                "priority"])), st.binary(max_size=12))
def test_the_scripts_counted_field_is_read_past(given_fields: set[str], counted: bytes) -> None:
    """docs/PROTOCOL.md: ``counted``, written first by tokenq's scripts (any value, as a plain
    XADD may forge it), changes nothing in the request, optional fields included."""
    fields = valid_fields(**{name: b"7" for name in given_fields},
                          **dict.fromkeys({"tokens", "reply_to"} - given_fields))
    marked = {wire.COUNTED_FIELD.encode(): counted, **fields}
    plain = wire.decode_fields(fields, default_reply_to=lambda rid: f"r:{rid}")
    assert plain.counted == 0
    plain.counted = wire.counted_of(marked)
    assert wire.decode_fields(marked, default_reply_to=lambda rid: f"r:{rid}") == plain
    assert wire.decode_request(marked, default_reply_to=lambda rid: f"r:{rid}") == plain


@pytest.mark.parametrize(("value", "counted"), [
    (b"7", 7), (b"007", 7), (b"0", 0), (b"16777216", 16777216), (b"16777217", 0),
    (b"000000007", 0), (b"", 0), (b"-5", 0), (b"+5", 0), (b" 5", 0), (b"5.0", 0),
    (b"1e3", 0), ("٣".encode(), 0), (b"99999999", 0),
])
def test_an_entry_s_counted_tokens_are_its_first_field_as_the_scripts_read_it(
    value: bytes, counted: int
) -> None:
    """docs/PROTOCOL.md: the worker reads ``counted`` as enqueue.lua's count_of does (1 to 8
    digits, at most 2^24; anything else counts 0, never an error), and only as the first
    field, where the scripts write it."""
    name = wire.COUNTED_FIELD.encode()
    fields = valid_fields(tokens=b"3")
    first = {name: value, **fields}
    assert wire.counted_of(first) == counted
    assert wire.decode_fields(first).counted == counted
    later = {**fields, name: value}
    assert wire.counted_of(later) == 0 and wire.decode_fields(later).counted == 0
    assert wire.counted_of({}) == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"v": None}, "'v'"),
        ({"v": b"2"}, "version"),
        ({"v": b"0"}, "version"),
        ({"v": b"one"}, "'v'"),
        ({"v": b"-1"}, "'v'"),
        ({"id": None}, "'id'"),
        ({"text": None}, "'text'"),
        ({"id": b""}, "id"),
        ({"id": b"a b"}, "id"),
        ({"id": b"x" * 129}, "id"),
        ({"id": b"\xff\xfe"}, "'id'.*UTF-8"),
        ({"text": b"\xc3\x28"}, "'text'.*UTF-8"),
        ({"text": b"  \n\t "}, "'text'.*empty"),
        ({"text_pair": b"\xed\xa0\x80"}, "'text_pair'.*UTF-8"),
        ({"text_pair": b" "}, "'text_pair'.*empty"),
        ({"tokens": b"many"}, "'tokens'"),
        ({"tokens": b"-3"}, "'tokens'"),
        ({"tokens": b"1.5"}, "'tokens'"),
        ({"tokens": "٣".encode()}, "'tokens'"),
        ({"deadline_ms": b"tomorrow"}, "'deadline_ms'"),
        ({"deadline_ms": b"-1"}, "'deadline_ms'"),
        ({"reply_to": b""}, "'reply_to'"),
        ({"reply_to": b"r" * 513}, "'reply_to'"),
        ({"reply_to": b"\x80"}, "'reply_to'.*UTF-8"),
        ({"opts": b"\xc1"}, "'opts'.*msgpack"),
        ({"opts": msgpack.packb([1, 2])}, "'opts'.*map"),
        ({"opts": msgpack.packb("text")}, "'opts'.*map"),
        ({"opts": msgpack.packb({1: 2})}, "'opts'"),
        ({"opts": msgpack.packb({"a": 1}) + b"\x00"}, "'opts'"),
        ({"opts": msgpack.packb({"a": b"x" * 70_000})}, "'opts'.*over"),
        ({"opts": b"\x91" * 60_000}, "'opts'.*msgpack"),
        ({"opts": msgpack.packb({"a": list(range(2000))})}, "'opts'"),
        ({"opts": msgpack.packb({"t": msgpack.ExtType(1, b"x")})}, "'opts'"),
    ],
)
def test_bad_fields_are_named_in_the_error(
    overrides: dict[str, bytes | None], message: str
) -> None:
    with pytest.raises(DecodeError, match=message):
        wire.decode_request(valid_fields(**overrides))


def test_oversize_text_is_refused_before_decoding() -> None:
    fields = valid_fields(text=b"a" * 600, text_pair=b"b" * 500)
    with pytest.raises(DecodeError, match="over the limit of 1000"):
        wire.decode_request(fields, max_request_bytes=1000)
    assert wire.decode_request(fields, max_request_bytes=1100).utf8_size() == 1100


def test_str_fields_with_lone_surrogates_are_decode_errors() -> None:
    """A caller passing str fields (decode_responses=True) must not see UnicodeEncodeError."""
    fields = {"v": "1", "id": "a", "text": "bad \ud800 text", "reply_to": "r"}
    with pytest.raises(DecodeError, match="'text'"):
        wire.decode_request(fields)


def test_best_effort_id_and_reply_to_of_broken_entries() -> None:
    broken = valid_fields(v=b"99")
    assert wire.request_id_of(broken) == "req-1"
    assert wire.reply_to_of(broken) == "tokenq:{default}:reply:req-1"
    assert wire.request_id_of({b"id": b"\xff"}) is None
    assert wire.request_id_of({b"id": b"has space"}) is None
    assert wire.reply_to_of({b"reply_to": b""}) is None
    assert wire.reply_to_of({}) is None


# ------------------------------------------------------------------ validate_*


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "empty"),
        ("  \t\n\u3000", "empty"),
        (None, "must be a string, got NoneType"),
        (b"bytes", "must be a string, got bytes"),
        (42, "must be a string, got int"),
        ("x" * 11, "11 bytes, over the limit of 10"),
        ("\u00e9" * 6, "12 bytes, over the limit of 10"),
        ("a\ud800b", "not valid Unicode"),
        ("\udfff", "not valid Unicode"),
    ],
)
def test_validate_text_refuses(value: object, message: str) -> None:
    with pytest.raises(DecodeError, match=message) as caught:
        wire.validate_text(value, "text", max_bytes=10)
    assert "text" in str(caught.value)


@PROPERTY
@given(texts)
def test_validate_text_accepts_real_text(text: str) -> None:
    assert wire.validate_text(text, "text", max_bytes=4 * len(text)) == text


# -------------------------------------------------------------- reply round-trip


@st.composite
def replies(draw: st.DrawFn) -> Reply:
    reply = draw(plain_replies())
    return dataclasses.replace(reply, truncated=True) if reply.ok and draw(st.booleans()) \
        else reply


@st.composite
def plain_replies(draw: st.DrawFn) -> Reply:
    request_id = draw(ids)
    tokens = draw(st.none() | st.integers(min_value=0, max_value=2**32))
    kind = draw(st.sampled_from(["embedding", "scores", "sparse", "tokens", "error"]))
    if kind == "embedding":
        floats = draw(st.lists(st.floats(width=32, allow_nan=False), max_size=64))
        packed = struct.pack(f"<{len(floats)}f", *floats)
        return wire.embedding_reply(request_id, packed, len(floats), tokens=tokens)
    if kind == "scores":
        scores = draw(st.lists(st.floats(allow_nan=False), max_size=16))
        labels = draw(st.none() | st.lists(st.text(max_size=8), min_size=len(scores),
                                            max_size=len(scores)))
        return wire.scores_reply(request_id, scores, tokens=tokens, labels=labels)
    if kind == "tokens":
        dim = draw(st.integers(min_value=1, max_value=16))
        floats = draw(st.lists(st.floats(width=32, allow_nan=False), min_size=dim,
                               max_size=8 * dim).filter(lambda v: len(v) % dim == 0))
        return wire.token_embeddings_reply(
            request_id, struct.pack(f"<{len(floats)}f", *floats), dim, tokens=tokens)
    if kind == "sparse":
        dim = draw(st.integers(min_value=1, max_value=2**32 - 1))
        indices = sorted(draw(st.sets(st.integers(0, min(dim, 2**20) - 1), max_size=32)))
        weights = draw(st.lists(st.floats(width=32, min_value=0, exclude_min=True),
                                min_size=len(indices), max_size=len(indices)))
        return wire.sparse_reply(request_id, struct.pack(f"<{len(indices)}I", *indices),
                                 struct.pack(f"<{len(weights)}f", *weights), dim, tokens=tokens)
    code = draw(st.sampled_from([code.value for code in ErrorCode]))
    return wire.error_reply(request_id, code, draw(st.text(max_size=200)))


@PROPERTY
@given(replies())
def test_reply_round_trips(reply: Reply) -> None:
    packed = wire.encode_reply(reply)
    assert isinstance(packed, bytes)
    decoded = wire.decode_reply(packed)
    assert decoded == reply
    if reply.token_embeddings is not None:
        assert reply.dim is not None
        flat = struct.unpack(f"<{len(reply.token_embeddings) // 4}f", reply.token_embeddings)
        assert [list(v) for v in decoded.token_vectors()] == [
            list(flat[i:i + reply.dim]) for i in range(0, len(flat), reply.dim)]
    if reply.sparse_indices is not None:
        count = len(reply.sparse_indices) // 4
        assert decoded.sparse_pairs() == list(zip(
            struct.unpack(f"<{count}I", reply.sparse_indices),
            struct.unpack(f"<{count}f", reply.sparse_values or b""), strict=True))


def test_a_token_embeddings_reply_is_whole_vectors_within_its_bound() -> None:
    """docs/PROTOCOL.md's layout; a ragged, empty or over-the-bound one is a DecodeError."""
    vectors = struct.pack("<6f", *range(6))
    packed = wire.encode_reply(wire.token_embeddings_reply("t", vectors, 3, tokens=2))
    assert msgpack.unpackb(packed) == {"id": "t", "ok": True, "token_embeddings": vectors,
                                       "dim": 3, "tokens": 2}
    assert [list(v) for v in wire.decode_reply(packed).token_vectors()] == [[0, 1, 2], [3, 4, 5]]
    huge = bytes(4 * (wire.MAX_TOKEN_EMBEDDING_FLOATS + 4))
    for fields in ({"token_embeddings": vectors, "dim": 4}, {"token_embeddings": b"", "dim": 3},
                   {"token_embeddings": vectors}, {"token_embeddings": vectors, "dim": 0},
                   {"token_embeddings": "abc", "dim": 3}, {"token_embeddings": huge, "dim": 4}):
        with pytest.raises(DecodeError, match="token-embeddings"):
            wire.decode_reply(msgpack.packb({"id": "t", "ok": True, **fields}))
        with pytest.raises(ValueError, match="token-embeddings"):
            wire.token_embeddings_reply("t", fields["token_embeddings"], fields.get("dim"))


def test_a_sparse_reply_is_pairs_of_index_and_weight_as_documented() -> None:
    """The layout docs/PROTOCOL.md gives, and every malformed sparse map a DecodeError."""
    indices, values = struct.pack("<2I", 3, 7), struct.pack("<2f", 0.5, 2.0)
    packed = wire.encode_reply(wire.sparse_reply("s", indices, values, 10, tokens=4))
    assert msgpack.unpackb(packed) == {"id": "s", "ok": True, "sparse_indices": indices,
                                       "sparse_values": values, "dim": 10, "tokens": 4}
    assert wire.decode_reply(packed).sparse_pairs() == [(3, 0.5), (7, 2.0)]
    empty = wire.decode_reply(wire.encode_reply(wire.sparse_reply("e", b"", b"", 10)))
    assert empty.sparse_pairs() == [] and empty.dim == 10
    bad = [
        {"sparse_indices": indices, "sparse_values": values[:4], "dim": 10},  # one value short
        {"sparse_indices": indices, "sparse_values": values, "dim": 7},  # index 7 not < dim
        {"sparse_indices": struct.pack("<2I", 7, 3), "sparse_values": values, "dim": 10},
        {"sparse_indices": struct.pack("<2I", 3, 3), "sparse_values": values, "dim": 10},
        {"sparse_indices": indices[:7], "sparse_values": values[:7], "dim": 10},  # not 4n
        {"sparse_indices": indices, "sparse_values": values, "dim": 1},  # more than dim
        {"sparse_indices": indices, "sparse_values": values},
        {"sparse_indices": "ab", "sparse_values": values, "dim": 10},
        {"sparse_indices": indices, "sparse_values": values, "dim": True},
        {"sparse_indices": indices, "sparse_values": values, "dim": 0},
    ]
    for fields in bad:
        with pytest.raises(DecodeError, match="sparse"):
            wire.decode_reply(msgpack.packb({"id": "s", "ok": True, **fields}))
        with pytest.raises((ValueError, TypeError)):
            wire.sparse_reply("s", fields.get("sparse_indices"), fields.get("sparse_values"),
                              fields.get("dim"))


def test_reply_map_layout_is_what_the_protocol_documents() -> None:
    embedding = struct.pack("<2f", 0.5, -1.0)
    body = msgpack.unpackb(wire.encode_reply(wire.embedding_reply("a", embedding, 2, tokens=3)))
    assert body == {"id": "a", "ok": True, "embedding": embedding, "dim": 2, "tokens": 3}
    body = msgpack.unpackb(wire.encode_reply(wire.scores_reply("b", [1, 0.25])))
    assert body == {"id": "b", "ok": True, "scores": [1.0, 0.25]}
    labelled = wire.scores_reply("b", [0.9, 0.1], labels=["pos", "neg"])
    body = msgpack.unpackb(wire.encode_reply(labelled))
    assert body == {"id": "b", "ok": True, "scores": [0.9, 0.1], "labels": ["pos", "neg"]}
    with pytest.raises(ValueError, match="one string per score"):
        wire.scores_reply("b", [0.5], labels=["a", "b"])
    for bad in (["only one"], [1, 2], "ab"):
        packed = msgpack.packb({"id": "b", "ok": True, "scores": [0.5, 0.5], "labels": bad})
        with pytest.raises(DecodeError, match="one string per score"):
            wire.decode_reply(packed)
    cut = wire.encode_embedding_reply("a", embedding, 2, tokens=3, truncated=True)
    assert msgpack.unpackb(cut) == {"id": "a", "ok": True, "embedding": embedding, "dim": 2,
                                    "tokens": 3, "truncated": True}  # sent only when true
    assert wire.decode_reply(cut).truncated and not wire.decode_reply(
        wire.encode_embedding_reply("a", embedding, 2, tokens=3)).truncated
    body = msgpack.unpackb(wire.encode_reply(wire.error_reply("c", "too_long", "5000 > 512")))
    assert body == {"id": "c", "ok": False, "error": {"code": "too_long", "message": "5000 > 512"}}


def test_embedding_reply_checks_its_size() -> None:
    with pytest.raises(ValueError, match=r"4\*dim bytes"):
        wire.embedding_reply("a", b"\x00" * 5, 1)


# ----------------------------------------------------------------- reply garbage


def decode_reply_or_refuse(packed: bytes) -> Reply | None:
    try:
        return wire.decode_reply(packed)
    except DecodeError:
        return None


@PROPERTY
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_decode_error(packed: bytes) -> None:
    decode_reply_or_refuse(packed)


reply_like_maps = st.dictionaries(
    st.sampled_from(["id", "ok", "embedding", "dim", "scores", "error", "tokens"]),
    msgpack_values,
    max_size=7,
)


@PROPERTY
@given(reply_like_maps | msgpack_values)
def test_random_msgpack_only_raises_decode_error(body: Any) -> None:
    reply = decode_reply_or_refuse(msgpack.packb(body, use_bin_type=True))
    if reply is not None:
        assert isinstance(reply.id, str) and isinstance(reply.ok, bool)
        assert reply.tokens is None or (isinstance(reply.tokens, int) and reply.tokens >= 0)
        if reply.ok:
            assert (reply.embedding is None) != (reply.scores is None)
        else:
            assert reply.error is not None


@pytest.mark.parametrize(
    "body",
    [
        [1, 2],
        {"ok": True, "scores": []},
        {"id": 7, "ok": True, "scores": []},
        {"id": "a", "ok": 1, "scores": []},
        {"id": "a", "ok": False},
        {"id": "a", "ok": False, "error": "oops"},
        {"id": "a", "ok": True},
        {"id": "a", "ok": True, "scores": ["high"]},
        {"id": "a", "ok": True, "embedding": b"\x00" * 8, "dim": 3},
        {"id": "a", "ok": True, "embedding": "not bytes", "dim": 1},
        {"id": "a", "ok": True, "embedding": b"\x00" * 4},
        {"id": "a", "ok": True, "scores": [1.0], "tokens": "lots"},
        {"id": "a", "ok": True, "scores": [1.0], "tokens": -1},
        {"id": "a", "ok": True, "scores": [1.0], "truncated": 1},
    ],
)
def test_malformed_replies_are_decode_errors(body: Any) -> None:
    with pytest.raises(DecodeError):
        wire.decode_reply(msgpack.packb(body, use_bin_type=True))


def test_reply_decode_survives_hostile_msgpack() -> None:
    for packed in (b"\x91" * 100_000, b"\xdd\xff\xff\xff\xff", b"\xc1", b"", b"\x81\x01"):
        with pytest.raises(DecodeError):
            wire.decode_reply(packed)


# ------------------------------------------------------------------ PROTOCOL.md


def test_protocol_doc_lists_every_error_code_and_limit() -> None:
    """The document other languages implement from must match the code's constants."""
    doc = PROTOCOL_MD.read_text(encoding="utf-8")
    for code in ErrorCode:
        assert f"`{code.value}`" in doc, f"PROTOCOL.md does not document {code.value}"
    for name in FIELD_NAMES:
        assert f"`{name}`" in doc, f"PROTOCOL.md does not document field {name}"
    for limit in (
        wire.MAX_ID_CHARS,
        wire.MAX_REPLY_TO_CHARS,
        wire.MAX_OPTS_BYTES,
        wire.DEFAULT_MAX_REQUEST_BYTES,
    ):
        assert f"{limit:,}".replace(",", "") in doc.replace(",", ""), f"limit {limit} missing"
    assert f"`v` = `{wire.PROTOCOL_VERSION}`" in doc


@pytest.mark.parametrize("raw", [b"10", b"-1", b"1.0", b"x", b"99999999999999999999"])
def test_a_priority_out_of_range_is_refused_naming_the_field(raw: bytes) -> None:
    fields = {b"v": b"1", b"id": b"r1", b"text": b"hi", b"reply_to": b"tokenq:{q}:reply:r1",
              b"priority": raw}
    with pytest.raises(DecodeError, match="'priority'"):
        wire.decode_request(fields)
    fields[b"priority"] = b"9"
    assert wire.decode_request(fields).priority == 9


# ------------------------------------------------------------------ packing


def test_pack_is_packb_after_a_failure_and_across_threads() -> None:
    """The per-thread Packer gives packb's bytes: after a pack that raised (its buffer is
    not left half written) and from many threads at once (none shares a buffer)."""
    with pytest.raises(TypeError):
        wire.pack({"id": "a", "bad": object()})
    with pytest.raises(OverflowError):
        wire.pack({"id": "a", "big": 2**70})
    body = {"id": "x" * 40, "ok": True, "embedding": b"\x01" * 4096, "dim": 1024}
    assert wire.pack(body) == msgpack.packb(body, use_bin_type=True)

    def many(seed: int) -> bool:
        bodies = [{"id": f"{seed}-{i}", "embedding": bytes([seed]) * (i * 37 % 5000)}
                  for i in range(300)]
        return all(wire.pack(b) == msgpack.packb(b, use_bin_type=True) for b in bodies)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(many, range(16)))
