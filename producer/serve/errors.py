"""Every failure of the gateway as one :class:`ApiError`, and how each API writes it.

One mapping from what went wrong to an HTTP status, kept here so the OpenAI
and TEI routes cannot disagree (TEI's statuses are the reference: 400 for an
empty batch, 413 for a body or batch too large, 422 for validation, 424 for
a model error, 429 when overloaded):

==========================================  ======  ===============================
what                                        status  note
==========================================  ======  ===============================
an empty batch on a TEI route (``inputs:    400     TEI's ``Empty``
[]``, ``texts: []``)
a body that is not JSON at all              400     ``invalid_json`` (as OpenAI and TEI)
no or a wrong ``--api-key``                 401     ``invalid_api_key``; edge.py
a POST whose ``Content-Type`` is not JSON   415     edge.py
no live worker (``--cold-start-s``)         503     ``no_worker``; delivery.py
body over ``--max-body-bytes``, batch over  413
``--max-client-batch-size``, or more to
send than ``bounds.MAX_AMPLIFICATION``
times the body (a rerank's long query)
the body not all sent within                408     ``timeout``
``--timeout-s``
over ``--max-concurrent-requests`` in       429     ``overloaded``, ``Retry-After``
flight
the client went away (mid-body or waiting)  499     ``client_closed`` (metrics only)
a field that does not validate; what no     422     names the field, or the option
worker can serve (token ids, left
truncation); input or an option the queue
refuses (empty text, over-long, a pair to a
single-text model, an unknown prompt, more
dimensions than the model has): the
producer's ``BadRequest``, the worker's
``bad_request`` / ``too_long``
a route the queue's model does not answer   424     ``not_an_embedding_model``,
(embeddings from a classifier, ``/rerank``          ``not_a_reranker``, TEI's
on an embedder)                                     ``Backend``; before enqueueing
unknown model name                          404     OpenAI's ``model_not_found``
a path no route serves                      404     ``not_found``; edge.py
a method the path's route does not answer   405     ``method_not_allowed``, ``Allow``;
                                                    edge.py
an ``Idempotency-Key`` used before with     422     ``idempotency_key_reused``;
another route or body                               idempotency.py
an ``Idempotency-Key`` whose first attempt  409     ``idempotency_key_in_flight``,
still runs past ``--timeout-s``                     ``Retry-After``
the queue is full                           429     ``Retry-After`` (seconds)
Redis unreachable                           503
no answer by the deadline; the request's    504
deadline passed before a worker ran it
the worker's other errors (``inference_     424     the worker's code in the body
failed``, ``out_of_memory``, a NaN score)
==========================================  ======  ===============================

Why a refused option is 422 on the OpenAI route too, where OpenAI itself
answers 400: it is a client error either way (the SDK raises an
``APIStatusError`` and does not retry), and one status for "this request
cannot be served as asked" on both routes is what TEI's own
OpenAI-compatible route does.

Bodies: OpenAI's ``{"error": {"message", "type", "param", "code"}}``,
TEI's ``{"error": message, "error_type": kind}`` and Cohere's
``{"message": message}`` (its v2 API; its SDK raises a typed error by
status and keeps the body as it came). Which one a path gets is
:func:`body_for`'s choice, by the API family its prefix belongs to.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from tokenq.producer import (
    BadRequest,
    BrokerUnavailable,
    DeadlineExceeded,
    QueueFull,
    RemoteError,
    ReplyTimeout,
)
from tokenq.producer.call_options import WORKER_OPTIONS
from tokenq.shared.errors import ErrorCode

RETRY_AFTER_S = 1
"""What ``Retry-After`` says when the queue is full: about one batch's time is plenty."""

_OPTION_PREFIX = "opts: "
"""How the producer's and the worker's messages mark an option's refusal; the field's name
follows it, so it is not repeated in the answer."""


_VALIDATION_CODES = {ErrorCode.BAD_REQUEST.value, ErrorCode.TOO_LONG.value}

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    415: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
    424: "api_error",
}
_TEI_TYPES = {
    400: "Empty",
    401: "Validation",
    415: "Validation",
    404: "Validation",
    405: "Validation",
    413: "Validation",
    422: "Validation",
    429: "Overloaded",
    503: "Unhealthy",
    504: "Backend",
    424: "Backend",
}


@dataclass
class ApiError(Exception):
    """An HTTP error answer: status, message, and what each API's body needs."""

    status: int
    message: str
    param: str | None = None
    """The request field at fault (OpenAI's ``param``), when one is."""
    code: str | None = None
    """A stable code: the worker's error code, or OpenAI's (``model_not_found``)."""
    headers: dict[str, str] = field(default_factory=dict)

    def openai_body(self) -> dict[str, Any]:
        return {"error": {
            "message": self.message,
            "type": _OPENAI_TYPES.get(self.status, "api_error"),
            "param": self.param,
            "code": self.code,
        }}

    def tei_body(self) -> dict[str, Any]:
        kind = "Validation" if self.code == "invalid_json" else _TEI_TYPES.get(self.status)
        return {"error": self.message, "error_type": kind or "Backend"}

    def cohere_body(self) -> dict[str, Any]:
        return {"message": self.message}


OPENAI_PREFIXES = ("/v1/", "/embeddings")
"""Paths whose errors are written in OpenAI's shape (Cohere's v1 rerank included)."""

COHERE_PREFIXES = ("/v2/",)
"""Paths whose errors are written in Cohere's shape (its v2 API); every other path is TEI's."""


def body_for(path: str) -> Callable[[ApiError], dict[str, Any]]:
    """The error body of the API family ``path`` belongs to, by its prefix."""
    if path.startswith(OPENAI_PREFIXES):
        return ApiError.openai_body
    if path.startswith(COHERE_PREFIXES):
        return ApiError.cohere_body
    return ApiError.tei_body


def invalid(param: str, message: str) -> ApiError:
    """422 naming the field."""
    return ApiError(422, f"{param}: {message}", param=param)


def empty(param: str) -> ApiError:
    """400, as TEI answers a batch with nothing in it."""
    return ApiError(400, f"{param}: cannot be empty", param=param, code="empty")


def too_large(param: str, message: str) -> ApiError:
    return ApiError(413, f"{param}: {message}", param=param)


def wrong_model(code: str, message: str) -> ApiError:
    """424: the queue's model does not answer what this route asks (named by ``code``).

    TEI's status and body for it on every route (``/embed`` on a classifier,
    ``/rerank`` on an embedder, ``/embed_sparse`` on a dense model, and its
    OpenAI route): its router answers a ``Backend`` error, 424, before any
    inference; its published spec lists no other status for it. The OpenAI
    body carries ``code`` (``not_an_embedding_model``, ...).
    """
    return ApiError(424, message, param="model", code=code)


def from_exception(
    exc: Exception, options: Collection[str] = (), items: str = "input"
) -> ApiError:
    """The answer for what the client raised (anything else is a bug: re-raised).

    ``options`` are the request options the call sent. A refusal carries the
    parameter at fault (``BadRequest.param``, the worker's ``param``): when
    that is one of ``options`` it is the request field of the same name and
    is answered as the field at fault; any other refusal names ``items``,
    the field holding the inputs (``text``, ``texts``, ``text_pair`` and
    the rest are the client's argument names, not this route's fields).
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, BadRequest):
        code = getattr(exc, "code", ErrorCode.BAD_REQUEST.value)  # InputTooLong: too_long
        return _client_fault(str(exc), code, _param(exc), options, items)
    if isinstance(exc, QueueFull):
        return ApiError(429, f"the queue is full, retry later: {exc}", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, BrokerUnavailable):
        return ApiError(503, f"the queue's Redis is unreachable: {exc}", code="unavailable")
    if isinstance(exc, DeadlineExceeded | ReplyTimeout):
        return ApiError(504, str(exc), code="timeout")
    if isinstance(exc, RemoteError):
        if exc.code in _VALIDATION_CODES:
            return _client_fault(exc.message, exc.code, _param(exc, exc.message), options, items)
        return ApiError(424, f"the model failed: {exc.code}: {exc.message}", code=exc.code)
    raise exc


def _param(exc: BadRequest | RemoteError, message: str | None = None) -> str | None:
    """The parameter ``exc`` names. Only a reply from a worker that predates ``param``
    (``message``: a RemoteError's) has its field read from the text, as before."""
    if exc.param is not None or message is None:
        return exc.param
    return _named_option_of_old_worker(message.removeprefix(_OPTION_PREFIX))


def _client_fault(
    message: str, code: str, param: str | None, options: Collection[str], items: str
) -> ApiError:
    """422 for input or an option the queue refused, naming the option when it is one."""
    message = message.removeprefix(_OPTION_PREFIX)
    if param is None or param not in options:
        return ApiError(422, f"{items}: {message}", param=items, code=code)
    if not message.startswith(param):
        message = f"{param}: {message}"
    return ApiError(422, message, param=param, code=code)


def _named_option_of_old_worker(message: str) -> str | None:
    """The option an error reply without ``param`` names: the first word of ``message``, when
    that is an option's name (a worker from before ``param`` sent only the message)."""
    match = re.match(r"(\w+)", message)
    return match.group(1) if match and match.group(1) in WORKER_OPTIONS else None
