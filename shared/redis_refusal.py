"""Which Redis errors mean "this key can never take this write" (settle without it, go on) and
which "Redis refuses writes now" (any other: fail the call, retry later); lua/refusal.lua's twin."""

from __future__ import annotations

KEY_REFUSES = frozenset({"WRONGTYPE", "NOPERM", "CROSSSLOT"})
KNOWN_NOW = ("OOM", "READONLY", "MASTERDOWN", "LOADING", "BUSY", "MISCONF", "TRYAGAIN",
             "CLUSTERDOWN", "NOREPLICAS")
"""Codes of "Redis refuses writes now" with their own metric label (any other: ``other``)."""
WRITES_REFUSED = frozenset({"OOM", "READONLY", "MISCONF", "NOREPLICAS"})
"""Of those, the codes of a Redis that refuses every write and still answers reads (a full one,
a stale primary, one that cannot save, one short of replicas)."""
_KNOWN = (*KEY_REFUSES, *KNOWN_NOW)
_BY_CLASS = {
    "NoPermissionError": "NOPERM",
    "OutOfMemoryError": "OOM",
    "ReadOnlyError": "READONLY",
    "MasterDownError": "MASTERDOWN",
    "BusyLoadingError": "LOADING",
    "ClusterCrossSlotError": "CROSSSLOT",
    "TryAgainError": "TRYAGAIN",
    "ClusterDownError": "CLUSTERDOWN",
}
"""redis-py strips the code from the message of the errors it has a class for; read it back."""


def error_code(error: BaseException | str) -> str:
    """The Redis error code of ``error`` (``"OOM"``, ...) or ``""``: from redis-py's
    ``status_code`` or class, else the message (a script's error is searched)."""
    if not isinstance(error, str):
        code = getattr(error, "status_code", None)
        if code in _KNOWN:
            return str(code)
        for cls in type(error).__mro__:
            if cls.__name__ in _BY_CLASS:
                return _BY_CLASS[cls.__name__]
        error = str(error)
    words = error.lstrip("-").split(" ", 1)
    first = words[0] if words else ""
    if first in _KNOWN:
        return first
    for code in _KNOWN:
        if f"-{code} " in error or f": {code} " in error:
            return code
    return first if first.isupper() else ""


def key_refuses(error: BaseException | str) -> bool:
    """The key named can never take the write: settle without it, go on."""
    return error_code(error) in KEY_REFUSES


def refused_now(error: BaseException | str) -> bool:
    """Redis refuses for its own state (or a reason not known): fail the whole call, keep
    everything, retry later."""
    return not key_refuses(error)


def reason(error: BaseException | str) -> str:
    """The metric label and log word for a refusal: ``oom``, ``readonly``, ... or ``other``."""
    code = error_code(error)
    return code.lower() if code in _KNOWN else "other"


def is_out_of_memory(error: BaseException | str) -> bool:
    """Redis at ``maxmemory`` refused a write (``noeviction``): nothing of that call was written."""
    return error_code(error) == "OOM"
