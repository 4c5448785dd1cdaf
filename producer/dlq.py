"""Dead letters: read them, put them back on the queue, or delete them.

A worker moves a request it could not answer after ``max_deliveries`` to
``keys.dead(q)`` with its original fields plus ``dead_error_code``,
``dead_error``, ``dead_worker``, ``dead_deliveries``, ``dead_at_ms`` and
``dead_source_id``. Retrying re-adds the original fields to the request
stream and deletes the letter in one Lua script (``dlq_retry.lua``), so a
letter is never lost or doubled, and the queue's length limit still holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from tokenq.shared import keys
from tokenq.shared.errors import QueueFull

DEAD_PREFIX = "dead_"
RETRY_SCRIPT = resources.files("tokenq.producer").joinpath("dlq_retry.lua").read_text("utf-8")
_PAGE = 100


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One entry of the dead stream, split into the request and why it died."""

    entry_id: str
    request: dict[str, str | bytes]
    dead: dict[str, str]

    @property
    def request_id(self) -> str:
        value = self.request.get("id", "")
        return value if isinstance(value, str) else value.decode(errors="replace")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: text fields as strings, binary ones (``opts``) as hex."""
        request = {
            name: value if isinstance(value, str) else {"hex": value.hex()}
            for name, value in self.request.items()
        }
        return {
            "entry_id": self.entry_id,
            "request_id": self.request_id,
            "error_code": self.dead.get("dead_error_code"),
            "error": self.dead.get("dead_error"),
            "worker": self.dead.get("dead_worker"),
            "deliveries": _int(self.dead.get("dead_deliveries")),
            "at_ms": _int(self.dead.get("dead_at_ms")),
            "source_id": self.dead.get("dead_source_id"),
            "request": request,
        }


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _letter(entry_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    request: dict[str, str | bytes] = {}
    dead: dict[str, str] = {}
    for raw_name, raw_value in fields.items():
        name = raw_name.decode(errors="replace")
        if name.startswith(DEAD_PREFIX):
            dead[name] = raw_value.decode(errors="replace")
            continue
        try:
            request[name] = raw_value.decode()
        except UnicodeDecodeError:
            request[name] = raw_value
    return DeadLetter(entry_id.decode(), request, dead)


def count(r: redis.Redis, q: keys.QueueRef) -> int:
    return int(r.xlen(keys.dead(q)))


def list_letters(
    r: redis.Redis, q: keys.QueueRef, *, limit: int, ids: Sequence[str] = ()
) -> list[DeadLetter]:
    """The oldest ``limit`` dead letters, or the ones named by ``ids``."""
    if ids:
        letters = []
        for entry_id in ids:
            letters += [_letter(i, f) for i, f in r.xrange(keys.dead(q), entry_id, entry_id)]
        return letters
    return [_letter(i, f) for i, f in r.xrange(keys.dead(q), "-", "+", count=limit)]


def _pages(r: redis.Redis, q: keys.QueueRef) -> Iterator[list[str]]:
    """All dead entry ids, a page at a time (each page is handled before the next read)."""
    start = "-"
    while True:
        entries = r.xrange(keys.dead(q), start, "+", count=_PAGE)
        if not entries:
            return
        yield [entry_id.decode() for entry_id, _ in entries]
        start = "(" + entries[-1][0].decode()


def retry(
    r: redis.Redis,
    q: keys.QueueRef,
    ids: Sequence[str] | None,
    *,
    max_queue_length: int,
    drop_deadline: bool = False,
) -> tuple[list[str], list[str]]:
    """Re-enqueue the named letters (``ids=None``: all); returns (moved ids, missing ids).

    Raises :class:`QueueFull` when a page would push the queue past
    ``max_queue_length``; pages already moved stay moved.
    """
    script = r.register_script(RETRY_SCRIPT)
    pages = _pages(r, q) if ids is None else (list(ids[i:i + _PAGE])
                                              for i in range(0, len(ids), _PAGE))
    moved: list[str] = []
    missing: list[str] = []
    for page in pages:
        try:
            new_ids = script(keys=[keys.dead(q), keys.requests(q)],
                             args=[max_queue_length, "1" if drop_deadline else "0", *page])
        except redis.ResponseError as exc:
            if str(exc).startswith("QUEUEFULL"):
                _, xlen, limit = str(exc).split()
                raise QueueFull(
                    f"queue {q.name!r} holds {xlen} of at most {limit} requests; "
                    f"moved {len(moved)} dead letters before it filled"
                ) from None
            raise
        for entry_id, new_id in zip(page, new_ids, strict=True):
            (moved if new_id else missing).append(entry_id)
    return moved, missing


def purge(r: redis.Redis, q: keys.QueueRef, ids: Sequence[str] | None) -> int:
    """Delete the named letters (``ids=None``: the whole dead stream); returns how many."""
    if ids is None:
        with r.pipeline(transaction=True) as pipe:
            pipe.xlen(keys.dead(q))
            pipe.delete(keys.dead(q))
            removed, _ = pipe.execute()
        return int(removed)
    removed = 0
    for start in range(0, len(ids), _PAGE):
        removed += int(r.xdel(keys.dead(q), *ids[start:start + _PAGE]))
    return removed
