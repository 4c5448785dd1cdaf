"""Dead letters: read, retry (``dlq_retry.lua``: re-add the request's own fields and delete
the letter atomically, within the length limit; truncated letters stay) or delete them, lane
by lane; ``retry(ids=None)`` stops at the dead stream's last id as of its start."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from tokenq.producer.ops.snapshot import pipelined
from tokenq.shared import functions, keys, lua_scripts
from tokenq.shared.dead_letter import DeadLetter, parse_letter
from tokenq.shared.errors import QueueFull
from tokenq.shared.redis_text import as_text
from tokenq.shared.text import plural

_PAGE = 100
_MAX_U64 = (1 << 64) - 1
# A Python bytes literal (``b'9'``, ``b"\\xff"``), as some workers' messages quote a field.
_BYTES_LITERAL = re.compile(r"""(?<![\w'"])b('(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")""")


def reason_text(reason: str | None) -> str | None:
    """Why a letter died, each bytes literal in it as its UTF-8 text (``b'9'`` becomes
    ``'9'``, undecodable bytes U+FFFD), so no one decodes ``b'\\xe2\\x80\\xa6'`` by hand."""
    if reason is None:
        return None

    def as_text(match: re.Match[str]) -> str:
        try:
            value = ast.literal_eval(match.group(0))
        except (ValueError, SyntaxError):
            return match.group(0)
        return repr(value.decode("utf-8", "replace")) if isinstance(value, bytes) else str(value)

    return _BYTES_LITERAL.sub(as_text, reason)


@dataclass(slots=True)
class RetryOutcome:
    """What :func:`retry` did, letter by letter (dead-stream entry ids)."""

    moved: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # named ids not there
    vanished: list[str] = field(default_factory=list)  # --all: deleted by someone meanwhile
    skipped: dict[str, str] = field(default_factory=dict)  # left in place, id -> why
    last_id: str | None = None  # --all: the dead stream's last id when the retry started
    full: str | None = None  # why it stopped early: a page would have overfilled the queue


def entry_id(text: str) -> str | None:
    """``text`` as a complete stream id (a bare ``ms`` means ``ms-0``), or None: XRANGE
    would read a bare ``ms`` as a range, XDEL as ``ms-0``."""
    ms, dash, seq = text.strip().partition("-")
    if not dash:
        seq = "0"
    if not (ms.isascii() and ms.isdigit() and seq.isascii() and seq.isdigit()):
        return None
    if int(ms) > _MAX_U64 or int(seq) > _MAX_U64:
        return None
    return f"{int(ms)}-{int(seq)}"


PLAIN = "plain"  # a letter's lane on a sharded queue's plain {q} (``-`` would read as a flag)


@dataclass(frozen=True, slots=True)
class Target:
    """One letter an operator named: its entry id, and its lane (None: whichever holds it)."""

    lane: keys.QueueRef | None
    entry_id: str


@dataclass(frozen=True, slots=True)
class Lanes:
    """A queue's lanes, and the letters' names: entry ids are per stream, so in a sharded
    queue a letter is ``<shard>/<entry id>`` (``plain/<entry id>``), else its entry id."""

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
        """The lanes' ``key`` for a summary: ``tokenq:{q:0}:dead … tokenq:{q:2}:dead and
        tokenq:{q}:dead``, or the one key."""
        if not self.sharded:
            return key(self.queue)
        *shards, plain = self.all
        between = ", " if len(shards) == 2 else " … "
        return f"{key(shards[0])}{between}{key(shards[-1])} and {key(plain)}"

    def targets(self, words: Sequence[str]) -> tuple[list[Target], list[str]]:
        """(the letters named, in order and without repeats, a bare id in a sharded queue with
        lane None: whichever holds it; each word naming none, with why)."""
        wanted: list[Target] = []
        invalid: list[str] = []
        for word in words:
            head, slash, tail = word.partition("/")
            named = self.sharded and slash
            normal = entry_id(tail if named else word)
            lane = self._lane(head.strip()) if named else None if self.sharded else self.queue
            if normal is None:
                invalid.append(f"{word} (not a stream entry id)")
            elif named and lane is None:
                invalid.append(f"{word} (no such shard: the queue has shards "
                               f"0-{len(self.all) - 2} and plain)")
            elif (found := Target(lane, normal)) not in wanted:
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


def count(r: redis.Redis, lanes: Lanes) -> int:
    """The lanes' dead letters together (one pipeline)."""
    return sum(pipelined(r, lambda pipe, lane: pipe.xlen(keys.dead(lane)), lanes.all))


Letters = list[tuple[keys.QueueRef, DeadLetter]]  # each with its lane


def read_letters(r: redis.Redis, where: Sequence[tuple[keys.QueueRef, str]]) -> Letters:
    """The letters at each ``(lane, complete entry id)`` that holds one, in order (one pipeline)."""
    if not where:
        return []
    found = pipelined(r, lambda pipe, at: pipe.xrange(keys.dead(at[0]), at[1], at[1]), where)
    return [(lane, parse_letter(i, f))
            for (lane, _), entries in zip(where, found, strict=True) for i, f in entries]


def oldest(r: redis.Redis, lanes: Lanes, limit: int) -> Letters:
    """The ``limit`` oldest letters of all the lanes together (by entry id time; then lane)."""
    found = pipelined(r, lambda pipe, lane: pipe.xrange(keys.dead(lane), "-", "+", count=limit),
                      lanes.all)
    merged = [(_id_order(i), at, lane, parse_letter(i, f))
              for at, (lane, entries) in enumerate(zip(lanes.all, found, strict=True))
              for i, f in entries]
    merged.sort(key=lambda one: (one[0], one[1]))
    return [(lane, letter) for _, _, lane, letter in merged[:limit]]


def _id_order(raw: bytes | str) -> tuple[int, int]:
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms), int(seq or 0)


Placed = tuple[dict[keys.QueueRef, list[str]], list[str], dict[str, list[str]]]


def place(lanes: Lanes, targets: Sequence[Target], found: set[tuple[keys.QueueRef, str]], *,
          named_found: bool = False) -> Placed:
    """Each target's lane among the ``found`` (lane, entry id) pairs (``named_found``: a
    target with a lane is there): (ids by lane; names found nowhere; bare id -> the names
    of the letters in several lanes, placed nowhere: a wrong letter cannot be undone)."""
    by_lane: dict[keys.QueueRef, list[str]] = {}
    missing: list[str] = []
    ambiguous: dict[str, list[str]] = {}
    for target in targets:
        where = [lane for lane, one in lanes.candidates(target)
                 if (named_found and target.lane is not None) or (lane, one) in found]
        if not where:
            missing.append(target.entry_id if target.lane is None
                           else lanes.name(target.lane, target.entry_id))
        elif len(where) > 1:
            ambiguous[target.entry_id] = [lanes.name(lane, target.entry_id) for lane in where]
        else:
            by_lane.setdefault(where[0], []).append(target.entry_id)
    return {lane: by_lane[lane] for lane in lanes.all if lane in by_lane}, missing, ambiguous


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


def retry(r: redis.Redis, q: keys.QueueRef, ids: Sequence[str] | None, *, max_queue_length: int,
          drop_deadline: bool = False, until_full: bool = False) -> RetryOutcome:
    """Re-enqueue the letters of complete entry ids ``ids`` (None: every letter there when it
    starts); a page that would pass ``max_queue_length`` raises :class:`QueueFull` (earlier
    pages stay moved), or with ``until_full`` ends it with ``outcome.full`` set."""
    script = functions.Function(r, "dlq_retry")  # dlq_retry.lua, by FCALL
    outcome = RetryOutcome()
    if ids is None:
        newest: list[tuple[bytes, Any]] = r.xrevrange(  # type: ignore[assignment]  # as in _pages
            keys.dead(q), "+", "-", count=1)
        outcome.last_id = newest[0][0].decode() if newest else None
        pages: Iterator[Sequence[str]] = iter(()) if outcome.last_id is None else _pages(
            r, q, outcome.last_id)
    else:
        pages = (ids[i:i + _PAGE] for i in range(0, len(ids), _PAGE))
    for page in pages:
        try:
            answers = script(keys=[keys.dead(q), keys.requests(q)],
                             args=[max_queue_length, "1" if drop_deadline else "0", *page])
        except redis.ResponseError as exc:
            full = lua_scripts.parse_queue_full(str(exc))
            if full is None:
                raise
            lane = "" if q.shard is None else f"shard {q.shard} of "  # the limit is per lane
            outcome.full = (f"{lane}queue {q.name!r} holds {full.length} of at most "
                            f"{full.limit} requests; moved "
                            f"{plural(len(outcome.moved), 'dead letter')} before it filled")
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


def _skip_reason(answer: list[bytes]) -> str:
    kind = answer[0].decode(errors="replace") if answer else ""
    detail = answer[1].decode(errors="replace") if len(answer) > 1 else ""
    if kind == "truncated":
        return (f"truncated: the worker cut {detail or 'some fields'} to fit its dead-letter "
                "size cap, so it is not the request as written")
    return "it holds no request fields, only dead_* ones: nothing to put back"


def purge(r: redis.Redis, q: keys.QueueRef, ids: Sequence[str] | None) -> tuple[int, list[str]]:
    """Delete the letters of complete entry ids ``ids`` (None: the whole dead stream): (how
    many, the named ids not there)."""
    if ids is None:
        dead = keys.dead(q)

        def drop(pipe: redis.client.Pipeline) -> None:
            kind = as_text(pipe.type(dead))
            if kind not in ("stream", "none"):  # never DEL what is not a dead stream
                raise redis.ResponseError(
                    f"WRONGTYPE {dead} is a {kind}, not a stream: not deleted")
            pipe.multi()
            pipe.xlen(dead)
            pipe.delete(dead)

        removed, _ = r.transaction(drop, dead)  # type: ignore[misc]  # redis-py: list | None
        return int(removed), []
    missing: list[str] = []
    removed = 0
    for start in range(0, len(ids), _PAGE):
        page = ids[start:start + _PAGE]
        deleted = pipelined(r, lambda pipe, one: pipe.xdel(keys.dead(q), one), page)
        for one, n in zip(page, deleted, strict=True):
            if int(n):
                removed += 1
            else:
                missing.append(one)
    return removed, missing
