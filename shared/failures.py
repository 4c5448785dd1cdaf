"""What an operational failure reads as: the one line ``tokenq <cmd>: <message>``, naming the
Redis URL with its password masked."""

from __future__ import annotations

import re

from tokenq.shared import redis_refusal
from tokenq.shared.errors import TokenqError
from tokenq.shared.redis_url import redact
from tokenq.shared.text import one_line


class CommandFailed(Exception):
    """An operational failure whose message says everything the operator needs (exit 1)."""


def failure_message(
    exc: BaseException, redis_url: str | None = None, socket_timeout_s: float | None = None
) -> str | None:
    """The one-line report of an operational failure; None when ``exc`` is not one."""
    from redis import exceptions as redis

    where = f"Redis at {redact(redis_url)}" if redis_url else "Redis"
    text = _SCRIPT_NOISE.sub("", one_line(str(exc))) or type(exc).__name__
    if isinstance(exc, CommandFailed):
        return text
    if isinstance(exc, redis.AuthenticationError):
        return (f"{where} refused the login: {text} (check the user name and password in "
                "--redis-url / TOKENQ_REDIS_URL)")
    if isinstance(exc, redis.TimeoutError) or (
        isinstance(exc, redis.ConnectionError) and "timeout" in text.lower()
    ):
        within = f" within --socket-timeout-s {socket_timeout_s:g}" if socket_timeout_s else ""
        return f"cannot reach {where}: no answer{within} ({text})"
    if isinstance(exc, redis.ConnectionError):
        return f"cannot reach {where}: {text}"
    if isinstance(exc, redis.NoPermissionError):
        return (f"{where} refused a command to this ACL user: {text} (docs/SECURITY.md "
                "lists the rights each command needs)")
    if is_wrong_type(exc):
        return f"{where}: a tokenq key holds the wrong type of value: {text}"
    if isinstance(exc, redis.ResponseError) and redis_refusal.is_out_of_memory(exc):
        return (f"{where} is out of memory (maxmemory) and refused the write: {text} "
                "(nothing was written; free memory or raise maxmemory, then try again)")
    if isinstance(exc, redis.RedisError):
        return f"{where} answered an error: {text}"
    return text if isinstance(exc, (TokenqError, OSError)) else None


_SCRIPT_NOISE = re.compile(
    r"\s*script: (?:[0-9a-f]{40}|tokenq_\w+), on @user_(?:script|function):\d+\.?$")
"""What Redis appends to an error raised inside a Lua script: the sha and the line."""


def error_text(exc: BaseException) -> str:
    """``Type: message`` on one line, or the repr (``TimeoutError()``) when the message is empty."""
    text = one_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else repr(exc)


def is_wrong_type(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis's WRONGTYPE (also when a pipeline wrapped it)."""
    from redis import exceptions as redis

    return isinstance(exc, redis.ResponseError) and redis_refusal.error_code(exc) == "WRONGTYPE"
