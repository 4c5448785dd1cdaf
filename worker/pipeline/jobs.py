"""Stream entries in, answers out: the Redis side of the request pipeline."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tokenq.shared import dead_letter, keys, wire
from tokenq.shared.errors import DecodeError, ErrorCode

log = logging.getLogger("tokenq.worker")


@dataclass(slots=True)
class Answer:
    """A reply the worker owes for one stream entry, ready to publish."""

    entry_id: bytes
    reply_to: str | None
    """None when the entry was too broken to name one: acked without a reply."""
    payload: bytes
    ok: bool
    dead_fields: tuple[tuple[bytes | str, bytes | str], ...] = ()
    """When not empty, the entry is also copied to the dead stream with these fields."""
    code: str | None = None
    """The error code of a failed reply (what metrics count), None otherwise."""
    counted: int = 0
    """The entry's counted tokens as read at delivery (:attr:`wire.Request.counted`), which
    publishing it takes off the queue's pending tokens; 0 for an entry no script counted, or
    one already taken off (deleted, or taken by ``claim_excess``)."""

    @property
    def outcome(self) -> str | None:
        """``ok``, the error code, or None for an entry acked with no reply."""
        return "ok" if self.ok else self.code


def error_answer(entry_id: bytes, request_id: str, reply_to: str | None,
                 code: ErrorCode, message: str) -> Answer:
    """An error reply for one entry."""
    reply = wire.error_reply(request_id, code.value, message)
    return Answer(entry_id, reply_to, wire.encode_reply(reply), ok=False, code=code.value)


@dataclass(frozen=True, slots=True)
class DeadLetterPolicy:
    """Who is dead-lettering, and the limits that make an entry a dead letter."""

    worker: str
    max_deliveries: int
    default_reply_to: Callable[[str], str]
    max_request_bytes: int
    check_reply_to: Callable[[str], str | None]
    """Why a named reply_to may not be written, or None (the reply namespace rule)."""
    max_letter_bytes: int
    """Bytes of the entry's own fields a dead letter keeps (the cap in shared/dead_letter.py)."""
    tenant: str = keys.DEFAULT_TENANT
    """Whose stream the entries are read from: the letter names it for ``dlq retry``."""


def dead_answer(
    entry_id: bytes,
    fields: Mapping[bytes, bytes],
    code: ErrorCode,
    message: str,
    *,
    policy: DeadLetterPolicy,
    deliveries: int,
    now_epoch_ms: int,
    counts: bool = True,
) -> Answer:
    """Answer an entry with an error and move it to the dead stream, original fields
    (for ``tokenq dlq retry``) plus ``dead_*`` fields saying why, who and when."""
    known_id = wire.request_id_of(fields)
    request_id = known_id or entry_id.decode()
    reply_to = wire.reply_to_of(fields)
    if reply_to is not None and policy.check_reply_to(reply_to) is not None:
        reply_to = None  # never written to; the request's own reply key is told instead
    if reply_to is None and known_id is not None:
        reply_to = policy.default_reply_to(known_id)
    death = dead_letter.Death(code.value, message, policy.worker, deliveries, now_epoch_ms,
                              entry_id.decode(), policy.tenant)
    record = dead_letter.encode_letter(fields, death, max_bytes=policy.max_letter_bytes)
    answer = error_answer(entry_id, request_id, reply_to, code, message)
    return dataclasses.replace(answer, dead_fields=record,
                               counted=wire.counted_of(fields) if counts else 0)


@dataclass(slots=True)
class Decoded:
    """Result of decoding a read: good requests and the answers owed for bad ones."""

    requests: list[tuple[bytes, wire.Request]]
    answers: list[Answer]


def decode_entries(
    entries: Sequence[tuple[bytes, Mapping[bytes, bytes]]],
    *,
    policy: DeadLetterPolicy,
    deliveries: Mapping[bytes, int],
    now_epoch_ms: int,
) -> Decoded:
    """Decode raw entries; dead-letter the broken and the over-delivered."""
    out = Decoded(requests=[], answers=[])
    # One helper for the read, not one per entry: a good entry costs no object here.
    dead_letter = functools.partial(dead_answer, policy=policy, now_epoch_ms=now_epoch_ms)
    for entry_id, fields in entries:
        count = deliveries.get(entry_id, 1) if deliveries else 1
        if count > policy.max_deliveries:
            why = ErrorCode.DEAD_LETTER, (
                f"delivered {count} times without an answer (max_deliveries "
                f"{policy.max_deliveries}): the workers holding it died; moved to dead letters")
        else:
            try:
                out.requests.append((entry_id, wire.decode_fields(
                    fields, max_request_bytes=policy.max_request_bytes,
                    default_reply_to=policy.default_reply_to,
                    check_reply_to=policy.check_reply_to)))
                continue
            except DecodeError as exc:
                why = ErrorCode.BAD_REQUEST, str(exc)
            except Exception as exc:  # a decoder bug must not take the worker down
                log.exception("unexpected error decoding entry %s", entry_id)
                why = ErrorCode.BAD_REQUEST, (
                    f"entry could not be decoded: {type(exc).__name__}: {exc}")
        out.answers.append(dead_letter(entry_id, fields, *why, deliveries=count))
    return out
