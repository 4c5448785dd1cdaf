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
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from tokenq.shared import keys, lua
from tokenq.shared.cli import plural
from tokenq.shared.dead_letter import DeadLetter, parse_letter
from tokenq.shared.errors import QueueFull

RETRY_SCRIPT = lua.load("tokenq.producer", "dlq_retry.lua")
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


def count(r: redis.Redis, q: keys.QueueRef) -> int:
    return int(r.xlen(keys.dead(q)))


def list_letters(
    r: redis.Redis, q: keys.QueueRef, *, limit: int, ids: Sequence[str] = ()
) -> list[DeadLetter]:
    """The oldest ``limit`` dead letters, or the ones named by ``ids`` (complete ids)."""
    if ids:
        with r.pipeline(transaction=False) as pipe:
            for one in ids:
                pipe.xrange(keys.dead(q), one, one)
            found = pipe.execute()
        return [parse_letter(i, f) for entries in found for i, f in entries]
    return [parse_letter(i, f) for i, f in r.xrange(keys.dead(q), "-", "+", count=limit)]


def last_id(r: redis.Redis, q: keys.QueueRef) -> str | None:
    """The dead stream's newest entry id, or None when it is empty."""
    newest = r.xrevrange(keys.dead(q), "+", "-", count=1)
    return newest[0][0].decode() if newest else None


def _pages(r: redis.Redis, q: keys.QueueRef, end: str) -> Iterator[list[str]]:
    """Dead entry ids up to ``end``, a page at a time (each handled before the next read)."""
    start = "-"
    while True:
        entries = r.xrange(keys.dead(q), start, end, count=_PAGE)
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
) -> RetryOutcome:
    """Re-enqueue the named letters (``ids=None``: every letter there when it starts).

    Truncated letters are skipped and stay in the dead stream. Raises
    :class:`QueueFull` when a page would push the queue past
    ``max_queue_length``; pages already moved stay moved.
    """
    script = r.register_script(RETRY_SCRIPT)
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
            full = lua.parse_queue_full(str(exc))
            if full is None:
                raise
            raise QueueFull(
                f"queue {q.name!r} holds {full.length} of at most {full.limit} requests; "
                f"moved {plural(len(outcome.moved), 'dead letter')} before it filled"
            ) from None
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

        removed, _ = r.transaction(drop, dead)
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
