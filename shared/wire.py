"""The wire format (docs/PROTOCOL.md): a request is one stream entry, a reply one msgpack map on
its ``reply_to`` list. Sans-I/O; every problem is a :class:`DecodeError` naming the field."""

from __future__ import annotations

import array
import itertools
import re
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tokenq.shared.errors import DecodeError

PROTOCOL_VERSION = 1
MAX_ID_CHARS = 128
MAX_REPLY_TO_CHARS = 512
MAX_OPTS_BYTES = 64 * 1024
MAX_PARAM_CHARS = 64
"""Longest field name an error reply's ``param`` may carry (an option's name, never a value)."""
DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024
"""Default cap on the UTF-8 size of ``text`` plus ``text_pair`` in one request."""
MAX_REPLY_BYTES = 64 * 1024 * 1024
MAX_TOKEN_EMBEDDING_FLOATS = 4 * 1024 * 1024
"""Most floats one ``output: tokens`` reply may carry (16 MiB of float32)."""
MAX_TOKENS = 1 << 24
"""Largest ``tokens`` estimate accepted: past any model's input, no sum of them overflows."""
MAX_EPOCH_MS = 253_402_300_799_999
"""Largest absolute ``deadline_ms``: the last millisecond of the year 9999."""
MAX_TIMEOUT_MS = 30 * 24 * 3600 * 1000
MAX_PRIORITY = 9
"""Largest ``priority``; 0 (the default) is the lowest class."""
_MAX_VERSION = 1_000_000
COUNTED_FIELD = "counted"
"""The first field tokenq's scripts write into an entry: its tokens in the queue's pending tokens
(docs/PROTOCOL.md, "Pending tokens"); never a producer's, and not part of the request."""
_COUNTED_BYTES = COUNTED_FIELD.encode()
RANGES = {"tokens": (0, MAX_TOKENS), "deadline_ms": (0, MAX_EPOCH_MS),
          "timeout_ms": (1, MAX_TIMEOUT_MS), "priority": (0, MAX_PRIORITY)}
"""Each numeric request field's bounds, inclusive: what encoding and decoding both check."""
_FIELD_OVERHEAD_BYTES = 512
"""Room for the field names and numeric fields of one entry."""


def max_entry_bytes(max_request_bytes: int) -> int:
    """The largest stream entry a producer can write (names and values, raw bytes); the
    worker's read-ahead counts every entry as this large. Decoding refuses a larger one."""
    return (max_request_bytes + MAX_OPTS_BYTES + 4 * (MAX_ID_CHARS + MAX_REPLY_TO_CHARS)
            + _FIELD_OVERHEAD_BYTES)

_MAX_INT_DIGITS = 19
"""A numeric field longer than this is refused before it is parsed (no bignum work)."""
_DECIMAL = re.compile(rb"[0-9]{1,19}")
_SHORT_DIGITS = 10
"""A token count of fewer ASCII digits is parsed inline, without :func:`_int_field`."""
_packers = threading.local()


def pack(value: object) -> bytes:
    """``msgpack.packb(value, use_bin_type=True)`` through this thread's own Packer (half the
    cost: ``packb`` builds one per call)."""
    return _thread_packer().pack(value)


def _thread_packer() -> msgpack.Packer:
    """This thread's own msgpack Packer (its buffer must not be shared by two threads)."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer


_VERSION_BYTES = str(PROTOCOL_VERSION).encode()
_ID_REFUSED = re.compile(r"[\s\x00-\x1f]")
"""Characters an id may not hold: whitespace (as ``str.isspace`` sees it) and controls."""

@dataclass(slots=True)
class Request:
    """One input sequence (or query/passage pair) to run through the model. Not frozen: made
    per request on the hot path (docs/decisions/0024-per-request-records-not-frozen.md)."""

    id: str
    text: str
    tokens: int
    reply_to: str
    deadline_ms: int | None = None
    """Absolute deadline on the *producer's* clock (epoch ms)."""
    text_pair: str | None = None
    opts: Mapping[str, Any] = field(default_factory=dict)
    timeout_ms: int | None = None
    """Relative deadline: ms after the entry's stream id, i.e. on Redis's clock."""
    priority: int = 0
    """Scheduling class, 0 to :data:`MAX_PRIORITY`: higher goes first (docs/PROTOCOL.md)."""
    counted: int = 0
    """Its tokens in the queue's pending tokens (:func:`counted_of`): what publishing it takes
    off the sum."""

    def utf8_size(self) -> int:
        """Bytes of text this request carries (what the size limit counts)."""
        size = len(self.text.encode("utf-8"))
        if self.text_pair is not None:
            size += len(self.text_pair.encode("utf-8"))
        return size


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """Why a request failed: a stable code (see ErrorCode) and a human message."""

    code: str
    message: str
    param: str | None = None
    """The request field at fault (an ``opts`` key), when the worker knows it."""


@dataclass(frozen=True, slots=True)
class Reply:
    """What a worker answers: an embedding, scores, or an error."""

    id: str
    ok: bool
    embedding: bytes | None = None
    dim: int | None = None
    scores: tuple[float, ...] | None = None
    error: ErrorInfo | None = None
    tokens: int | None = None
    labels: tuple[str, ...] | None = None
    """A classifier's label for each score, in the scores' order (None when it names none)."""
    sparse_indices: bytes | None = None
    """A sparse (SPLADE) row's nonzero positions: little-endian uint32, increasing, < ``dim``."""
    sparse_values: bytes | None = None
    """Their weights: little-endian float32, one per index."""
    token_embeddings: bytes | None = None
    """``output: tokens``: one ``dim``-long vector per token, little-endian float32, in order."""
    truncated: bool = False
    """The input was cut to the model's limit (``tokens`` counts what was read)."""

    def embedding_array(self) -> array.array[float] | None:
        """The embedding as ``array('f')`` in this machine's byte order (None without one)."""
        return None if self.embedding is None else _le_array("f", self.embedding)

    def token_vectors(self) -> list[array.array[float]]:
        """A token-embeddings reply's vectors, one ``array('f')`` per token ([] otherwise)."""
        if self.token_embeddings is None or not self.dim:
            return []
        flat = _le_array("f", self.token_embeddings)
        return [flat[start:start + self.dim] for start in range(0, len(flat), self.dim)]

    def sparse_pairs(self) -> list[tuple[int, float]]:
        """A sparse reply's (token id, weight) pairs, in increasing token id ([] otherwise)."""
        if self.sparse_indices is None or self.sparse_values is None:
            return []
        indices = _le_array("I", self.sparse_indices).tolist()
        values = _le_array("f", self.sparse_values).tolist()
        return list(zip(indices, values, strict=True))


def _le_array(typecode: str, data: bytes) -> Any:
    """``array.array(typecode)`` of little-endian bytes, in this machine's byte order."""
    values = array.array(typecode)  # "I" and "f" are 4 bytes wherever CPython runs
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def validate_text(value: object, field_name: str, max_bytes: int) -> str:
    """Check a text the caller wants to enqueue; raise DecodeError naming the problem."""
    if not isinstance(value, str):
        raise DecodeError(f"{field_name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DecodeError(f"{field_name} is empty")
    try:
        # ASCII (most texts) is one byte a character: its size without encoding it.
        size, invalid = len(value) if value.isascii() else len(value.encode("utf-8")), None
    except UnicodeEncodeError as exc:  # lone surrogates: the size is still checked first
        size, invalid = len(value.encode("utf-8", errors="surrogatepass")), exc.reason
    if size > max_bytes:
        raise DecodeError(f"{field_name} is {size} bytes, over the limit of {max_bytes} bytes")
    if invalid is not None:
        raise DecodeError(f"{field_name} is not valid Unicode: {invalid}")
    return value


def validate_priority(value: object) -> int:
    """A caller's priority: an int from 0 to :data:`MAX_PRIORITY` (None means 0)."""
    return 0 if value is None else _check_range("priority", value, *RANGES["priority"])


def validate_id(value: object, field_name: str = "id") -> str:
    if not isinstance(value, str) or not value:
        raise DecodeError(f"{field_name} must be a non-empty string")
    if len(value) > MAX_ID_CHARS:
        raise DecodeError(f"{field_name} is longer than {MAX_ID_CHARS} characters")
    # Printable ASCII with no space holds nothing the regex refuses (every other
    # ASCII whitespace character is a control): three C calls answer most ids.
    if value.isascii() and value.isprintable() and " " not in value:
        return value
    if _ID_REFUSED.search(value):
        raise DecodeError(f"{field_name} must not contain whitespace or control characters")
    return value


def encode_request(request: Request) -> dict[str, str | bytes]:
    """Stream fields for one request, ready for XADD (ranges checked as decoding checks them)."""
    tokens = _check_range("tokens", request.tokens, *RANGES["tokens"])
    fields: dict[str, str | bytes] = {"v": str(PROTOCOL_VERSION), "id": request.id,
                                      "text": request.text, "tokens": str(tokens),
                                      "reply_to": request.reply_to}
    if request.text_pair is not None:
        fields["text_pair"] = request.text_pair
    for name in ("deadline_ms", "timeout_ms", "priority"):
        value = getattr(request, name)
        if value is not None and (value or name != "priority"):  # priority 0 goes unwritten
            fields[name] = str(_check_range(name, value, *RANGES[name]))
    if request.opts:
        packed = pack(dict(request.opts))
        if len(packed) > MAX_OPTS_BYTES:
            raise DecodeError(f"opts is {len(packed)} bytes packed, over {MAX_OPTS_BYTES}")
        fields["opts"] = packed
    return fields


def call_fields(
    opts: Mapping[str, Any], timeout_ms: int | None, priority: int
) -> dict[str, str | bytes]:
    """The fields one call's requests share, encoded once (:func:`own_fields` adds each
    request's); a ``text_pair`` placeholder holds that field's place in the order."""
    return encode_request(Request(id="", text="", tokens=0, reply_to="", text_pair="", opts=opts,
                                  timeout_ms=timeout_ms, priority=priority))


def own_fields(shared: Mapping[str, str | bytes], request_id: str, text: str, tokens: int,
               reply_to: str, text_pair: str | None) -> dict[str, str | bytes]:
    """:func:`encode_request`'s fields for one request of a call (``shared``: its
    :func:`call_fields`); ``tokens`` checked by the caller."""
    fields = dict(shared, id=request_id, text=text, tokens=str(tokens), reply_to=reply_to)
    if text_pair is None:
        del fields["text_pair"]
    else:
        fields["text_pair"] = text_pair
    return fields


def _check_range(name: str, value: object, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise DecodeError(f"{name} must be an integer from {minimum} to {maximum}, got {value!r}")
    return value


def _text_field(raw: bytes, name: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError(f"field {name!r} is not valid UTF-8") from None


def _int_field(raw: bytes, name: str, minimum: int, maximum: int) -> int:
    """Plain ASCII digits in ``[minimum, maximum]`` (no sign, space or ``_``), else a DecodeError
    naming the limit; a field too long to be in range is refused before any bignum work."""
    if len(raw) > _MAX_INT_DIGITS and raw.lstrip(b"0").isdigit():
        raise DecodeError(
            f"field {name!r} is out of range: at most {maximum}, got a {len(raw)}-digit number"
        )
    # bytes.isdigit is ASCII digits only: the regex's answer without running it.
    if not (raw.isdigit() and len(raw) <= _MAX_INT_DIGITS) and not _DECIMAL.fullmatch(raw):
        raise DecodeError(
            f"field {name!r} must be a decimal integer from {minimum} to {maximum}, "
            f"got {raw[:40]!r}"
        )
    value = int(raw)
    if not minimum <= value <= maximum:
        raise DecodeError(f"field {name!r} is out of range: {minimum} to {maximum}, got {value}")
    return value


def decode_request(fields: Mapping[bytes | str, bytes | str], **options: Any) -> Request:
    """:func:`decode_fields` of an entry whose names and values may be str."""
    return decode_fields({_as_bytes(key): _as_bytes(value) for key, value in fields.items()},
                         **options)


def _as_bytes(value: bytes | str) -> bytes:
    # surrogatepass: a lone surrogate fails decoding's UTF-8 check instead of raising here.
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value


def decode_fields(
    raw: Mapping[bytes, bytes],
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    default_reply_to: Callable[[str], str] | None = None,
    check_reply_to: Callable[[str], str | None] | None = None,
) -> Request:
    """One entry's fields, bytes as Redis returns them, as a :class:`Request` (every decoding
    rule lives here). ``default_reply_to`` maps an id to its reply key when the entry names
    none; ``check_reply_to`` says why a named ``reply_to`` may not be written (None: it may)."""
    get = raw.get
    version = get(b"v")
    if version is None:
        raise DecodeError("missing field 'v' (protocol version)")
    if version != _VERSION_BYTES and _int_field(
        version, "v", minimum=0, maximum=_MAX_VERSION
    ) != PROTOCOL_VERSION:
        raise DecodeError(
            f"unsupported protocol version {version!r}; this worker speaks {PROTOCOL_VERSION}"
        )
    id_raw, text_raw = get(b"id"), get(b"text")
    if id_raw is None:
        raise DecodeError("missing field 'id'")
    if text_raw is None:
        raise DecodeError("missing field 'text'")
    # Decoded inline; only a failure goes through _text_field, which names the field.
    try:
        request_id = id_raw.decode()
    except UnicodeDecodeError:
        request_id = _text_field(id_raw, "id")
    validate_id(request_id)

    pair_raw = get(b"text_pair")
    text_bytes = len(text_raw) + (0 if pair_raw is None else len(pair_raw))
    if text_bytes > max_request_bytes:
        raise DecodeError(f"text is {text_bytes} bytes, over the limit of {max_request_bytes}")
    try:
        text = text_raw.decode()
    except UnicodeDecodeError:
        text = _text_field(text_raw, "text")
    if text.isspace() or not text:
        raise DecodeError("field 'text' is empty")
    text_pair = None
    if pair_raw is not None:
        text_pair = _text_field(pair_raw, "text_pair")
        if text_pair.isspace() or not text_pair:
            raise DecodeError("field 'text_pair' is empty")

    tokens_raw = get(b"tokens")
    if tokens_raw is None:
        tokens = 0
    elif not (len(tokens_raw) < _SHORT_DIGITS and tokens_raw.isdigit()
              and (tokens := int(tokens_raw)) <= MAX_TOKENS):
        tokens = _int_field(tokens_raw, "tokens", *RANGES["tokens"])

    reply_raw = get(b"reply_to")
    if reply_raw is not None:
        try:
            reply_to = reply_raw.decode()
        except UnicodeDecodeError:
            reply_to = _text_field(reply_raw, "reply_to")
        if not reply_to or len(reply_to) > MAX_REPLY_TO_CHARS:
            raise DecodeError(f"field 'reply_to' must be 1-{MAX_REPLY_TO_CHARS} characters")
        refused = check_reply_to(reply_to) if check_reply_to is not None else None
        if refused is not None:
            raise DecodeError(f"field 'reply_to' {reply_to[:80]!r} is refused: {refused}")
    elif default_reply_to is not None:
        reply_to = default_reply_to(request_id)
    else:
        raise DecodeError("missing field 'reply_to'")

    # The optional fields: absent and empty both mean "not given".
    deadline_ms = timeout_ms = None
    priority = 0
    opts: dict[str, Any] = {}
    counted = 0
    counted_raw = get(_COUNTED_BYTES)
    if counted_raw is not None:
        counted = counted_of(raw)
    named = (3 + (pair_raw is not None) + (tokens_raw is not None) + (reply_raw is not None)
             + (counted_raw is not None))
    if len(raw) > named:  # anything more: the optional fields (or names no one reads)
        if value := get(b"deadline_ms"):
            deadline_ms = _int_field(value, "deadline_ms", *RANGES["deadline_ms"])
        if value := get(b"timeout_ms"):
            timeout_ms = _int_field(value, "timeout_ms", *RANGES["timeout_ms"])
        if value := get(b"priority"):
            priority = _int_field(value, "priority", *RANGES["priority"])
        if value := get(b"opts"):
            opts = _unpack_opts(value)

    return Request(request_id, text, tokens, reply_to, deadline_ms, text_pair, opts,
                   timeout_ms, priority, counted)


def counted_of(raw: Mapping[bytes, bytes]) -> int:
    """An entry's counted tokens, as the scripts read them (``count_of`` in enqueue.lua): its
    first field's value when that field is :data:`COUNTED_FIELD` and the value 1 to 8 digits
    at most :data:`MAX_TOKENS`, else 0 (never an error: a broken one only counts nothing)."""
    value = raw.get(_COUNTED_BYTES)  # found first: most entries are counted
    if value is None or len(value) > 8 or not value.isdigit() or next(iter(raw)) != _COUNTED_BYTES:
        return 0
    count = int(value)
    return count if count <= MAX_TOKENS else 0


def stream_id_ms(entry_id: bytes | str) -> int | None:
    """The ms part of a stream id (Redis's clock at the XADD); None if not ``<ms>-<seq>``."""
    text = entry_id.decode("ascii", "replace") if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    if not ms.isdigit() or len(ms) > _MAX_INT_DIGITS or (seq and not seq.isdigit()):
        return None
    return int(ms)


def deadline_of(request: Request, entry_id: bytes | str) -> int | None:
    """When a request stops being worth running, in epoch ms: ``timeout_ms`` after the entry's
    stream id (Redis's clock) or ``deadline_ms`` (the producer's), the earlier of the two."""
    deadline = request.deadline_ms
    if request.timeout_ms is not None and (added_ms := stream_id_ms(entry_id)) is not None:
        relative = added_ms + request.timeout_ms
        deadline = relative if deadline is None else min(deadline, relative)
    return deadline


def _unpack_opts(packed: bytes) -> dict[str, Any]:
    if len(packed) > MAX_OPTS_BYTES:
        raise DecodeError(f"field 'opts' is {len(packed)} bytes, over {MAX_OPTS_BYTES}")
    try:
        value = msgpack.unpackb(packed, raw=False, strict_map_key=True, max_array_len=1024,
                                max_map_len=256, max_str_len=MAX_OPTS_BYTES,
                                max_bin_len=MAX_OPTS_BYTES, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"field 'opts' is not valid msgpack: {exc}") from None
    if not isinstance(value, dict):
        raise DecodeError("field 'opts' must be a msgpack map")
    return value


def request_id_of(fields: Mapping[bytes | str, bytes | str]) -> str | None:
    """Best-effort id of an entry that failed to decode, so its caller can be told."""
    text = _text_of(fields, "id")
    try:
        return None if text is None else validate_id(text)
    except DecodeError:
        return None


def reply_to_of(fields: Mapping[bytes | str, bytes | str]) -> str | None:
    """Best-effort reply key of an entry that failed to decode."""
    text = _text_of(fields, "reply_to")
    return text if text is not None and 0 < len(text) <= MAX_REPLY_TO_CHARS else None


def _text_of(fields: Mapping[bytes | str, bytes | str], wanted: str) -> str | None:
    """The field named ``wanted`` as text; None when there is none or it is not UTF-8."""
    value = fields.get(wanted, fields.get(wanted.encode()))
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else value
    except UnicodeDecodeError:
        return None


def _embedding(body: Mapping[str, Any], error: type[Exception]) -> dict[str, Any]:
    embedding, dim = body.get("embedding"), body.get("dim")
    if not (isinstance(embedding, bytes) and type(dim) is int) or len(embedding) != 4 * dim:
        raise error("reply 'embedding' must be 4*dim bytes of float32")
    return {"embedding": embedding, "dim": dim}


def _token_embeddings(body: Mapping[str, Any], error: type[Exception]) -> dict[str, Any]:
    """A whole number (>= 1) of ``dim`` float32s, at most :data:`MAX_TOKEN_EMBEDDING_FLOATS`."""
    vectors, dim = body.get("token_embeddings"), body.get("dim")
    if not (isinstance(vectors, bytes) and type(dim) is int and dim > 0):
        raise error("token-embeddings reply needs 'token_embeddings' bytes and a positive 'dim'")
    if not vectors or len(vectors) % (4 * dim) or len(vectors) > 4 * MAX_TOKEN_EMBEDDING_FLOATS:
        raise error(f"token-embeddings reply must be one or more vectors of 4*dim bytes, "
                    f"at most {MAX_TOKEN_EMBEDDING_FLOATS} floats")
    return {"token_embeddings": vectors, "dim": dim}


def _sparse(body: Mapping[str, Any], error: type[Exception]) -> dict[str, Any]:
    """A well-formed sparse row of ``dim``: increasing uint32 indices below it, a float each."""
    indices, values, dim = body.get("sparse_indices"), body.get("sparse_values"), body.get("dim")
    if not (isinstance(indices, bytes) and isinstance(values, bytes)
            and type(dim) is int and dim > 0):
        raise error("sparse reply needs 'sparse_indices', 'sparse_values' bytes and 'dim'")
    if len(indices) != len(values) or len(indices) % 4 or len(indices) > 4 * dim:
        raise error("sparse reply's 'sparse_indices' and 'sparse_values' must be 4 bytes "
                    "per nonzero each, at most 'dim' of them")
    if indices:
        found = _le_array("I", indices)
        if any(b <= a for a, b in itertools.pairwise(found)) or found[-1] >= dim:
            raise error("sparse reply's 'sparse_indices' must increase and be below 'dim'")
    return {"sparse_indices": indices, "sparse_values": values, "dim": dim}


def _scores(body: Mapping[str, Any], error: type[Exception]) -> dict[str, Any]:
    scores, labels = body.get("scores"), body.get("labels")
    if not (isinstance(scores, list) and all(isinstance(s, (int, float)) for s in scores)):
        raise error("reply 'scores' must be a list of numbers")
    if labels is not None and not (isinstance(labels, list) and len(labels) == len(scores)
                                   and all(isinstance(label, str) for label in labels)):
        raise error(f"reply 'labels' must be one string per score ({len(scores)} scores)")
    return {"scores": tuple(float(s) for s in scores), "labels": tuple(labels) if labels else None}


_KINDS: dict[str, Callable[[Mapping[str, Any], type[Exception]], dict[str, Any]]] = {
    "embedding": _embedding, "token_embeddings": _token_embeddings,
    "sparse_indices": _sparse, "scores": _scores,
}
"""Each kind of successful reply by the field that marks it: its check, returning the
:class:`Reply` fields (constructors raise ValueError, decoding DecodeError)."""
_BODY_FIELDS = ("embedding", "token_embeddings", "sparse_indices", "sparse_values", "dim",
                "scores", "labels")
"""The kinds' fields, in the order a reply map carries them."""


def embedding_reply(
    request_id: str, embedding: bytes, dim: int, tokens: int | None = None
) -> Reply:
    """A successful embedding reply; ``embedding`` is little-endian float32 bytes."""
    fields = _embedding({"embedding": embedding, "dim": dim}, ValueError)
    return Reply(request_id, True, tokens=tokens, **fields)


def scores_reply(
    request_id: str,
    scores: Sequence[float],
    tokens: int | None = None,
    labels: Sequence[str] | None = None,
) -> Reply:
    """A successful classification / rerank reply; ``labels`` name the scores, in order."""
    body = {"scores": [float(s) for s in scores], "labels": None if labels is None else [*labels]}
    return Reply(request_id, True, tokens=tokens, **_scores(body, ValueError))


def sparse_reply(
    request_id: str, indices: bytes, values: bytes, dim: int, tokens: int | None = None
) -> Reply:
    """A successful sparse (SPLADE) reply: the nonzeros of a ``dim``-long row, ``indices``
    little-endian uint32 and ``values`` little-endian float32, one each per nonzero."""
    body = {"sparse_indices": indices, "sparse_values": values, "dim": dim}
    return Reply(request_id, True, tokens=tokens, **_sparse(body, ValueError))


def token_embeddings_reply(
    request_id: str, vectors: bytes, dim: int, tokens: int | None = None
) -> Reply:
    """A successful ``output: tokens`` reply: ``len(vectors) / (4 * dim)`` vectors of ``dim``."""
    fields = _token_embeddings({"token_embeddings": vectors, "dim": dim}, ValueError)
    return Reply(request_id, True, tokens=tokens, **fields)


def error_reply(request_id: str, code: str, message: str, param: str | None = None) -> Reply:
    """An error reply; ``code`` is one of ErrorCode's values, ``param`` the field at fault."""
    return Reply(id=request_id, ok=False,
                 error=ErrorInfo(code=str(code), message=message, param=param))


def encode_embedding_reply(
    request_id: str, embedding: bytes, dim: int, tokens: int | None = None,
    truncated: bool = False,
) -> bytes:
    """``encode_reply(embedding_reply(...))``, byte for byte, without the Reply (hot path)."""
    if len(embedding) != 4 * dim:
        raise ValueError(f"embedding has {len(embedding)} bytes, expected 4 * {dim}")
    body: dict[str, Any] = {"id": request_id, "ok": True, "embedding": embedding, "dim": dim}
    if tokens is not None:
        body["tokens"] = tokens
    if truncated:
        body["truncated"] = True
    return pack(body)


def encode_embedding_replies(
    request_ids: Sequence[str], rows: bytes | memoryview, dim: int, tokens: Sequence[int]
) -> list[bytes]:
    """``encode_embedding_reply(id, row, dim, tokens)`` for many rows of one width, byte for
    byte; ``rows`` is their float32 little-endian values end to end (bytes, or a byte view of
    them). The parts all replies share are packed once: each reply is two small packs and a join."""
    width = 4 * dim
    if dim < 1 or len(rows) != width * len(request_ids) or len(tokens) != len(request_ids):
        raise ValueError(
            f"{len(request_ids)} replies of {dim} floats need {width * len(request_ids)} bytes "
            f"and {len(request_ids)} token counts; got {len(rows)} bytes, {len(tokens)} counts"
        )
    one = _thread_packer().pack  # bound once: two packs a reply
    head = _thread_packer().pack_map_header(5) + one("id")
    middle = one("ok") + one(True) + one("embedding") + one(bytes(width))[:-width]
    tail = one("dim") + one(dim) + one("tokens")
    floats = memoryview(rows)  # each row joined from it, not copied out first
    return [
        b"".join((head, one(request_id), middle, floats[at:at + width], tail, one(count)))
        for request_id, at, count in zip(request_ids, range(0, len(rows), width), tokens,
                                         strict=True)
    ]


def encode_reply(reply: Reply) -> bytes:
    """The msgpack map a worker RPUSHes onto ``reply_to``."""
    body: dict[str, Any] = {"id": reply.id, "ok": reply.ok}
    for name in _BODY_FIELDS:
        value = getattr(reply, name)
        if value is not None and (value or name != "labels"):
            body[name] = list(value) if isinstance(value, tuple) else value
    if reply.error is not None:
        body["error"] = {"code": reply.error.code, "message": reply.error.message}
        if reply.error.param is not None:
            body["error"]["param"] = reply.error.param
    if reply.tokens is not None:
        body["tokens"] = reply.tokens
    if reply.truncated:
        body["truncated"] = True
    return pack(body)


def reply_with_id(packed: bytes, request_id: str) -> bytes:
    """A reply's bytes as another request's: the same map with ``id`` replaced (a cached or
    coalesced answer is byte for byte the one computing it would have made)."""
    body = msgpack.unpackb(packed, raw=False, strict_map_key=True)
    body["id"] = request_id
    return pack(body)


def decode_reply(packed: bytes) -> Reply:
    """Parse one reply map; raise DecodeError naming what is wrong."""
    if len(packed) > MAX_REPLY_BYTES:
        raise DecodeError(f"reply is {len(packed)} bytes, over {MAX_REPLY_BYTES}")
    try:
        body = msgpack.unpackb(packed, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"reply is not valid msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise DecodeError("reply must be a msgpack map")
    request_id, ok = body.get("id"), body.get("ok")
    if not isinstance(request_id, str):
        raise DecodeError("reply has no string 'id'")
    if not isinstance(ok, bool):
        raise DecodeError("reply has no boolean 'ok'")
    if not ok:
        error = body.get("error")
        if not isinstance(error, dict):
            raise DecodeError("error reply has no 'error' map")
        param = error.get("param")  # a short string, else None: a reader never fails on it
        return Reply(request_id, False, error=ErrorInfo(
            str(error.get("code", "")), str(error.get("message", "")),
            param if isinstance(param, str) and 0 < len(param) <= MAX_PARAM_CHARS else None))
    tokens, truncated = body.get("tokens"), body.get("truncated", False)
    if tokens is not None and (type(tokens) is not int or tokens < 0):
        raise DecodeError("reply 'tokens' must be a non-negative integer")
    if type(truncated) is not bool:
        raise DecodeError("reply 'truncated' must be a boolean")
    kind = next((name for name in _KINDS if body.get(name) is not None), None)
    if kind is None:
        raise DecodeError(f"successful reply carries none of {', '.join(map(repr, _KINDS))}")
    return Reply(request_id, True, tokens=tokens, truncated=truncated,
                 **_KINDS[kind](body, DecodeError))
