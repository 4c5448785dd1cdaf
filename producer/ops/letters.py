"""Dead letters: read them, put them back on the queue, or delete them.

A worker moves a request it could not answer after ``max_deliveries`` to
``keys.dead(q)`` with its original fields plus ``dead_error_code``,
``dead_error``, ``dead_worker``, ``dead_deliveries``, ``dead_at_ms`` and
``dead_source_id`` (the format is :mod:`tokenq.shared.dead_letter`'s).
Retrying re-adds the original fields to the request stream and deletes the
letter in one Lua script (``dlq_retry.lua``), so a letter is never lost or
doubled, and the queue's length limit still holds.

A letter whose fields the worker cut to its byte cap carries
``dead_truncated`` (the names cut, comma-separated): it is no longer the
request its producer wrote, so retrying skips it and leaves it in place.

``retry(ids=None)`` works on a snapshot: it stops at the dead stream's last
id as of its start, so letters that die again while it runs (or any written
meanwhile) are left for the next retry instead of being re-read forever.

A sharded queue's letters are in each lane's own dead stream
(``tokenq:{q:k}:dead``, and the plain ``tokenq:{q}:dead``), and each goes
back onto its own lane's request stream, where its ``reply_to`` and id
belong. Entry ids are per stream, so there a letter is named with its lane
(:class:`Lanes`): ``<shard>/<entry id>``, or ``plain/<entry id>``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from tokenq.shared import functions, keys, lua_scripts
from tokenq.shared.dead_letter import DeadLetter, parse_letter
from tokenq.shared.errors import QueueFull
from tokenq.shared.text import plural

_PAGE = 100
_MAX_U64 = (1 << 64) - 1


_BYTES_LITERAL = re.compile(r"""(?<![\w'"])b('(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")""")
"""A Python bytes literal (``b'9'``, ``b"\\xff"``), as some workers' messages quote a field."""


def reason_text(reason: str | None) -> str | None:
    """Why a letter died, as text a person reads: every bytes literal in it becomes its
    UTF-8 text (``b'9'`` becomes ``'9'``, undecodable bytes U+FFFD).

    Why here: a worker's message may quote a raw field with Python's repr,
    and an operator should not have to decode ``b'\\xe2\\x80\\xa6'`` by hand.
    """
    if reason is None:
        return None

    def as_text(match: re.Match[str]) -> str:
        try:
            value = ast.literal_eval(match.group(0))
        except (ValueError, SyntaxError):
            return match.group(0)
        return repr(value.decode("utf-8", "replace")) if isinstance(value, bytes) else str(value)

    return _BYTES_LITERAL.sub(as_text, reason)


def letter_json(letter: DeadLetter) -> dict[str, Any]:
    """One letter for ``dlq list --json``: text fields as strings, binary ones (``opts``) as hex."""
    request = {
        name: value if isinstance(value, str) else {"hex": value.hex()}
        for name, value in letter.request.items()
    }
    return {
        "entry_id": letter.entry_id,
        "request_id": letter.request_id,
        "error_code": letter.error_code,
        "error": reason_text(letter.error),
        "worker": letter.worker,
        "deliveries": letter.deliveries,
        "at_ms": letter.at_ms,
        "source_id": letter.source_id,
        "truncated": letter.truncated,
        "request": request,
    }


@dataclass(slots=True)
class RetryOutcome:
    """What :func:`retry` did, letter by letter (dead-stream entry ids)."""

    moved: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """Named ids the dead stream does not hold (or that are not stream ids at all)."""
    vanished: list[str] = field(default_factory=list)
    """``--all`` only: letters deleted by someone else between being listed and moved."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Letters left in the dead stream, id -> why: truncated (fields cut), or no fields."""
    last_id: str | None = None
    """``--all``: the snapshot's end, the dead stream's last id when the retry started."""
    full: str | None = None
    """Why it stopped early: a page would have overfilled the queue (pages before it moved)."""


def entry_id(text: str) -> str | None:
    """``text`` as a complete stream id (``ms-seq``; a bare ``ms`` means ``ms-0``), or None.

    Only complete ids are sent to Redis: ``XRANGE`` reads a bare ``ms`` as a
    range of entries while ``XDEL`` reads it as ``ms-0``, and anything else is
    an error reply.
    """
    ms, dash, seq = text.strip().partition("-")
    if not dash:
        seq = "0"
    if not (ms.isascii() and ms.isdigit() and seq.isascii() and seq.isdigit()):
        return None
    if int(ms) > _MAX_U64 or int(seq) > _MAX_U64:
        return None
    return f"{int(ms)}-{int(seq)}"


def resolve_ids(ids: Sequence[str]) -> tuple[list[str], list[str]]:
    """(complete ids to look up, in order and without repeats; words that are not stream ids)."""
    wanted: list[str] = []
    invalid: list[str] = []
    for text in ids:
        normal = entry_id(text)
        if normal is None:
            invalid.append(text)
        elif normal not in wanted:
            wanted.append(normal)
    return wanted, invalid


PLAIN = "plain"
"""The lane part of a letter's name on the plain ``{q}`` of a sharded queue (``plain/<id>``).

Not ``-`` (the table's shard column for it): a word starting with ``-``
after ``--id`` would be read as a flag.
"""


@dataclass(frozen=True, slots=True)
class Target:
    """One letter an operator named: its entry id, and its lane (None: whichever holds it)."""

    lane: keys.QueueRef | None
    entry_id: str


@dataclass(frozen=True, slots=True)
class Lanes:
    """A queue's lanes (:func:`tokenq.shared.keys.lanes_of`), and how ``tokenq dlq`` names
    the letters in them.

    Why names: entry ids are per stream, so two lanes may each hold a letter
    ``1700000000000-0``. In a sharded queue a letter is ``<shard>/<entry id>``
    (``plain/<entry id>`` on the plain ``{q}``); in an unsharded one it is
    its entry id, as it always was.
    """

    queue: keys.QueueRef
    all: tuple[keys.QueueRef, ...]

    @property
    def sharded(self) -> bool:
        return len(self.all) > 1

    def name(self, lane: keys.QueueRef, entry: str) -> str:
        """The letter ``entry`` of ``lane`` as the table shows it and ``--id`` takes it."""
        if not self.sharded:
            return entry
        return f"{PLAIN if lane.shard is None else lane.shard}/{entry}"

    def where(self, key: Callable[[keys.QueueRef], str]) -> str:
        """The lanes' ``key`` (``keys.dead``, ...) for a summary line: ``tokenq:{q}:dead``,
        or ``tokenq:{q:0}:dead … tokenq:{q:2}:dead and tokenq:{q}:dead``."""
        if not self.sharded:
            return key(self.queue)
        *shards, plain = self.all
        between = ", " if len(shards) == 2 else " … "
        return f"{key(shards[0])}{between}{key(shards[-1])} and {key(plain)}"

    def target(self, word: str) -> Target | str:
        """The letter ``word`` names, or ``word`` with why it names none (for the report).

        In a sharded queue a bare entry id names whichever lane holds it
        (:func:`place` looks); ``<shard>/<id>`` and ``plain/<id>`` name one lane.
        """
        head, slash, tail = word.partition("/")
        if not (self.sharded and slash):
            normal = entry_id(word)
            if normal is None:
                return f"{word} (not a stream entry id)"
            return Target(None if self.sharded else self.queue, normal)
        normal = entry_id(tail)
        if normal is None:
            return f"{word} (not a stream entry id)"
        lane = self._lane(head.strip())
        if lane is None:
            return f"{word} (no such shard: the queue has shards 0-{len(self.all) - 2} and plain)"
        return Target(lane, normal)

    def targets(self, words: Sequence[str]) -> tuple[list[Target], list[str]]:
        """(the letters named, in order and without repeats; each word naming none, with why)."""
        wanted: list[Target] = []
        invalid: list[str] = []
        for word in words:
            found = self.target(word)
            if isinstance(found, str):
                invalid.append(found)
            elif found not in wanted:
                wanted.append(found)
        return wanted, invalid

    def candidates(self, target: Target) -> list[tuple[keys.QueueRef, str]]:
        """Where ``target`` may be: its lane, or every lane for a bare id."""
        lanes = self.all if target.lane is None else (target.lane,)
        return [(lane, target.entry_id) for lane in lanes]

    def _lane(self, text: str) -> keys.QueueRef | None:
        if text == PLAIN:
            return self.queue
        if not (text.isascii() and text.isdigit()) or int(text) >= len(self.all) - 1:
            return None
        return self.all[int(text)]


def count(r: redis.Redis, q: keys.QueueRef) -> int:
    return int(r.xlen(keys.dead(q)))


def counts(r: redis.Redis, lanes: Lanes) -> dict[keys.QueueRef, int]:
    """Each lane's number of dead letters (one pipeline)."""
    with r.pipeline(transaction=False) as pipe:
        for lane in lanes.all:
            pipe.xlen(keys.dead(lane))
        found = pipe.execute()
    return {lane: int(n) for lane, n in zip(lanes.all, found, strict=True)}


def list_letters(
    r: redis.Redis, q: keys.QueueRef, *, limit: int, ids: Sequence[str] = ()
) -> list[DeadLetter]:
    """The oldest ``limit`` dead letters, or the ones named by ``ids`` (complete ids)."""
    if ids:
        return [letter for _, letter in read_letters(r, [(q, one) for one in ids])]
    entries: list[tuple[bytes, Any]] = r.xrange(  # type: ignore[assignment]
        keys.dead(q), "-", "+", count=limit)  # redis-py: bytes | str | None; these are bytes
    return [parse_letter(i, f) for i, f in entries]


def read_letters(
    r: redis.Redis, where: Sequence[tuple[keys.QueueRef, str]]
) -> list[tuple[keys.QueueRef, DeadLetter]]:
    """The letters at each ``(lane, complete entry id)`` that holds one, in order (one pipeline)."""
    if not where:
        return []
    with r.pipeline(transaction=False) as pipe:
        for lane, one in where:
            pipe.xrange(keys.dead(lane), one, one)
        found = pipe.execute()
    return [(lane, parse_letter(i, f))
            for (lane, _), entries in zip(where, found, strict=True) for i, f in entries]


def oldest(r: redis.Redis, lanes: Lanes, limit: int) -> list[tuple[keys.QueueRef, DeadLetter]]:
    """The ``limit`` oldest letters of all the lanes together (by entry id time; then lane)."""
    with r.pipeline(transaction=False) as pipe:
        for lane in lanes.all:
            pipe.xrange(keys.dead(lane), "-", "+", count=limit)
        found = pipe.execute()
    merged = [(_id_order(i), at, lane, parse_letter(i, f))
              for at, (lane, entries) in enumerate(zip(lanes.all, found, strict=True))
              for i, f in entries]
    merged.sort(key=lambda one: (one[0], one[1]))
    return [(lane, letter) for _, _, lane, letter in merged[:limit]]


def _id_order(raw: bytes | str) -> tuple[int, int]:
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms), int(seq or 0)


@dataclass(slots=True)
class Placed:
    """The named letters by lane (:func:`place`), and the bare ids that name no one letter."""

    ids: dict[keys.QueueRef, list[str]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    """Bare ids no lane holds."""
    ambiguous: dict[str, list[str]] = field(default_factory=dict)
    """Bare id -> the names of the letters (one per lane) it could mean."""


def place(r: redis.Redis, lanes: Lanes, targets: Sequence[Target]) -> Placed:
    """Each target's lane: a bare id (sharded queues only) is looked up in every lane.

    One found in several lanes is ambiguous and placed nowhere: retrying or
    purging a letter the operator did not mean cannot be undone.
    """
    bare = [pair for target in targets if target.lane is None
            for pair in lanes.candidates(target)]
    holders: dict[str, list[keys.QueueRef]] = {}
    for lane, letter in read_letters(r, bare):
        holders.setdefault(letter.entry_id, []).append(lane)
    placed = Placed()
    by_lane: dict[keys.QueueRef, list[str]] = {}
    for target in targets:
        where = [target.lane] if target.lane is not None else holders.get(target.entry_id, [])
        if not where:
            placed.missing.append(target.entry_id)
        elif len(where) > 1:
            placed.ambiguous[target.entry_id] = [lanes.name(one, target.entry_id)
                                                 for one in where]
        else:
            by_lane.setdefault(where[0], []).append(target.entry_id)
    placed.ids = {lane: by_lane[lane] for lane in lanes.all if lane in by_lane}
    return placed


def last_id(r: redis.Redis, q: keys.QueueRef) -> str | None:
    """The dead stream's newest entry id, or None when it is empty."""
    newest: list[tuple[bytes, Any]] = r.xrevrange(  # type: ignore[assignment]  # as in _pages
        keys.dead(q), "+", "-", count=1)
    return newest[0][0].decode() if newest else None


def _pages(r: redis.Redis, q: keys.QueueRef, end: str) -> Iterator[list[str]]:
    """Dead entry ids up to ``end``, a page at a time (each handled before the next read)."""
    start = "-"
    while True:
        # redis-py types ids bytes | str | None: this client's replies are bytes
        entries: list[tuple[bytes, Any]] = r.xrange(  # type: ignore[assignment]
            keys.dead(q), start, end, count=_PAGE)
        if not entries:
            return
        yield [one.decode() for one, _ in entries]
        if entries[-1][0].decode() == end:
            return
        start = "(" + entries[-1][0].decode()


def retry(
    r: redis.Redis,
    q: keys.QueueRef,
    ids: Sequence[str] | None,
    *,
    max_queue_length: int,
    drop_deadline: bool = False,
    until_full: bool = False,
) -> RetryOutcome:
    """Re-enqueue the named letters (``ids=None``: every letter there when it starts).

    Truncated letters are skipped and stay in the dead stream. Raises
    :class:`QueueFull` when a page would push the queue past
    ``max_queue_length``; pages already moved stay moved. With ``until_full``
    a full queue ends it with ``outcome.full`` set instead of raising, so a
    sharded queue's retry still counts what that lane moved before it filled.
    """
    script = functions.Function(r, "dlq_retry")  # dlq_retry.lua, by FCALL
    outcome = RetryOutcome()
    if ids is None:
        outcome.last_id = last_id(r, q)
        pages: Iterator[list[str]] = iter(()) if outcome.last_id is None else _pages(
            r, q, outcome.last_id)
    else:
        wanted, outcome.missing = resolve_ids(ids)
        pages = (wanted[i:i + _PAGE] for i in range(0, len(wanted), _PAGE))
    for page in pages:
        try:
            answers = script(keys=[keys.dead(q), keys.requests(q)],
                             args=[max_queue_length, "1" if drop_deadline else "0", *page])
        except redis.ResponseError as exc:
            full = lua_scripts.parse_queue_full(str(exc))
            if full is None:
                raise
            outcome.full = (
                f"{_lane_words(q)} holds {full.length} of at most {full.limit} requests; "
                f"moved {plural(len(outcome.moved), 'dead letter')} before it filled")
            if not until_full:
                raise QueueFull(outcome.full) from None
            return outcome
        for one, answer in zip(page, answers, strict=True):
            if isinstance(answer, list):  # [b"truncated", b"text,opts"] or [b"empty", b""]
                outcome.skipped[one] = _skip_reason(answer)
            elif answer:
                outcome.moved.append(one)
            elif ids is None:
                outcome.vanished.append(one)
            else:
                outcome.missing.append(one)
    return outcome


def _lane_words(q: keys.QueueRef) -> str:
    """``queue 'q'``, or ``shard 2 of queue 'q'``: the limit holds per lane."""
    return f"queue {q.name!r}" if q.shard is None else f"shard {q.shard} of queue {q.name!r}"


def _skip_reason(answer: list[bytes]) -> str:
    kind = answer[0].decode(errors="replace") if answer else ""
    detail = answer[1].decode(errors="replace") if len(answer) > 1 else ""
    if kind == "truncated":
        return (f"truncated: the worker cut {detail or 'some fields'} to fit its dead-letter "
                "size cap, so it is not the request as written")
    return "it holds no request fields, only dead_* ones: nothing to put back"


def purge(
    r: redis.Redis, q: keys.QueueRef, ids: Sequence[str] | None
) -> tuple[int, list[str]]:
    """Delete the named letters (``ids=None``: the whole dead stream).

    Returns how many were deleted and the named ids that were not there.
    """
    if ids is None:
        dead = keys.dead(q)

        def drop(pipe: redis.client.Pipeline) -> None:
            kind = pipe.type(dead)
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind not in ("stream", "none"):  # never DEL what is not a dead stream
                raise redis.ResponseError(
                    f"WRONGTYPE {dead} is a {kind}, not a stream: not deleted")
            pipe.multi()
            pipe.xlen(dead)
            pipe.delete(dead)

        removed, _ = r.transaction(drop, dead)  # type: ignore[misc]  # redis-py: list | None
        return int(removed), []
    wanted, missing = resolve_ids(ids)
    removed = 0
    for start in range(0, len(wanted), _PAGE):
        page = wanted[start:start + _PAGE]
        with r.pipeline(transaction=False) as pipe:
            for one in page:
                pipe.xdel(keys.dead(q), one)
            deleted = pipe.execute()
        for one, n in zip(page, deleted, strict=True):
            if int(n):
                removed += 1
            else:
                missing.append(one)
    return removed, missing
