"""How deep a queue is (length, pending, lag, pending tokens) over every stream it has, tenants'
too (producer/lua/queue_depth.lua): the one rule ``tokenq stats`` and the worker's gauges
share."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenq.shared.heartbeat import OTHER_TENANTS
from tokenq.shared.keys import pending_count, tenant_pending


@dataclass(frozen=True, slots=True)
class Depth:
    length: int
    pending: int
    lag: int
    lag_exact: bool
    """False when Redis gave no lag: it is ``length - pending``."""
    tokens: int = 0
    """Pending tokens (``keys.pending``)."""
    tenants: dict[str, int] = field(default_factory=dict, compare=False)
    """Pending tokens by tenant (``keys.tenant_pending``); empty when not read."""


def lane_depth(reply: Sequence[Any], pending: Mapping[Any, Any]) -> Depth:
    """A lane's depth over all its streams, tenants' too: queue_depth.lua's ``depth`` reply
    (length, pending, lag, exact: sums) and its pending hash (HGETALL), which the tenants'
    figures (``keys.tenant_pending``) come from, so they add up to the pending tokens."""
    length, held, lag, exact = (int(value) for value in reply)
    return Depth(length, held, lag, bool(exact), max(0, pending_count(pending.get(b"tokens")) or 0),
                 tenant_pending(pending))


def total(parts: Sequence[Depth]) -> Depth:
    """The depth of a queue whose lanes have ``parts``: sums, exact only if every part is."""
    if len(parts) == 1:
        return parts[0]
    tenants: Counter[str] = Counter()
    for part in parts:
        tenants.update(part.tenants)
    return Depth(
        sum(p.length for p in parts), sum(p.pending for p in parts), sum(p.lag for p in parts),
        all(p.lag_exact for p in parts), sum(p.tokens for p in parts), dict(tenants),
    )


def bounded(values: Mapping[str, int], cap: int) -> dict[str, int]:
    """The ``cap`` largest of ``values`` by name, the rest summed as ``OTHER_TENANTS``: what a
    producer naming thousands of tenants cannot grow past."""
    ranked = sorted(values.items(), key=lambda item: (-item[1], item[0]))
    kept = dict(ranked[:cap])
    if len(ranked) > cap:
        kept[OTHER_TENANTS] = sum(value for _, value in ranked[cap:])
    return kept
