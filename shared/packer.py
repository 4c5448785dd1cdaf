"""Every batching decision tokenq makes lives in this module.

The packer is sans-I/O: it holds the worker's buffer of requests (each with its
exact token length and the time it arrived), and when asked for a batch it
returns one or nothing. It never reads a clock, never awaits, never touches
Redis; the caller passes ``now_ms``. That makes every rule below testable with
hypothesis.

Rules (the packer's part of docs/ARCHITECTURE.md, in full):

1. The oldest request always goes into the next batch, so nothing starves.
2. The rest of the batch is filled from the neighbours of the oldest request
   in a length-sorted view of the buffer, always taking the neighbour that adds
   the least padding; so similar lengths ride together without fixed buckets.
3. A candidate that would add more padding than ``max_padding_ratio`` times
   its own length is left for a later batch of its own kind (a 20-token query
   does not ride in a batch padded to 1,500, nor a passage join 30 queries):
   mixing them costs the device more than running them apart.
4. A batch is *sealed* when the next candidate would break the token budget or
   the row limit. Cost is ``rows x longest`` for a padded model and the sum of
   lengths for a ragged (varlen) one.
5. The packer is only asked for a batch when the device is idle. A batch that
   is not sealed (the buffer ran out before the budget did) is held back until
   ``linger_ms`` after its oldest request arrived, hoping for company; a
   sealed batch goes at once. While the device is busy nobody asks, so input
   accumulates and the next batch is full.
6. A request whose length alone breaks the budget goes alone (the worker
   refuses budgets below the model's maximum input length, so this only
   happens after an out-of-memory error has lowered the budget).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

T = TypeVar("T")


class CostModel(str, Enum):
    """How a batch's memory and compute grow with its rows."""

    PADDED = "padded"
    """Every row is padded to the longest: cost = rows x longest."""
    RAGGED = "ragged"
    """Rows are packed end to end (varlen kernels): cost = sum of lengths."""


@dataclass(frozen=True, slots=True)
class Budget:
    """The limits a batch must respect."""

    max_batch_tokens: int
    max_batch_size: int
    cost_model: CostModel = CostModel.PADDED

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

    def cost(self, rows: int, longest: int, total: int) -> int:
        """Tokens the device pays for a batch of this shape."""
        return rows * longest if self.cost_model is CostModel.PADDED else total

    def fits(self, rows: int, longest: int, total: int) -> bool:
        return rows <= self.max_batch_size and self.cost(rows, longest, total) <= (
            self.max_batch_tokens
        )


@dataclass(frozen=True, slots=True)
class Item(Generic[T]):
    """One buffered request: its exact token length, arrival time and payload."""

    length: int
    arrived_ms: float
    payload: T
    seq: int = field(default=-1, compare=False)


@dataclass(frozen=True, slots=True)
class Batch(Generic[T]):
    """A sealed (or lingered-out) batch, in ascending length order."""

    items: tuple[Item[T], ...]
    cost: int
    sealed: bool
    """True when the budget or row limit stopped the batch; False when the buffer ran dry."""

    @property
    def rows(self) -> int:
        return len(self.items)

    @property
    def tokens(self) -> int:
        """Real (unpadded) tokens in the batch."""
        return sum(item.length for item in self.items)

    @property
    def longest(self) -> int:
        return max(item.length for item in self.items)

    @property
    def padded_tokens(self) -> int:
        """rows x longest, whatever the cost model (what a padded kernel would see)."""
        return self.rows * self.longest

    @property
    def payloads(self) -> list[T]:
        return [item.payload for item in self.items]


class Packer(Generic[T]):
    """A buffer of requests that hands out token-budgeted batches."""

    def __init__(
        self, budget: Budget, linger_ms: float = 0.0, *, max_padding_ratio: float = 1.0
    ) -> None:
        if linger_ms < 0:
            raise ValueError(f"linger_ms must be >= 0, got {linger_ms}")
        if max_padding_ratio < 0:
            raise ValueError(f"max_padding_ratio must be >= 0, got {max_padding_ratio}")
        self.budget = budget
        self.linger_ms = float(linger_ms)
        self.max_padding_ratio = float(max_padding_ratio)
        self._items: dict[int, Item[T]] = {}
        self._by_length: list[tuple[int, int]] = []  # (length, seq), ascending
        self._seq = itertools.count()
        self._tokens = 0

    # ------------------------------------------------------------------ buffer

    def add(self, length: int, arrived_ms: float, payload: T) -> Item[T]:
        """Buffer one request whose exact token length is known."""
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        seq = next(self._seq)
        item = Item(length=length, arrived_ms=arrived_ms, payload=payload, seq=seq)
        self._items[seq] = item
        bisect.insort(self._by_length, (length, seq))
        self._tokens += length
        return item

    def remove_where(self, predicate: Callable[[T], bool]) -> list[Item[T]]:
        """Take out every buffered item whose payload matches (expired, claimed away)."""
        gone = [item for item in self._items.values() if predicate(item.payload)]
        for item in gone:
            self._discard(item)
        return gone

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item[T]]:
        return iter(self._items.values())

    @property
    def buffered_tokens(self) -> int:
        """Sum of the exact lengths of everything buffered."""
        return self._tokens

    def oldest(self) -> Item[T] | None:
        if not self._items:
            return None
        return min(self._items.values(), key=lambda item: (item.arrived_ms, item.seq))

    def ready_at(self) -> float | None:
        """When an unsealed batch stops lingering (ms), or None with an empty buffer."""
        oldest = self.oldest()
        return None if oldest is None else oldest.arrived_ms + self.linger_ms

    # ----------------------------------------------------------------- batching

    def next_batch(self, now_ms: float, *, flush: bool = False) -> Batch[T] | None:
        """The next batch for an idle device, or None to wait for more input.

        ``flush`` skips the linger (used when draining on shutdown).
        """
        batch = self.peek(now_ms)
        if batch is None:
            return None
        if not (batch.sealed or flush or now_ms >= batch.items[0].arrived_ms + self.linger_ms):
            return None
        for item in batch.items:
            self._discard(item)
        return Batch(
            items=tuple(sorted(batch.items, key=lambda i: (i.length, i.seq))),
            cost=batch.cost,
            sealed=batch.sealed,
        )

    def peek(self, now_ms: float) -> Batch[T] | None:
        """The batch the packer would send now, without removing it.

        ``items[0]`` is the oldest request (the anchor); the caller's linger
        check reads its arrival time.
        """
        del now_ms  # the choice does not depend on time; kept for symmetry
        anchor = self.oldest()
        if anchor is None:
            return None
        order = self._by_length
        position = bisect.bisect_left(order, (anchor.length, anchor.seq))
        chosen = [anchor]
        longest = total = anchor.length
        below, above = position - 1, position + 1
        sealed = False
        budget = self.budget
        while True:
            if len(chosen) >= budget.max_batch_size:
                sealed = True
                break
            candidates = []
            if below >= 0:
                candidates.append(("below", order[below][0]))
            if above < len(order):
                candidates.append(("above", order[above][0]))
            if not candidates:
                break
            side, length = min(
                candidates,
                key=lambda c: (self._padding_added(len(chosen), longest, c[1]), c[1]),
            )
            if self._padding_added(len(chosen), longest, length) > self.max_padding_ratio * length:
                # Too unlike the batch: it would add more padding than it brings
                # tokens. Further out on that side it only gets worse, so the side
                # closes; the batch is not sealed, since similar input may come.
                if side == "above":
                    above = len(order)
                else:
                    below = -1
                continue
            new_longest = max(longest, length)
            if budget.fits(len(chosen) + 1, new_longest, total + length):
                index = below if side == "below" else above
                chosen.append(self._items[order[index][1]])
                longest, total = new_longest, total + length
                if side == "below":
                    below -= 1
                else:
                    above += 1
                continue
            # Longer candidates only cost more; a padded model pays `longest` for
            # any shorter one, so one failure closes that side for good.
            sealed = True
            if side == "above" or budget.cost_model is CostModel.PADDED:
                if side == "above":
                    above = len(order)
                else:
                    below = -1
            else:
                below -= 1  # ragged: a shorter one further down may still fit
        if not sealed and not budget.fits(len(chosen) + 1, longest, total + 1):
            # Not even a 1-token request could join (a full budget, or a lone
            # oversize request): lingering for company would only waste time.
            sealed = True
        cost = budget.cost(len(chosen), longest, total)
        return Batch(items=tuple(chosen), cost=cost, sealed=sealed)

    def _padding_added(self, rows: int, longest: int, length: int) -> int:
        """Padding tokens a candidate would add to a batch (0 for a ragged model)."""
        if self.budget.cost_model is CostModel.RAGGED:
            return 0
        if length <= longest:
            return longest - length
        return rows * (length - longest)

    def _discard(self, item: Item[T]) -> None:
        del self._items[item.seq]
        index = bisect.bisect_left(self._by_length, (item.length, item.seq))
        del self._by_length[index]
        self._tokens -= item.length


class AdaptiveBudget:
    """The token budget after out-of-memory errors: down fast, back up slowly.

    After an OOM the budget drops to ``backoff`` x the cost of the batch that
    failed (never below ``floor``, the model's max input length, so one
    full-length input still fits); after ``recover_after`` batches in a row
    without an OOM it climbs by ``growth`` x, never above the configured
    ``ceiling``. The same multiplicative-decrease / slow-increase shape TCP
    uses, for the same reason: a memory limit that moves (fragmentation,
    another process on the GPU) is found again without oscillating.
    """

    def __init__(
        self,
        ceiling: int,
        floor: int,
        *,
        backoff: float = 0.75,
        growth: float = 1.05,
        recover_after: int = 20,
    ) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"need 1 <= floor ({floor}) <= ceiling ({ceiling})")
        if not 0 < backoff < 1 or growth <= 1 or recover_after < 1:
            raise ValueError("need 0 < backoff < 1, growth > 1, recover_after >= 1")
        self.ceiling = ceiling
        self.floor = floor
        self.current = ceiling
        self.backoff = backoff
        self.growth = growth
        self.recover_after = recover_after
        self._streak = 0

    def on_oom(self, failed_cost: int) -> int:
        """A batch costing ``failed_cost`` tokens ran out of memory; returns the new budget."""
        self._streak = 0
        target = int(min(self.current, failed_cost) * self.backoff)
        self.current = max(self.floor, min(self.current, target))
        return self.current

    def on_success(self) -> int:
        """A batch ran without an OOM; returns the (maybe raised) budget."""
        self._streak += 1
        if self.current < self.ceiling and self._streak >= self.recover_after:
            self._streak = 0
            self.current = min(self.ceiling, max(self.current + 1, int(self.current * self.growth)))
        return self.current
