"""Errors, split by who is at fault: the caller (``BadRequest``), a worker's error reply
(``RemoteError``, with a stable :class:`ErrorCode`), or Redis (``BrokerUnavailable``)."""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Codes carried in error replies; documented in docs/PROTOCOL.md."""

    BAD_REQUEST = "bad_request"
    TOO_LONG = "too_long"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    OUT_OF_MEMORY = "out_of_memory"
    INFERENCE_FAILED = "inference_failed"
    DEAD_LETTER = "dead_letter"
    BAD_REPLY = "bad_reply"
    QUEUE_FULL = "queue_full"


class TokenqError(Exception):
    """Base of every error tokenq raises."""


class BadRequest(TokenqError, ValueError):
    """The caller passed something tokenq cannot accept; nothing was enqueued. ``param`` names
    the argument at fault (``texts``, ``dimensions``)."""

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class DecodeError(BadRequest):
    """A stream entry or a reply does not follow the wire format."""


class ConfigError(TokenqError, ValueError):
    """A setting is invalid or two settings contradict each other."""


class QueueFull(TokenqError):
    """The queue is at its maximum length; nothing was written."""


class QuotaExceeded(QueueFull):
    """The call's tokens would take ``tenant``'s pending tokens past its ``quota`` (``tokenq
    quotas``); nothing was written, and the tenant's other calls wait for room as at a full
    queue, while other tenants' go on."""

    def __init__(self, message: str, tenant: str = "", quota: int = 0) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.quota = quota


class BrokerOutOfMemory(QueueFull):
    """Redis is at its ``maxmemory`` and refused the write; nothing was written (a
    :class:`QueueFull`: the same backpressure)."""


class BrokerUnavailable(TokenqError, ConnectionError):
    """Redis could not be reached before the caller's timeout."""


class NotReplicated(TokenqError):
    """A durable enqueue was written on the primary, but too few replicas confirmed it in time;
    the requests (``request_ids``) are queued all the same."""

    def __init__(self, message: str, request_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class DeviceOutOfMemory(TokenqError, MemoryError):
    """A backend ran out of device memory on a batch (retried by splitting it)."""


class DeviceLost(TokenqError, RuntimeError):
    """The device can run nothing more (a sticky CUDA error): the worker process must end, its
    batch left pending for other workers."""


class RemoteError(TokenqError):
    """A worker answered the request with an error reply."""

    def __init__(
        self, code: str, message: str, request_id: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.param = param


class DeadlineExceeded(RemoteError, TimeoutError):
    """The request's deadline passed before a worker could run it."""


class QueueFullRefused(RemoteError, QueueFull):
    """A worker refused the request as written past the queue's maximum length; it never ran."""


_REMOTE_ERRORS: dict[str, type[RemoteError]] = {
    ErrorCode.DEADLINE_EXCEEDED.value: DeadlineExceeded,
    ErrorCode.QUEUE_FULL.value: QueueFullRefused,
}


def remote_error(
    code: str, message: str, request_id: str | None = None, param: str | None = None
) -> RemoteError:
    """The most specific :class:`RemoteError` subclass for an error reply's code."""
    return _REMOTE_ERRORS.get(code, RemoteError)(code, message, request_id, param)
