"""Hostile stream entries for ``tests/faults/test_hostile_fuzz.py``: what they are, and
what each is owed.

An entry is built from *breaks* (each one a definite reason the worker must
not answer it ``ok``) and *noise* (anything that must not change the outcome:
unknown fields, many fields, huge fields, ``dead_*`` names, earlier
duplicates of a field, valid but odd ids). :func:`expect` is the test's own
oracle, written from docs/PROTOCOL.md rather than from the worker's code: the
key the error reply must land on (if any) and whether the entry must become a
dead letter.

Kinds of break (one or more per entry, each on its own field):

* decode breaks (``bad_request`` and a dead letter): a missing or wrong
  ``v``; a missing or unreadable ``id``; a missing, empty, invalid-UTF-8 or
  oversize ``text`` / ``text_pair``; out-of-range or non-decimal numbers
  (400 digits, negative, other scripts' digits, signs, spaces); bad ``opts``;
  a ``reply_to`` outside the queue's reply namespace (tokenq's own keys,
  another queue's, another application's, empty, too long, not UTF-8);
* answered breaks (an error reply, no dead letter): a deadline long past
  (``deadline_exceeded``), a ``text_pair`` on a single-text model
  (``bad_request``), the sim's poison markers (``inference_failed``);
* undeliverable: a ``reply_to`` (or default reply key) in the namespace that
  is not a list (a dead letter, and no reply anywhere).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
from hypothesis import strategies as st

from tokenq.shared import keys
from tokenq.worker.backends.sim import SIM_FAIL_MARKER, SIM_NAN_MARKER
from tokenq.worker.settings import WorkerSettings

MAX_REQUEST_BYTES = 1024 * 1024
"""The worker's default ``max_request_bytes`` (the fleet runs with it)."""

MAX_LETTER_BYTES = WorkerSettings.model_fields["dead_max_letter_bytes"].default
"""The worker's default ``dead_max_letter_bytes``."""

PROTOCOL_FIELDS = frozenset(
    {b"v", b"id", b"text", b"text_pair", b"tokens", b"reply_to", b"deadline_ms",
     b"timeout_ms", b"opts"}
)

ID = None
"""Placeholder for the value of an ``id`` the test fills in (unique per entry)."""

Pairs = tuple[tuple[bytes, "bytes | None"], ...]


@dataclass(frozen=True)
class Targets:
    """The keys hostile entries aim their ``reply_to`` at (all pre-created by the test)."""

    q: keys.QueueRef
    inbox: str
    """An ordinary reply key in the namespace that the test reads."""
    refused: tuple[bytes, ...]
    """reply_to values the worker must refuse (outside the namespace, or not a key)."""
    wrong_type: tuple[str, ...]
    """Keys in the reply namespace that are not lists (the push must fail, nothing else)."""

    @property
    def prefix(self) -> str:
        return keys.reply_prefix(self.q)


@dataclass(frozen=True)
class Hostile:
    """One entry as drawn: fields in XADD order (names may repeat; ``ID`` is filled in)."""

    pairs: Pairs
    breaks: tuple[str, ...]
    """``field:variant`` labels, e.g. ``v:400-digit``, ``reply_to:refused``."""
    id_plan: str = "fill"
    """fill: the test puts a unique readable id (+ ``id_suffix``) where ``ID`` is;
    trap: one whose default reply key is a pre-created non-list; as-is: nothing to fill."""
    id_suffix: str = ""

    def __repr__(self) -> str:  # hypothesis prints this on failure: keep 2 MiB fields short
        return f"Hostile(breaks={self.breaks!r}, id_plan={self.id_plan!r}, " \
               f"id_suffix={self.id_suffix!r}, pairs={describe(self.pairs)})"

    def fill(self, request_id: str | None) -> list[tuple[bytes, bytes]]:
        """The pairs to XADD, with the test's id in place of ``ID``."""
        filled = b"" if request_id is None else request_id.encode()
        return [(name, filled if value is ID else value) for name, value in self.pairs]


def describe(pairs: Sequence[tuple[bytes, bytes | None]], limit: int = 24) -> str:
    """A short, exact-enough rendering of an entry's fields for failure messages."""
    def short(value: bytes | None) -> str:
        if value is None:
            return "<id>"
        if len(value) <= 60:
            return repr(value)
        return f"{value[:40]!r}...<{len(value)} bytes>"

    shown = [f"{short(name)}: {short(value)}" for name, value in pairs[:limit]]
    if len(pairs) > limit:
        shown.append(f"...<{len(pairs) - limit} more fields, "
                     f"{sum(len(n) + len(v or b'') for n, v in pairs)} bytes in all>")
    return "[" + ", ".join(shown) + "]"


# ------------------------------------------------------------------- the oracle

ANSWERED_BREAKS = ("deadline_ms:expired", "text_pair:valid", "text:poison")
"""Breaks a decodable entry may carry: answered with an error, not dead-lettered, checked
by the worker in this order (deadline at read, the model's input kind, then the run)."""

UNDELIVERABLE_BREAKS = frozenset({"reply_to:wrong-type", "trap"})
"""Breaks that leave the entry decodable but its reply key not a list."""


@dataclass(frozen=True)
class Expect:
    """What one XADDed hostile entry is owed."""

    reply_key: str | None
    """Where its single error reply must land; None: it must get no reply."""
    reply_id: str
    """The ``id`` that reply carries (the stream id when the entry's id is unreadable)."""
    codes: frozenset[str]
    dead: bool
    """It must be in the dead stream (with dead_source_id = its stream id)."""
    fields: dict[bytes, bytes] = field(repr=False)
    """Its fields as the worker sees them (the last value of a repeated name wins)."""


def readable_id(value: bytes | None) -> str | None:
    """The id a worker can name in its reply (docs/PROTOCOL.md: 1-128 characters, UTF-8,
    no whitespace, no control characters below U+0020)."""
    if value is None:
        return None
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not 1 <= len(text) <= 128 or any(ch.isspace() or ord(ch) < 32 for ch in text):
        return None
    return text


def breaks_kind(breaks: Sequence[str]) -> str:
    """The break that decides the error code: decode first, then the order the worker
    checks the rest in (deadline at read, then the model's input kind, then the run)."""
    labels = set(breaks)
    if labels - set(ANSWERED_BREAKS) - UNDELIVERABLE_BREAKS:
        return "decode"
    for label in ANSWERED_BREAKS:
        if label in labels:
            return label
    return "none"


def expect(hostile: Hostile, pairs: Sequence[tuple[bytes, bytes]], stream_id: bytes,
           targets: Targets, non_lists: set[str]) -> Expect:
    """What the entry XADDed as ``pairs`` (with id ``stream_id``) must get."""
    fields = dict(pairs)
    request_id = readable_id(fields.get(b"id"))
    target: str | None = None
    raw_reply_to = fields.get(b"reply_to")
    named: str | None = None
    if raw_reply_to is not None:
        try:
            named = raw_reply_to.decode("utf-8")
        except UnicodeDecodeError:
            named = None
    prefix = targets.prefix
    if named is not None and 1 <= len(named) <= 512 and named.startswith(prefix) \
            and len(named) > len(prefix):
        target = named
    elif request_id is not None:
        target = keys.reply(targets.q, request_id)
    kind = breaks_kind(hostile.breaks)
    undeliverable = target is not None and target in non_lists
    codes = {
        "decode": {"bad_request"},
        "deadline_ms:expired": {"deadline_exceeded"},
        "text_pair:valid": {"bad_request"},
        "text:poison": {"inference_failed"},
    }.get(kind, set())
    return Expect(
        reply_key=None if undeliverable else target,
        reply_id=request_id if request_id is not None else stream_id.decode(),
        codes=frozenset(codes),
        dead=kind == "decode" or undeliverable,
        fields=fields,
    )


# -------------------------------------------------------------- the strategies

_WORDS = ["alpha", "beta", "gamma", "queue", "token", "batch", "naïve", "日本語", "데이터",
          "😀", "x" * 50, "ﬁ", "Ωmega", "١٢٣"]
_BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82",
             b"\x80abc", b"\xc0\x80", b"abc\xfe"]
_OTHER_DIGITS = ["١", "１", "𝟏", "¹", "߁", "໑", "٢٣", "１２３", "१", "〡", "Ⅰ", "½"]
_ODD_DECIMALS = [" 1", "1 ", "+1", "-0", "1_0", "1.0", "1e3", "0x1", "1\n", "\t1", "１"]


def _text() -> st.SearchStrategy[bytes]:
    """A valid, non-empty text."""
    return st.lists(st.sampled_from(_WORDS), min_size=1, max_size=12).map(
        lambda words: " ".join(words).encode())


def _huge(low: int, high: int) -> st.SearchStrategy[bytes]:
    """Valid UTF-8 text of ``low`` to ``high`` bytes (built, not drawn byte by byte)."""
    return st.integers(low, high).map(lambda size: (b"ab " * (size // 3 + 1))[:size])


def _digits(n: int) -> st.SearchStrategy[str]:
    return st.integers(10 ** (n - 1), 10**n - 1).map(str)


def _bad_opts() -> st.SearchStrategy[bytes]:
    return st.sampled_from([
        b"\xc1", b"\xc1\x00\x00", msgpack.packb(5), msgpack.packb([1, 2]), msgpack.packb("s"),
        msgpack.packb(None), msgpack.packb({1: 2}), msgpack.packb({"a": 1})[:-1],
        msgpack.packb({"big": "x" * 70_000}), msgpack.packb({"e": msgpack.ExtType(1, b"x")}),
        b"\x81\xa1a" + b"\x91" * 5000 + b"\xc0", msgpack.packb({str(i): i for i in range(257)}),
        msgpack.packb({"a": list(range(1025))}), b"\xff", b"\x82\xa1a",
        b"\xdf\xff\xff\xff\xff",  # a map claiming 4 billion entries
    ])


def _readable_suffix() -> st.SearchStrategy[str]:
    """Characters a valid id may hold after the test's unique prefix."""
    chars = st.characters(exclude_categories=("Cs", "Cc", "Zs", "Zl", "Zp")).filter(
        lambda ch: not ch.isspace())
    return st.one_of(
        st.just(""),
        st.text(chars, max_size=20),
        st.sampled_from(["{x}", ":reply:", "*", "é", "😀", "\x7f", "-" * 100, "}{", "%s%d"]),
    )


def _field_names() -> st.SearchStrategy[bytes]:
    """Names of unknown fields: random bytes, near-misses and tokenq's dead_* names."""
    return st.one_of(
        st.binary(max_size=24).filter(lambda name: name not in PROTOCOL_FIELDS),
        st.sampled_from([
            b"", b"dead_source_id", b"dead_truncated", b"dead_error_code", b"dead_", b"V",
            b"ID", b"Text", b"v ", b" id", b"reply-to", b"\xff", b"text\x00", b"dead_at_ms",
            "текст".encode(), b"opts\n",
        ]),
    )


@st.composite
def hostile_entries(draw: st.DrawFn, targets: Targets, primary: int | None = None) -> Hostile:
    """One entry with 1-3 breaks (each on its own field) and some noise.

    ``primary`` picks the first break from :data:`PRIMARIES` (modulo its length);
    the others are hypothesis's choice.
    """
    final: dict[bytes, bytes | None] = {
        b"v": b"1", b"id": ID, b"text": draw(_text()),
    }
    for name, value in (
        (b"tokens", st.one_of(st.integers(0, 1 << 24).map(lambda i: str(i).encode()),
                              st.sampled_from([b"0", str(1 << 24).encode(), b"0007"]))),
        (b"deadline_ms", st.sampled_from([b"", b"253402300799999", b"99999999999999"])),
        (b"timeout_ms", st.sampled_from([b"", b"2592000000", b"600000"])),
        (b"opts", st.sampled_from([b"", msgpack.packb({}), msgpack.packb({"k": [1, "x"]})])),
        (b"reply_to", st.just(targets.inbox.encode())),
    ):
        if draw(st.booleans()):
            final[name] = draw(value)

    chosen: list[tuple[str, int | None]] = []
    if primary is not None:
        chosen.append(PRIMARIES[primary % len(PRIMARIES)])
    others = [name for name in _FIELD_BREAKS if not chosen or name != chosen[0][0]]
    more = draw(st.lists(st.sampled_from(others), min_size=0 if chosen else 1, max_size=2,
                         unique=True))
    chosen += [(name, None) for name in more]
    breaks: list[str] = []
    id_plan = "fill"
    for name, index in chosen:
        variants = _FIELD_BREAKS[name](targets)
        variant = variants[index] if index is not None else st.one_of(variants)
        label, value = draw(variant)
        breaks.append(label)
        if name == "id":
            id_plan = "as-is"
        if value is MISSING:
            final.pop(name.encode(), None)
        else:
            final[name.encode()] = value
    if id_plan == "fill" and draw(st.sampled_from([False] * 7 + [True])):
        id_plan = "trap"  # its default reply key is a pre-created string
    suffix = draw(_readable_suffix()) if id_plan == "fill" else ""

    pairs: list[tuple[bytes, bytes | None]] = list(final.items())
    pairs = draw(st.permutations(pairs))
    # noise: unknown fields, earlier duplicates, many fields, huge fields
    extra = draw(st.lists(st.tuples(_field_names(), st.binary(max_size=64)), max_size=5))
    # an earlier duplicate of a field: the worker must see the last value (the one above)
    duplicates = [(name, draw(st.binary(max_size=16)))
                  for name in draw(st.lists(st.sampled_from(sorted(final)), max_size=2))]
    bulk = draw(st.sampled_from(_BULK))
    noise: list[tuple[bytes, bytes | None]] = list(extra)
    if bulk == "many":
        count = draw(st.integers(100, 3000))
        noise += [(f"f{i}".encode(), b"") for i in range(count)]
    elif bulk == "dense":  # 2-byte names, empty values: the most fields a letter can keep
        count = draw(st.integers(5000, 12000))
        noise += [(struct.pack(">H", i), b"") for i in range(count)]
    elif bulk == "huge-value":
        noise.append((b"blob", draw(_huge(64 * 1024, 2 * 1024 * 1024))))
    elif bulk == "huge-name":
        noise.append((b"n" * draw(st.integers(16 * 1024, 40 * 1024)), b"x"))
    pairs = [*duplicates, *noise, *pairs] if draw(st.booleans()) else \
        [*duplicates, *pairs, *noise]
    return Hostile(tuple(pairs), tuple(breaks), id_plan, suffix)


_BULK = ["none"] * 10 + ["many", "dense", "huge-value", "huge-name"]

MISSING = object()
"""A break that removes its field."""

Variant = st.SearchStrategy[tuple[str, object]]


def _numbers(field: str, extra: Sequence[str], *, empty_ok: bool = False) -> list[Variant]:
    """Values a numeric field must refuse, one strategy per kind."""
    def bad(kind: str, strategy: st.SearchStrategy[bytes]) -> Variant:
        if empty_ok:  # an empty deadline_ms / timeout_ms means none
            strategy = strategy.filter(bool)
        return strategy.map(lambda b: (f"{field}:{kind}", b))

    return [
        bad("400-digit", st.one_of(_digits(400).map(str.encode), _digits(20).map(str.encode),
                                   st.just(("0" * 399 + "1").encode()))),
        bad("negative", st.integers(-(10**400), -1).map(lambda i: str(i).encode())),
        bad("other-digits", st.sampled_from(_OTHER_DIGITS).map(str.encode)),
        bad("syntax", st.one_of(
            st.sampled_from(_ODD_DECIMALS).map(str.encode), st.sampled_from(_BAD_UTF8),
            st.floats().map(lambda f: repr(f).encode()))),
        bad("range", st.sampled_from([value.encode() for value in extra])),
    ]


def _break_v(_: Targets) -> list[Variant]:
    return [st.just(("v:missing", MISSING)),
            *_numbers("v", ["0", "2", "1000001", "", "11", "01.0"])]


def _break_id(_: Targets) -> list[Variant]:
    return [
        st.just(("id:missing", MISSING)),
        st.sampled_from([
            b"", b"x" * 129, b"y" * 400, b"a b", b"a\tb", "a\u3000b".encode(),
            "a\u00a0b".encode(), b"a\x01b", b"\x00", b"\n", "é".encode() * 129,
            "a\u2028b".encode(), b"a\x1fb",
        ]).map(lambda b: ("id:bad", b)),
        st.sampled_from(_BAD_UTF8).map(lambda b: ("id:utf8", b)),
    ]


def _break_text(_: Targets) -> list[Variant]:
    return [
        st.just(("text:missing", MISSING)),
        st.sampled_from([b"", b" ", "\u3000".encode(), b"\t\n\r", "\u2028\u2029 ".encode(),
                         b"\x0b\x0c"]).map(lambda b: ("text:blank", b)),
        st.sampled_from(_BAD_UTF8).map(lambda b: ("text:utf8", b"hello " + b)),
        _huge(MAX_REQUEST_BYTES + 1, 2 * 1024 * 1024).map(lambda b: ("text:oversize", b)),
        st.sampled_from([SIM_FAIL_MARKER, SIM_NAN_MARKER]).map(
            lambda m: ("text:poison", f"poisoned {m} text".encode())),
    ]


def _break_text_pair(_: Targets) -> list[Variant]:
    return [
        st.sampled_from([b"", b"  ", "\u3000".encode(), *_BAD_UTF8]).map(
            lambda b: ("text_pair:bad", b)),
        _huge(MAX_REQUEST_BYTES, MAX_REQUEST_BYTES + 4096).map(
            lambda b: ("text_pair:oversize", b)),
        _text().map(lambda b: ("text_pair:valid", b)),
    ]


def _break_tokens(_: Targets) -> list[Variant]:
    return _numbers("tokens", ["", "16777217", "99999999999"])


def _break_deadline(_: Targets) -> list[Variant]:
    return [
        *_numbers("deadline_ms", ["253402300800000", "9999999999999999999"], empty_ok=True),
        st.integers(0, 10**12).map(lambda i: ("deadline_ms:expired", str(i).encode())),
    ]


def _break_timeout(_: Targets) -> list[Variant]:
    return _numbers("timeout_ms", ["0", "2592000001", "00"], empty_ok=True)


def _break_opts(_: Targets) -> list[Variant]:
    return [_bad_opts().map(lambda b: ("opts:bad", b))]


def _break_reply_to(targets: Targets) -> list[Variant]:
    prefix = targets.prefix.encode()
    return [
        st.sampled_from(targets.refused).map(lambda b: ("reply_to:refused", b)),
        st.sampled_from([b"", b"k" * 513, prefix, prefix + b"x" * 600, prefix + b"\xff",
                         *_BAD_UTF8]).map(lambda b: ("reply_to:malformed", b)),
        st.sampled_from(targets.wrong_type).map(
            lambda key: ("reply_to:wrong-type", key.encode())),
    ]


_FIELD_BREAKS = {
    "v": _break_v, "id": _break_id, "text": _break_text, "text_pair": _break_text_pair,
    "tokens": _break_tokens, "deadline_ms": _break_deadline, "timeout_ms": _break_timeout,
    "opts": _break_opts, "reply_to": _break_reply_to,
}

PRIMARIES: tuple[tuple[str, int], ...] = tuple(
    (name, index) for name, make in _FIELD_BREAKS.items()
    for index in range(len(make(Targets(keys.QueueRef("x"), "", (b"x",), ("x",)))))
)
"""Every (field, variant) break: the test rotates through them so each is drawn about
equally often (hypothesis's own choices lean towards the first alternative)."""
