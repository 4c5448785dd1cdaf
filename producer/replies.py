"""Reply bytes into a :class:`Result` or an exception (one that does not decode: dropped from a
shared key, the request's ``bad_reply`` error from its own key)."""

from __future__ import annotations

import array
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenq.shared import wire
from tokenq.shared.errors import DecodeError, ErrorCode, RemoteError, TokenqError, remote_error
from tokenq.shared.text import plural

log = logging.getLogger("tokenq.producer")

BAD_REPLY = ErrorCode.BAD_REPLY.value


class ReplyTimeout(TokenqError, TimeoutError):
    """No reply came before the caller's timeout (Redis itself was reachable); a builtin
    ``TimeoutError`` too. The request may still run: ``Client.result(id)`` fetches its reply
    until it expires."""

    def __init__(self, request_ids: Sequence[str], waited_s: float, why: str | None = None) -> None:
        shown = ", ".join(request_ids[:5])
        more = f" and {len(request_ids) - 5} more" if len(request_ids) > 5 else ""
        because = f"; {why}" if why else ""
        super().__init__(f"no reply after {waited_s:.2f}s for "
                         f"{plural(len(request_ids), 'request')}: {shown}{more}{because}")
        self.request_ids = tuple(request_ids)
        self.waited_s = waited_s
        self.why = why
        """Why, when the client could tell (no live worker serves the queue)."""


@dataclass(frozen=True, slots=True)
class Result:
    """A worker's successful answer to one request. ``embedding``: an ``array.array('f')``
    (``numpy.frombuffer(e, numpy.float32)`` views it); ``scores``: a classifier's or reranker's;
    ``tokens``: what the worker ran, when it says."""

    id: str
    embedding: array.array | None  # typecode "f"; not subscriptable at runtime before 3.12
    dim: int | None
    scores: tuple[float, ...] | None
    tokens: int | None
    labels: tuple[str, ...] | None = None
    """A classifier's label for each score, in order, when the model names them."""
    sparse: tuple[tuple[int, float], ...] | None = None
    """A sparse model's nonzero (token id, weight) pairs by token id; ``dim``: the vocabulary."""
    token_embeddings: tuple[array.array, ...] | None = None
    """``output="tokens"``: one ``array('f')`` of ``dim`` values per token, in order."""
    truncated: bool = False
    """The worker cut the input to the model's limit; ``tokens`` counts what it read."""

    def __repr__(self) -> str:
        """A short summary (the first values of a vector, scores with their labels)."""

        def head(values: Sequence[Any], show: Callable[[Any], str] = "{:.4g}".format,
                 brackets: str = "[]") -> str:
            shown = ", ".join(show(value) for value in values[:3])
            more = f", … {len(values)} values" if len(values) > 3 else ""
            return f"{brackets[0]}{shown}{more}{brackets[1]}"

        parts = [f"id={self.id!r}"]
        if self.embedding is not None:
            dim = self.dim if self.dim is not None else len(self.embedding)
            parts += [f"dim={dim}", f"embedding={head(self.embedding)}"]
        if self.scores is not None:
            if self.labels is not None and len(self.labels) == len(self.scores):
                pairs = [f"{label!r}: {score:.4g}"
                         for label, score in zip(self.labels, self.scores, strict=True)]
                parts.append(f"scores={head(pairs, str, '{}')}")
            else:
                parts.append(f"scores={head(self.scores)}")
        if self.token_embeddings is not None:
            parts.append(f"token_embeddings=[{len(self.token_embeddings)} x {self.dim}]")
        if self.sparse is not None:
            parts.append(f"sparse={head(self.sparse, lambda p: f'{p[0]}: {p[1]:.4g}', '{}')}")
        parts.append(f"tokens={self.tokens}")
        if self.truncated:
            parts.append("truncated=True")
        return f"Result({', '.join(parts)})"


Outcome = Result | RemoteError


def decode(raw: bytes) -> wire.Reply | None:
    """A reply, or None (logged) when it does not decode or names no id."""
    try:
        return wire.decode_reply(raw)
    except DecodeError as exc:
        log.warning("dropping a reply that does not decode: %s", exc)
        return None


def outcome(reply: wire.Reply) -> Outcome:
    """A :class:`Result`, or the :class:`RemoteError` an error reply stands for."""
    if not reply.ok:
        error = reply.error or wire.ErrorInfo(code="", message="")
        return remote_error(error.code, error.message, reply.id, error.param)
    return Result(
        id=reply.id,
        embedding=reply.embedding_array(),
        dim=reply.dim,
        scores=reply.scores,
        tokens=reply.tokens,
        labels=reply.labels,
        sparse=tuple(reply.sparse_pairs()) if reply.sparse_indices is not None else None,
        token_embeddings=None if reply.token_embeddings is None else tuple(
            reply.token_vectors()),
        truncated=reply.truncated,
    )


def own_key_reply(wanted: dict[str, str], key: str, raw: bytes, outcomes: dict[str, Any]) -> None:
    """Record the reply read from one request's own reply key (``wanted``: key -> id); one that
    does not decode, or names another request, is the request's ``bad_reply`` error."""
    request_id = wanted.pop(key)
    try:
        reply = wire.decode_reply(raw)
    except DecodeError as exc:
        outcomes[request_id] = RemoteError(BAD_REPLY, str(exc), request_id)
        return
    if reply.id != request_id:
        outcomes[request_id] = RemoteError(BAD_REPLY, "reply names another request", request_id)
    else:
        outcomes[request_id] = outcome(reply)


def shared_key_reply(pending: set[str], raw: bytes, outcomes: dict[str, Any]) -> None:
    """Record one reply read from a key many requests share (``pending``: ids still due);
    one that does not decode or names no pending id is dropped."""
    reply = decode(raw)
    if reply is None or reply.id not in pending:
        return
    pending.discard(reply.id)
    outcomes[reply.id] = outcome(reply)


def settle(
    ids: Sequence[str], outcomes: Mapping[str, Outcome | Exception], return_exceptions: bool
) -> list[Any]:
    """Outcomes in input order; raise the first error unless ``return_exceptions``."""
    ordered = [outcomes[i] for i in ids]
    if not return_exceptions:
        for item in ordered:
            if isinstance(item, Exception):
                raise item
    return ordered
