"""Every batching decision tokenq makes lives in this module.

The packer is sans-I/O: it holds the worker's buffer of requests (each with its
exact token length, the time it arrived and its priority), and when asked for
a batch it returns one or nothing. It never reads a clock, never awaits, never
touches Redis; the caller passes ``now_ms`` and reports how long each batch
took. That makes every rule below testable with hypothesis.

Rules (the packer's part of docs/ARCHITECTURE.md, in full):

1. **Line.** Requests stand in line by *virtual arrival*: arrival time minus
   ``priority x aging_ms``. A request of priority 1 stands as if it had come
   ``aging_ms`` earlier than it did, so it goes before priority-0 requests
   that arrived less than ``aging_ms`` before it, and after older ones: a
   higher class goes first, a lower class ages into the front, nothing
   starves. With every priority 0 (the default) the line is arrival order.
2. **Anchor.** A batch is built around one request, its anchor, filled from
   the anchor's neighbours in a length-sorted view of the buffer, always
   taking the neighbour that adds the least padding; so similar lengths ride
   together without fixed buckets.
3. **Padding guard.** A candidate that would add more padding than
   ``max_padding_ratio`` times its own length is left for a later batch of its
   own kind (a 20-token query does not ride in a batch padded to 1,500, nor a
   passage join 30 queries): mixing them costs the device more than running
   them apart.
4. **Seal.** A batch is *sealed* when the next candidate would break the token
   budget or the row limit. Cost is ``rows x longest`` for a padded model and
   the sum of lengths for a ragged (varlen) one. With ``max_batch_ms`` set, the
   budget is also capped at the cost the learned time model (:class:`BatchTimer`)
   says runs within that many milliseconds, so no batch is planned to hold the
   device longer while other work waits.
5. **Linger.** The packer is only asked for a batch when the device is idle. A
   batch that is not sealed (the buffer ran out before the budget did) is held
   back until ``linger_ms`` after its anchor arrived, hoping for company; a
   sealed batch goes at once. While the device is busy nobody asks, so input
   accumulates and the next batch is full.
6. **Choice.** The next batch is the one anchored at the head of the line,
   except that another batch may go first when it is anchored at a request of
   the same or a higher priority and either
   (a) the head's batch is still lingering and the other one is sealed (the
   device never idles while a full batch waits), or
   (b) both are ready and the other has the higher *response ratio*
   ``(wait + estimate) / estimate`` (wait counted from the virtual arrival,
   estimate from the time model): a cheap batch of short requests does not
   wait long behind an expensive one, and every wait grows until it wins.
   Rule (b) never passes over a head that has waited ``aging_ms`` or more:
   that head goes in the next batch. This is the aging bound.
7. **Oversize.** A request whose length alone breaks the budget goes alone
   (the worker refuses budgets below the model's maximum input length, so this
   only happens after an out-of-memory error has lowered the budget, or under a
   ``max_batch_ms`` cap).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Generic, TypeVar

from tokenq.shared import wire
from tokenq.shared.arrival_line import ArrivalLine

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


DEFAULT_AGING_MS = 1000.0
"""How much earlier each priority class stands in line, and the wait after which the
head of the line is never passed over (rules 1 and 6)."""

MAX_PRIORITY = wire.MAX_PRIORITY
"""Priorities run from 0 (the default) to this (the wire format's limit)."""

_CANDIDATES = 3
"""Batches weighed against each other per pick: the head's and up to two others."""

_CANDIDATE_SCAN = 64
"""How far down the line the packer looks for other anchors (a bound on pick cost)."""

_LENGTH_ORDER = operator.attrgetter("length", "seq")
"""The length view's order, as a sort key for items (a batch's rows go out in it)."""


@dataclass(slots=True)
class Item(Generic[T]):
    """One buffered request: its exact token length, arrival time, priority and payload.

    Not frozen, though nothing changes one once made: one is made per request on the
    worker's hot path, and a frozen dataclass's ``__init__`` sets every field through
    ``object.__setattr__``, three times the cost
    (docs/decisions/0024-per-request-records-not-frozen.md).
    """

    length: int
    arrived_ms: float
    payload: T
    seq: int = field(default=-1, compare=False)
    priority: int = 0


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


@dataclass(slots=True)
class Candidate(Generic[T]):
    """A batch weighed in a pick: its anchor, its rows as the length view names them
    ((length, seq), ascending, the anchor's included), its cost and whether it is sealed.

    Why not a :class:`Batch`: a pick weighs up to three, and looking up the
    items of the ones not chosen was a pass per row for nothing.
    """

    anchor: Item[T]
    rows: list[tuple[int, int]]
    cost: int
    sealed: bool

    @property
    def span(self) -> tuple[int, int]:
        """The shortest and the longest length among its rows."""
        return self.rows[0][0], self.rows[-1][0]


class BatchTimer:
    """How long a batch of a given cost runs on this device, learned from the batches that ran.

    A straight line ``ms = fixed + per_token x cost``, fitted by least squares
    with exponential forgetting (each new batch weighs ``1 / (1 - decay)``
    batches' worth), so it follows a device that warms up or is shared. Until
    ``min_batches`` have been seen it answers from a prior (1 ms + 1 µs per
    token) and :meth:`cost_within` declines to cap anything.
    """

    def __init__(self, *, decay: float = 0.95, min_batches: int = 8) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.min_batches = min_batches
        self.batches = 0
        self.fixed_ms = 1.0
        self.per_token_ms = 0.001
        self._sums = [0.0] * 5  # weight, x, y, xx, xy

    def observe(self, cost: int, ms: float) -> None:
        """One batch of ``cost`` tokens took ``ms`` milliseconds."""
        if cost < 1 or not ms >= 0 or ms == float("inf"):
            return
        sums = [value * self.decay for value in self._sums]
        for index, value in enumerate((1.0, cost, ms, cost * cost, cost * ms)):
            sums[index] += value
        self._sums = sums
        self.batches += 1
        weight, x, y, xx, xy = sums
        mean_x, mean_y = x / weight, y / weight
        spread = xx / weight - mean_x * mean_x
        if spread > 1e-9 * max(1.0, mean_x * mean_x):
            slope = (xy / weight - mean_x * mean_y) / spread
            if slope > 0:
                self.per_token_ms = slope
                self.fixed_ms = max(0.0, mean_y - slope * mean_x)
                return
        # Every batch the same size (or time falling with cost): proportional fit.
        self.per_token_ms = max(mean_y, 1e-6) / max(mean_x, 1.0)
        self.fixed_ms = 0.0

    @property
    def learned(self) -> bool:
        return self.batches >= self.min_batches

    def estimate_ms(self, cost: int) -> float:
        return self.fixed_ms + self.per_token_ms * cost

    def cost_within(self, ms: float) -> int | None:
        """The largest cost expected to run within ``ms``; None until learned."""
        if not self.learned:
            return None
        return max(1, int((ms - self.fixed_ms) / self.per_token_ms))


class Packer(Generic[T]):
    """A buffer of requests that hands out token-budgeted batches."""

    def __init__(
        self,
        budget: Budget,
        linger_ms: float = 0.0,
        *,
        max_padding_ratio: float = 1.0,
        aging_ms: float = DEFAULT_AGING_MS,
        max_batch_ms: float | None = None,
        timer: BatchTimer | None = None,
    ) -> None:
        if linger_ms < 0:
            raise ValueError(f"linger_ms must be >= 0, got {linger_ms}")
        if max_padding_ratio < 0:
            raise ValueError(f"max_padding_ratio must be >= 0, got {max_padding_ratio}")
        if not aging_ms > 0:
            raise ValueError(f"aging_ms must be > 0, got {aging_ms}")
        if max_batch_ms is not None and not max_batch_ms > 0:
            raise ValueError(f"max_batch_ms must be > 0, got {max_batch_ms}")
        self.budget = budget
        self.linger_ms = float(linger_ms)
        self.max_padding_ratio = float(max_padding_ratio)
        self.aging_ms = float(aging_ms)
        self.max_batch_ms = max_batch_ms
        self.timer = timer if timer is not None else BatchTimer()
        self._items: dict[int, Item[T]] = {}
        self._by_length: list[tuple[int, int]] = []  # (length, seq), ascending
        self._line = ArrivalLine(self._items.keys())  # rule 1's order, removed lazily
        self._seq = itertools.count()
        self._tokens = 0

    # ------------------------------------------------------------------ buffer

    def add(self, length: int, arrived_ms: float, payload: T, priority: int = 0) -> Item[T]:
        """Buffer one request whose exact token length is known."""
        return self.add_all([(length, arrived_ms, payload, priority)])[0]

    def add_all(self, requests: Iterable[tuple[int, float, T, int]]) -> list[Item[T]]:
        """Buffer many requests at once: (exact length, arrival ms, payload, priority) each.

        Why not :meth:`add` in a loop: the worker buffers a whole read at a
        time, and inserting one by one cost two ``insort`` calls and a method
        call per request (1.1-1.7 µs; 0.54 here: the new entries are appended
        and each view sorted once, which Timsort does in about one pass over
        the already sorted buffer). Every request is checked before any is
        buffered, so a bad one adds nothing.
        """
        seq = self._seq
        made = [Item(length, arrived_ms, payload, next(seq), priority)
                for length, arrived_ms, payload, priority in requests]
        for item in made:
            if item.length < 1:
                raise ValueError(f"length must be >= 1, got {item.length}")
            if not 0 <= item.priority <= MAX_PRIORITY:
                raise ValueError(
                    f"priority must be from 0 to {MAX_PRIORITY}, got {item.priority}")
        virtual_arrival = self.virtual_arrival
        self._items.update((item.seq, item) for item in made)
        if len(made) == 1:  # one request: a bisection, not a pass over the buffer
            item = made[0]
            bisect.insort(self._by_length, (item.length, item.seq))
        else:
            self._by_length += [(item.length, item.seq) for item in made]
            self._by_length.sort()
        self._line.add([(virtual_arrival(item), item.seq) for item in made])
        self._tokens += sum(item.length for item in made)
        return made

    def remove_where(self, predicate: Callable[[T], bool]) -> list[Item[T]]:
        """Take out every buffered item whose payload matches (expired, claimed away)."""
        gone = [item for item in self._items.values() if predicate(item.payload)]
        if gone:
            self._discard_all(sorted(gone, key=_LENGTH_ORDER))
        return gone

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item[T]]:
        return iter(self._items.values())

    @property
    def buffered_tokens(self) -> int:
        """Sum of the exact lengths of everything buffered."""
        return self._tokens

    def virtual_arrival(self, item: Item[T]) -> float:
        """Where ``item`` stands in line (rule 1): arrival less ``priority x aging_ms``."""
        return item.arrived_ms - item.priority * self.aging_ms

    def head(self) -> Item[T] | None:
        """The request at the head of the line (earliest virtual arrival, then first added)."""
        seq = self._line.head()
        return None if seq is None else self._items[seq]

    def ready_at(self) -> float | None:
        """When the head's unsealed batch stops lingering (ms), or None with an empty buffer."""
        head = self.head()
        return None if head is None else head.arrived_ms + self.linger_ms

    def observe(self, cost: int, ms: float) -> None:
        """A batch of ``cost`` tokens took ``ms`` on the device (feeds the time model)."""
        self.timer.observe(cost, ms)

    # ----------------------------------------------------------------- batching

    def next_batch(self, now_ms: float, *, flush: bool = False) -> Batch[T] | None:
        """The next batch for an idle device, or None to wait for more input.

        ``flush`` skips the linger (used when draining on shutdown).
        """
        chosen = self._choose(now_ms, flush)
        if chosen is None:
            return None
        lookup = self._items
        items = tuple([lookup[seq] for _, seq in chosen.rows])
        self._discard_all(items)
        return Batch(items=items, cost=chosen.cost, sealed=chosen.sealed)

    def peek(self, now_ms: float) -> Batch[T] | None:
        """The head's batch (rules 2-4), without removing it; ready or not.

        ``items[0]`` is the head (the anchor); the caller's linger check reads
        its arrival time.
        """
        del now_ms  # the head's batch does not depend on time; kept for symmetry
        head = self.head()
        if head is None:
            return None
        built = self._build(head, self.budget_now())
        lookup = self._items
        rest = [lookup[seq] for _, seq in built.rows if seq != head.seq]
        return Batch(items=(head, *rest), cost=built.cost, sealed=built.sealed)

    def _choose(self, now_ms: float, flush: bool) -> Candidate[T] | None:
        """Rule 6: the head's batch, or another one that may go before it."""
        head = self.head()
        if head is None:
            return None
        budget = self.budget_now()
        first = self._build(head, budget)
        head_ready = self._ready(first, now_ms, flush)
        if head_ready and now_ms - head.arrived_ms >= self.aging_ms:
            return first  # the aging bound: a head this old is never passed over
        others = self._other_candidates(first, budget)
        if not head_ready:
            sealed = [batch for batch in others if batch.sealed]
            return max(sealed, key=lambda b: self._ratio(b, now_ms), default=None)
        ready = [first, *(batch for batch in others if self._ready(batch, now_ms, flush))]
        return max(ready, key=lambda b: self._ratio(b, now_ms))  # ties keep the head's

    def _other_candidates(self, first: Candidate[T], budget: Budget) -> list[Candidate[T]]:
        """Batches anchored further down the line, at requests of the head's priority or more.

        An anchor whose length lies within a batch already built is skipped:
        it is of that batch's kind and was left out only by the budget or the
        row limit, so a batch around it would cost about the same and weigh
        nothing new (and uniform traffic costs one build per pick, not three).
        """
        head = first.anchor
        spans = [first.span]
        found: list[Candidate[T]] = []
        for seq in itertools.islice(self._line.seqs(), 1, _CANDIDATE_SCAN):
            if len(found) >= _CANDIDATES - 1:
                break
            item = self._items[seq]
            if item.priority < head.priority or any(
                low <= item.length <= high for low, high in spans
            ):
                continue
            batch = self._build(item, budget)
            spans.append(batch.span)
            found.append(batch)
        return found

    def _ready(self, batch: Candidate[T], now_ms: float, flush: bool) -> bool:
        return batch.sealed or flush or now_ms >= batch.anchor.arrived_ms + self.linger_ms

    def _ratio(self, batch: Candidate[T], now_ms: float) -> float:
        """Response ratio: (wait + estimated run time) / estimated run time."""
        estimate = max(self.timer.estimate_ms(batch.cost), 1e-3)
        waited = max(0.0, now_ms - self.virtual_arrival(batch.anchor))
        return (waited + estimate) / estimate

    def budget_now(self) -> Budget:
        """The budget batches are packed under now: ``budget``, capped by
        ``max_batch_ms`` once the time model has learned (rule 4)."""
        if self.max_batch_ms is None:
            return self.budget
        cap = self.timer.cost_within(self.max_batch_ms)
        if cap is None or cap >= self.budget.max_batch_tokens:
            return self.budget
        return replace(self.budget, max_batch_tokens=cap)

    def _build(self, anchor: Item[T], budget: Budget) -> Candidate[T]:
        """Rules 2-4 and 7: the batch around ``anchor``.

        The rows come from :meth:`_padded_rows` or :func:`_ragged_rows`, by
        the budget's cost model; both take, one step at a time, the side whose
        next request adds the least padding (ties: the shorter). Its items are
        looked up only if it is chosen (most candidates of a pick are not).
        """
        order = self._by_length
        position = bisect.bisect_left(order, (anchor.length, anchor.seq))
        if budget.cost_model is CostModel.PADDED:
            low, high, sealed = self._padded_rows(order, position, budget)
            rows = order[low:high]
            total = 0  # a padded cost does not read it
        else:
            rows, sealed = _ragged_rows(order, position, budget)
            total = sum(length for length, _ in rows)
        longest = rows[-1][0]
        if not sealed and not budget.fits(len(rows) + 1, longest, total + 1):
            # Not even a 1-token request could join (a full budget, or a lone
            # oversize request): lingering for company would only waste time.
            sealed = True
        return Candidate(anchor, rows, budget.cost(len(rows), longest, total), sealed)

    def _padded_rows(
        self, order: list[tuple[int, int]], position: int, budget: Budget
    ) -> tuple[int, int, bool]:
        """The padded batch around ``order[position]``: ``order[low:high]``, and whether
        the budget or the row limit sealed it.

        Each step takes the side whose next request adds the least padding
        (ties: the shorter). A side closes for good when its next request
        would add more padding than it brings tokens (further out it only gets
        worse; the batch is not sealed, since similar input may come), or when
        it does not fit (sealed: a longer one costs more, and a shorter one
        costs the longest all the same).

        A step takes that request's whole run of equal lengths, as far as the
        budget and the row limit allow, which picks exactly the rows one
        request at a time would, at a cost per distinct length instead of per
        row. Why nothing else can end a run: below, the run's padding
        (``longest - length``) stays the same while the other side's
        (``rows x (up - longest)``) only grows with the rows; above, once the
        run's first request is in it is the longest, so the rest add no
        padding against a positive padding below (at a tie of zero padding
        below goes first, and then all of its run does).
        """
        max_rows, max_tokens = budget.max_batch_size, budget.max_batch_tokens
        ratio = self.max_padding_ratio
        low, high, end = position, position + 1, len(order)
        below_open, above_open = low > 0, high < end
        longest = order[position][0]
        sealed = False
        while True:
            rows = high - low
            if rows >= max_rows:
                return low, high, True
            if not (below_open or above_open):
                return low, high, sealed
            if below_open:
                length = order[low - 1][0]
                padding = longest - length
                take_below = True
                if above_open:
                    up = order[high][0]
                    up_padding = rows * (up - longest)
                    if (up_padding, up) < (padding, length):
                        take_below, length, padding = False, up, up_padding
            else:
                length = order[high][0]
                padding = rows * (length - longest)
                take_below = False
            if padding > ratio * length:
                if take_below:
                    below_open = False
                else:
                    above_open = False
                continue
            new_longest = max(longest, length)
            fit = min(max_tokens // new_longest - rows, max_rows - rows)
            if fit < 1:
                sealed = True
                if take_below:
                    below_open = False
                else:
                    above_open = False
                continue
            longest = new_longest
            if take_below:
                low -= min(low - bisect.bisect_left(order, (length,), 0, low), fit)
                below_open = low > 0
            else:
                high += min(bisect.bisect_left(order, (length + 1,), high) - high, fit)
                above_open = high < end

    def _discard_all(self, items: Sequence[Item[T]]) -> None:
        """Take ``items`` (in ascending (length, seq) order) out of the buffer and both views.

        A padded batch is one slice of the length view, removed in one step;
        anything else goes one bisection at a time. The line drops them lazily
        (:class:`~tokenq.shared.arrival_line.ArrivalLine`).
        """
        order = self._by_length
        first = bisect.bisect_left(order, (items[0].length, items[0].seq))
        last = first + len(items) - 1
        if last < len(order) and order[last] == (items[-1].length, items[-1].seq):
            del order[first:last + 1]
        else:
            for item in items:
                del order[bisect.bisect_left(order, (item.length, item.seq))]
        buffered = self._items
        for item in items:
            del buffered[item.seq]
        self._tokens -= sum(item.length for item in items)
        self._line.removed(len(items))


def _ragged_rows(
    order: list[tuple[int, int]], position: int, budget: Budget
) -> tuple[list[tuple[int, int]], bool]:
    """The ragged batch around ``order[position]``, ascending, and whether it is sealed.

    A ragged row adds no padding, so the shorter side always goes first (rule
    2's tie): every request below, longest first, then every one above,
    shortest first. The budget counts each row's own length, so below, a
    request that does not fit is passed over (a shorter one further down
    may); above, the first that does not fit ends the batch.
    """
    max_rows, max_tokens = budget.max_batch_size, budget.max_batch_tokens
    total = order[position][0]
    below: list[tuple[int, int]] = []
    above: list[tuple[int, int]] = []
    walk = itertools.chain(((index, below) for index in range(position - 1, -1, -1)),
                           ((index, above) for index in range(position + 1, len(order))))
    sealed = False
    for index, side in walk:
        if len(below) + len(above) + 1 >= max_rows:
            break
        length = order[index][0]
        if total + length > max_tokens:
            sealed = True
            if side is above:
                break
            continue
        side.append(order[index])
        total += length
    sealed = sealed or len(below) + len(above) + 1 >= max_rows
    below.reverse()
    return [*below, order[position], *above], sealed


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
