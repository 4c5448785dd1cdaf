"""Every failure of the gateway as one :class:`ApiError`, and how each API writes it.

One mapping from what went wrong to an HTTP status, kept here so the OpenAI
and TEI routes cannot disagree (TEI's statuses are the reference: 413 for a
body or batch too large, 422 for validation, 424 for a model error, 429
when overloaded):

==========================================  ======  ===============================
what                                        status  note
==========================================  ======  ===============================
body over ``--max-body-bytes``, batch over  413
``--max-client-batch-size``
a field that does not validate; input the   422     names the field
queue refuses (empty, over-long, a pair to
a single-text model); the worker's
``bad_request`` / ``too_long``
unknown model name                          404     OpenAI's ``model_not_found``
the queue is full                           429     ``Retry-After`` (seconds)
Redis unreachable                           503
no answer by the deadline; the request's    504
deadline passed before a worker ran it
the worker's other errors (``inference_     424     the worker's code in the body
failed``, ``out_of_memory``, …)
==========================================  ======  ===============================

Bodies: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` and
TEI's ``{"error": message, "error_type": kind}``.
"""

from __future__ import annotations

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
from tokenq.shared.errors import ErrorCode

RETRY_AFTER_S = 1
"""What ``Retry-After`` says when the queue is full: about one batch's time is plenty."""

_VALIDATION_CODES = {ErrorCode.BAD_REQUEST.value, ErrorCode.TOO_LONG.value}

_OPENAI_TYPES = {
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
    424: "api_error",
}
_TEI_TYPES = {
    404: "Validation",
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
        return {"error": self.message, "error_type": _TEI_TYPES.get(self.status, "Backend")}


def invalid(param: str, message: str) -> ApiError:
    """422 naming the field."""
    return ApiError(422, f"{param}: {message}", param=param)


def too_large(param: str, message: str) -> ApiError:
    return ApiError(413, f"{param}: {message}", param=param)


def from_exception(exc: Exception) -> ApiError:
    """The answer for what the client raised (anything else is a bug: re-raised)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, BadRequest):
        return ApiError(422, f"input: {exc}", param="input", code="bad_request")
    if isinstance(exc, QueueFull):
        return ApiError(429, f"the queue is full, retry later: {exc}", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, BrokerUnavailable):
        return ApiError(503, f"the queue's Redis is unreachable: {exc}", code="unavailable")
    if isinstance(exc, DeadlineExceeded | ReplyTimeout):
        return ApiError(504, str(exc), code="timeout")
    if isinstance(exc, RemoteError):
        if exc.code in _VALIDATION_CODES:
            return ApiError(422, f"input: {exc.message}", param="input", code=exc.code)
        return ApiError(424, f"the model failed: {exc.code}: {exc.message}", code=exc.code)
    raise exc
