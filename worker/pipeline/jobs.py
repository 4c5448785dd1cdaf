"""Turning stream entries into jobs the packer can batch.

A *job* is one decoded request with its exact token encoding. This module
decides, for each entry read from the stream, whether it becomes a job or an
immediate error reply (undecodable, past its deadline, over-long under the
``reject`` policy). It does no Redis I/O; tokenization is the backend's and
runs in a thread the caller provides.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenq.shared import wire
from tokenq.shared.errors import DecodeError, ErrorCode
from tokenq.worker.backends.base import Backend, Encoding, TextInput
from tokenq.worker.pipeline.chunks import combine_chunks

log = logging.getLogger("tokenq.worker")


@dataclass(slots=True)
class ChunkGroup:
    """The windows of one over-long request under the ``chunk`` policy.

    Each window is packed as its own sequence (possibly into different
    batches); the request is answered, and its entry acked, only when every
    window has a result, with their length-weighted mean.
    """

    lengths: list[int]
    results: dict[int, np.ndarray] = field(default_factory=dict)
    failure: tuple[str, str] | None = None

    @property
    def complete(self) -> bool:
        return self.failure is not None or len(self.results) == len(self.lengths)

    def combined(self, normalize: bool) -> np.ndarray:
        vectors = [self.results[index] for index in range(len(self.lengths))]
        return combine_chunks(vectors, self.lengths, normalize)


@dataclass(frozen=True, slots=True)
class Job:
    """A request (or one window of a chunked request) that is ready to be packed."""

    entry_id: bytes
    request: wire.Request
    encoding: Encoding
    read_ms: float
    """Monotonic ms when the worker read it (the packer's arrival time)."""
    chunk: ChunkGroup | None = None
    chunk_index: int = 0


@dataclass(frozen=True, slots=True)
class Answer:
    """A reply the worker owes for one stream entry, ready to publish."""

    entry_id: bytes
    reply_to: str | None
    """None when the entry was too broken to name one: acked without a reply."""
    payload: bytes
    ok: bool
    dead_fields: tuple[tuple[bytes | str, bytes | str], ...] = ()
    """When not empty, the entry is also copied to the dead stream with these fields."""


def error_answer(entry_id: bytes, request_id: str, reply_to: str | None,
                 code: ErrorCode, message: str) -> Answer:
    """An error reply for one entry."""
    reply = wire.error_reply(request_id, code.value, message)
    return Answer(entry_id, reply_to, wire.encode_reply(reply), ok=False)


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
    """Bytes of the entry's own fields a dead letter keeps (see :func:`capped_fields`)."""


TRUNCATED_FIELD = "dead_truncated"
"""Names the fields a dead letter cut to stay within its caps (comma-separated)."""

MAX_LETTER_FIELDS = 256
"""Most of an entry's own fields a dead letter keeps (a stream entry may have thousands;
``publish.lua`` builds its XADD on Lua's stack, which holds about 8,000 values)."""

MAX_TRUNCATED_NAMES = 16
"""Most field names ``dead_truncated`` lists; any further cut is counted as ``+N more``."""

_DEAD_PREFIX = b"dead_"


def capped_fields(
    fields: Mapping[bytes | str, bytes | str], max_bytes: int
) -> tuple[list[tuple[bytes, bytes]], str]:
    """An entry's fields for its dead letter within the caps, and the ``dead_truncated`` value.

    Fields are kept in order while ``max_bytes`` and :data:`MAX_LETTER_FIELDS`
    last; a value that does not fit is cut to what is left (so a huge ``text``
    keeps its beginning, enough to recognise it), and any field past a cap is
    dropped. Earlier ``dead_*`` fields (a letter retried and dead again) are
    left out, as the new ones replace them. The names cut, each at most 64
    characters, at most :data:`MAX_TRUNCATED_NAMES` of them and then a count,
    make the second value ("" when nothing was cut), so the letter's size is
    bounded whatever the entry holds. ``publish.lua`` applies the same rule
    when it dead-letters from the stream itself.
    """
    kept: list[tuple[bytes, bytes]] = []
    cut: list[str] = []
    room = max_bytes
    for key, value in fields.items():
        name = key if isinstance(key, bytes) else key.encode("utf-8", "surrogatepass")
        if name.startswith(_DEAD_PREFIX):
            continue
        data = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
        label = name[:64].decode("utf-8", "replace")
        if len(name) > room or len(kept) >= MAX_LETTER_FIELDS:
            cut.append(label)
            continue
        room -= len(name)
        if len(data) > room:
            cut.append(label)
            data = data[:room]
        room -= len(data)
        kept.append((name, data))
    return kept, truncated_names(cut)


def truncated_names(cut: Sequence[str]) -> str:
    """The ``dead_truncated`` value for the names cut, in order, bounded."""
    shown = ",".join(cut[:MAX_TRUNCATED_NAMES])
    more = len(cut) - MAX_TRUNCATED_NAMES
    return f"{shown},+{more} more" if more > 0 else shown


def dead_answer(
    entry_id: bytes,
    fields: Mapping[bytes, bytes],
    code: ErrorCode,
    message: str,
    *,
    policy: DeadLetterPolicy,
    deliveries: int,
    now_epoch_ms: int,
) -> Answer:
    """Answer an entry with an error and move it to the dead stream, fields and all.

    The dead entry keeps the original fields (so ``tokenq dlq retry`` can
    re-enqueue it as it was) plus ``dead_*`` fields saying why, who and when.
    """
    known_id = wire.request_id_of(fields)
    request_id = known_id or entry_id.decode()
    reply_to = wire.reply_to_of(fields)
    if reply_to is not None and policy.check_reply_to(reply_to) is not None:
        reply_to = None  # never written to; the request's own reply key is told instead
    if reply_to is None and known_id is not None:
        reply_to = policy.default_reply_to(known_id)
    original, cut = capped_fields(fields, policy.max_letter_bytes)
    truncated = ((TRUNCATED_FIELD, cut),) if cut else ()
    record = (
        *original,
        *truncated,
        ("dead_error_code", code.value),
        ("dead_error", message),
        ("dead_worker", policy.worker),
        ("dead_deliveries", str(deliveries)),
        ("dead_at_ms", str(now_epoch_ms)),
        ("dead_source_id", entry_id),
    )
    reply = wire.error_reply(request_id, code.value, message)
    return Answer(entry_id, reply_to, wire.encode_reply(reply), ok=False, dead_fields=record)


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
    """Decode raw entries; dead-letter the broken and the over-delivered, answer the expired.

    ``deliveries`` gives, for entries claimed from another worker, how many
    times each has now been delivered (entries read fresh are on their first).
    An entry delivered more than ``policy.max_deliveries`` times has been in
    the hands of workers that died on it, so it is not tried again. Nothing
    an entry contains can make this raise: every entry ends as a request or
    an answer.
    """
    out = Decoded(requests=[], answers=[])
    for entry_id, fields in entries:
        count = deliveries.get(entry_id, 1)
        dead = functools.partial(
            dead_answer, entry_id, fields,
            policy=policy, deliveries=count, now_epoch_ms=now_epoch_ms,
        )

        if count > policy.max_deliveries:
            out.answers.append(dead(
                ErrorCode.DEAD_LETTER,
                f"delivered {count} times without an answer (max_deliveries "
                f"{policy.max_deliveries}): the workers holding it died; moved to dead letters",
            ))
            continue
        try:
            request = wire.decode_request(
                fields,
                max_request_bytes=policy.max_request_bytes,
                default_reply_to=policy.default_reply_to,
                check_reply_to=policy.check_reply_to,
            )
        except DecodeError as exc:
            out.answers.append(dead(ErrorCode.BAD_REQUEST, str(exc)))
            continue
        except Exception as exc:  # a decoder bug must not take the worker down
            log.exception("unexpected error decoding entry %s", entry_id)
            out.answers.append(dead(
                ErrorCode.BAD_REQUEST, f"entry could not be decoded: {type(exc).__name__}: {exc}"
            ))
            continue
        deadline = wire.deadline_of(request, entry_id)
        if deadline is not None and deadline <= now_epoch_ms:
            out.answers.append(expired_answer(entry_id, request, deadline, now_epoch_ms))
            continue
        out.requests.append((entry_id, request))
    return out


def expired_answer(
    entry_id: bytes, request: wire.Request, deadline_ms: int, now_epoch_ms: int
) -> Answer:
    """The ``deadline_exceeded`` answer; both times are on Redis's clock."""
    late = now_epoch_ms - deadline_ms
    return error_answer(
        entry_id,
        request.id,
        request.reply_to,
        ErrorCode.DEADLINE_EXCEEDED,
        f"deadline passed {late} ms before the request could run",
    )


def tokenize_requests(
    backend: Backend,
    requests: Sequence[tuple[bytes, wire.Request]],
    *,
    policy: str,
    read_ms: float,
    chunk_overlap: int = 0,
) -> tuple[list[Job], list[Answer]]:
    """Exact token lengths for a read, with the over-length policy applied.

    ``truncate`` cuts each input to the model's limit; ``reject`` answers an
    over-long input with an error naming its length and the limit; ``chunk``
    splits it into overlapping windows (``backend.windows``), each its own
    job. Runs in a worker thread (the tokenizer is CPU-bound).
    """
    limit = backend.info.max_input_tokens
    answers: list[Answer] = []
    valid: list[tuple[bytes, wire.Request]] = []
    for entry_id, request in requests:
        if request.text_pair is not None and not backend.info.pairs:
            answers.append(error_answer(
                entry_id, request.id, request.reply_to, ErrorCode.BAD_REQUEST,
                f"this queue's model ({backend.info.model}) takes single texts, "
                "but the request carries a text_pair",
            ))
            continue
        valid.append((entry_id, request))
    if not valid:
        return [], answers
    inputs = [TextInput(req.text, req.text_pair) for _, req in valid]
    max_length = limit if policy == "truncate" else None
    encodings = backend.tokenize(inputs, max_length)
    jobs: list[Job] = []
    for (entry_id, request), encoding in zip(valid, encodings, strict=True):
        if encoding.length > limit and policy == "chunk" and request.text_pair is None:
            windows = backend.windows(encoding, limit, chunk_overlap)  # type: ignore[attr-defined]
            group = ChunkGroup(lengths=[window.length for window in windows])
            jobs += [
                Job(entry_id, request, window, read_ms, chunk=group, chunk_index=index)
                for index, window in enumerate(windows)
            ]
            continue
        if encoding.length > limit:
            answers.append(error_answer(
                entry_id, request.id, request.reply_to, ErrorCode.TOO_LONG,
                f"input is {encoding.length} tokens, over the model's limit of {limit} "
                f"(queue policy: {policy})",
            ))
            continue
        jobs.append(Job(entry_id, request, encoding, read_ms))
    return jobs, answers
