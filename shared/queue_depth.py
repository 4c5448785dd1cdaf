"""How deep a queue is (length, pending, lag, pending tokens): the one rule ``tokenq stats`` and
the worker's gauges share. Where Redis reports no lag, it is ``length - pending``, marked not
exact."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Depth:
    length: int
    pending: int
    lag: int
    lag_exact: bool
    """False when Redis gave no lag and it was derived from length and pending."""
    tokens: int = 0
    """Pending tokens: the sum of the ``tokens`` of the entries tokenq's scripts wrote
    (``keys.pending``)."""


def depth(
    length: int, pending: int, *, group_exists: bool, reported_lag: object, tokens: object = None
) -> Depth:
    """The queue's depth from XLEN, the group's pending count, XINFO GROUPS' ``lag`` and the
    pending-token sum (HGET; None: no hash yet, 0)."""
    counted = int(tokens or 0)  # type: ignore[call-overload]
    if not group_exists:
        return Depth(length, 0, length, True, counted)  # nobody has read anything yet
    if reported_lag is None:
        return Depth(length, pending, max(0, length - pending), False, counted)
    return Depth(length, pending, int(reported_lag), True, counted)  # type: ignore[call-overload]


def total(parts: Sequence[Depth]) -> Depth:
    """The depth of a queue whose lanes have ``parts``: sums, exact only if every part is."""
    if len(parts) == 1:
        return parts[0]
    return Depth(
        sum(p.length for p in parts), sum(p.pending for p in parts), sum(p.lag for p in parts),
        all(p.lag_exact for p in parts), sum(p.tokens for p in parts),
    )
