"""The heartbeat: one worker's row in ``keys.workers(q)``, a msgpack map of :class:`Heartbeat`'s
fields (missing ones read as their default, unknown ones ignored). Sans-I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import msgpack

from tokenq.shared.errors import DecodeError

_LIMITS = {"max_str_len": 1 << 16, "max_bin_len": 1 << 16, "max_map_len": 256}
OTHER_TENANTS = "(others)"
"""The label of the tenants a worker does not name (not a tenant name: it has parentheses)."""


@dataclass(slots=True)
class Totals:
    """A worker's totals since start: kept by the worker, published in each heartbeat."""

    requests_ok: int = 0
    requests_failed: int = 0
    batches: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    device_ms: float = 0.0
    oom_splits: int = 0
    reclaimed: int = 0
    dead_lettered: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    """Requests looked up in the result cache and computed."""
    coalesced: int = 0
    """Requests answered by an identical request's row."""


@dataclass(slots=True)
class Heartbeat(Totals):
    """What one worker says about itself: who, its batch budget, and its :class:`Totals`."""

    host: str | None = None
    pid: int | None = None
    model: str | None = None
    at: float | None = None
    """When it beat: Unix seconds on the *worker's* clock (``started_at`` too)."""
    started_at: float | None = None
    max_batch_tokens: int | None = None
    """The token budget it packs batches to now (adaptive budgets move it)."""
    configured_batch_tokens: int | None = None
    max_batch_size: int | None = None
    buffered: int = 0
    """Requests read and waiting in its packer."""
    padding_efficiency: float = 1.0
    tenants: dict[str, list[float]] | None = None
    """Per tenant label: [requests, counted tokens, p50 ms of its recent answers] since start
    (at most 64 named, the rest as ``OTHER_TENANTS``)."""

    @property
    def requests(self) -> int:
        return self.requests_ok + self.requests_failed


_TEXT = frozenset({"host", "model"})
_FLOATS = frozenset({"at", "started_at", "device_ms", "padding_efficiency"})


def encode_heartbeat(beat: Heartbeat) -> bytes:
    """The row's msgpack map (fields that are None are left out)."""
    body = {f.name: getattr(beat, f.name) for f in fields(beat)}
    return msgpack.packb({k: v for k, v in body.items() if v is not None}, use_bin_type=True)


def decode_heartbeat(raw: bytes) -> Heartbeat:
    """Parse one row; raise :class:`DecodeError` naming what is wrong."""
    try:
        body = msgpack.unpackb(raw, raw=False, **_LIMITS)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"heartbeat is not valid msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise DecodeError("heartbeat must be a msgpack map")
    return Heartbeat(**{f.name: _value(f.name, body[f.name], optional=f.default is None)
                        for f in fields(Heartbeat) if f.name in body})


def _value(name: str, value: object, *, optional: bool) -> Any:
    if value is None and optional:
        return None
    if name == "tenants":
        return _tenants(value)
    if name in _TEXT:
        if not isinstance(value, str):
            raise DecodeError(f"heartbeat field {name!r} must be a string")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DecodeError(f"heartbeat field {name!r} must be a finite number, got {value!r:.40}")
    return float(value) if name in _FLOATS else int(value)


def _tenants(value: object) -> dict[str, list[float]]:
    """The ``tenants`` map checked: text labels, each three finite non-negative numbers."""
    if not isinstance(value, dict):
        raise DecodeError("heartbeat field 'tenants' must be a map")
    out = {}
    for label, figures in value.items():
        if (not isinstance(label, str) or not isinstance(figures, list) or len(figures) != 3
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                           and math.isfinite(x) and x >= 0 for x in figures)):
            raise DecodeError(f"heartbeat field 'tenants' has a bad entry {label!r:.40}")
        out[label] = [float(x) for x in figures]
    return out
