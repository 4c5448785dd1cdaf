"""Every failure of the gateway as one :class:`ApiError` (TEI's statuses the reference, listed in
``openapi.ERROR_STATUSES``), and its body in each API family's shape, by :func:`body_for`."""

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
    QuotaExceeded,
    RemoteError,
    ReplyTimeout,
)
from tokenq.producer.call_options import WORKER_OPTIONS
from tokenq.shared.errors import ErrorCode

RETRY_AFTER_S = 1
"""What ``Retry-After`` says when the queue is full: about one batch's time is plenty."""
_OPTION_PREFIX = "opts: "
"""How the producer's and the worker's messages mark an option's refusal (its name follows)."""
_VALIDATION_CODES = {ErrorCode.BAD_REQUEST.value, ErrorCode.TOO_LONG.value}

_CLIENT_STATUSES = (401, 404, 405, 413, 415, 422)
_OPENAI_TYPES = {400: "invalid_request_error", 429: "rate_limit_error",
                 503: "service_unavailable", 504: "timeout", 424: "api_error",
                 **dict.fromkeys(_CLIENT_STATUSES, "invalid_request_error")}
_TEI_TYPES = {400: "Empty", 429: "Overloaded", 503: "Unhealthy", 504: "Backend",
              424: "Backend", **dict.fromkeys(_CLIENT_STATUSES, "Validation")}


@dataclass
class ApiError(Exception):
    """An HTTP error answer: status, message, and what each API's body needs."""

    status: int
    message: str
    param: str | None = None  # the request field at fault (OpenAI's ``param``)
    code: str | None = None  # a stable code: the worker's, or OpenAI's (``model_not_found``)
    headers: dict[str, str] = field(default_factory=dict)

    def __reduce__(self) -> tuple[type[ApiError], tuple[Any, ...]]:  # from a parser process
        return ApiError, (self.status, self.message, self.param, self.code, self.headers)

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


def body_for(path: str) -> Callable[[ApiError], dict[str, Any]]:
    """The error body of the API family ``path`` belongs to: OpenAI's (Cohere's v1 rerank
    included), Cohere's v2, else TEI's."""
    if path.startswith(("/v1/", "/embeddings")):
        return ApiError.openai_body
    if path.startswith("/v2/"):
        return ApiError.cohere_body
    return ApiError.tei_body


def invalid(param: str, message: str) -> ApiError:
    return ApiError(422, f"{param}: {message}", param=param)


def empty(param: str) -> ApiError:
    """400, as TEI answers a batch with nothing in it."""
    return ApiError(400, f"{param}: cannot be empty", param=param, code="empty")


def too_large(param: str, message: str) -> ApiError:
    return ApiError(413, f"{param}: {message}", param=param)


def wrong_model(code: str, message: str) -> ApiError:
    """424 (TEI's ``Backend``, before any inference): the queue's model does not answer what
    this route asks."""
    return ApiError(424, message, param="model", code=code)


def from_exception(
    exc: Exception, options: Collection[str] = (), items: str = "input"
) -> ApiError:
    """The answer for what the client raised (anything else is a bug: re-raised). A refusal
    names its parameter when it is one of the sent ``options``, else ``items`` (the field
    holding the inputs)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, BadRequest):
        code = getattr(exc, "code", ErrorCode.BAD_REQUEST.value)  # InputTooLong: too_long
        return _client_fault(str(exc), code, _param(exc), options, items)
    if isinstance(exc, QuotaExceeded):
        return ApiError(429, f"the tenant's quota is reached, retry later: {exc}",
                        code="quota_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
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
    """The parameter ``exc`` names; a worker's reply without ``param`` names it first in the
    text, when that is an option's name."""
    if exc.param is not None or message is None:
        return exc.param
    match = re.match(r"(\w+)", message.removeprefix(_OPTION_PREFIX))
    return match.group(1) if match and match.group(1) in WORKER_OPTIONS else None


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
