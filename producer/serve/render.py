"""Answers as JSON bytes, built in a thread (``Gateway.answer``) a piece at a time (the GIL passes
back to the loop between items), so ``/health`` keeps answering."""

from __future__ import annotations

import array
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Raw:
    """JSON already encoded (a route that writes its records straight to bytes); a wrapper,
    not a ``bytes`` subclass, so that no answer is copied to become one."""

    data: bytes


class Later:
    """An answer to build in the thread that encodes it: ``fn(*args)``, which may raise an
    ApiError (it is answered as the route's own error); sent with ``headers``."""

    def __init__(self, fn: Callable[..., Any], *args: Any,
                 headers: dict[str, str] | None = None) -> None:
        self.fn, self.args, self.headers = fn, args, headers


def encode(value: Any) -> bytes:
    """``value`` as starlette's ``JSONResponse`` spells it (compact, UTF-8, no NaN)."""
    if type(value) is Raw:
        return value.data
    if type(value) is array.array:  # a vector: its floats exist as objects only while encoded
        return _dumps(value.tolist())
    if type(value) is list and value and type(value[0]) in PIECES:
        return b"[" + b",".join(map(encode, value)) + b"]"
    if type(value) is dict and any(type(item) in PIECES for item in value.values()):
        return b"{" + b",".join(_dumps(key) + b":" + encode(item)
                                for key, item in value.items()) + b"}"
    return _dumps(value)


PIECES = (list, dict, str, Raw, array.array)
"""What a list encoded item by item holds (a list of numbers is one call)."""


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")
