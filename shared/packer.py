"""Every batching decision tokenq makes lives in this module.

Sans-I/O: it buffers requests (exact token length, arrival time, priority) and, asked for a
batch, returns one or nothing; the caller passes ``now_ms`` and reports each batch's time.

Rules:

1. **Line.** Requests stand in line by *virtual arrival*: arrival minus ``priority x
   aging_ms``; a higher class goes first, a lower one ages into the front, none starves.
2. **Anchor.** A batch is built around one request, filled from its neighbours in a
   length-sorted view, always taking the one that adds the least padding.
3. **Padding guard.** A candidate adding more padding than ``max_padding_ratio`` times its
   own length is left for a later batch of its own kind.
4. **Seal.** A batch is *sealed* when the next candidate would break the token budget or the
   row limit. Cost is ``rows x longest`` (padded) or the sum of lengths (ragged); with
   ``max_batch_ms``, the budget is capped at what :class:`BatchTimer` says runs that long;
   while a tenant without a backlog shares the device (``light`` set), at
   :data:`SHARED_FIXED_TIMES` a batch's fixed time: its query waits for a short batch.
5. **Linger.** Asked only when the device is idle; an unsealed batch waits until
   ``linger_ms`` after its anchor arrived, a sealed one goes at once.
6. **Choice.** The cheapest batch goes next among the head's and those anchored at the same
   or a higher priority: (a) a sealed one while the head's lingers, (b) any ready one. A
   head passed over for ``aging_ms`` goes next once its batch is ready (the aging bound), so
   a query is not held behind passages read while the last batch ran, however long it ran.
   While ``light`` says which requests are a tenant's without a backlog, the batch around the
   first of them in line is weighed too (the aging bound's head's beside it), and does not
   linger once another batch may go: its query waits for the batch on the device, not for the
   other tenant's read-ahead.
7. **Oversize.** A request whose length alone breaks the budget goes alone.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from enum import Enum
from typing import Any, Generic, TypeVar

from tokenq.shared import wire

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
"""How much earlier each priority class stands in line, and the aging bound (rules 1, 6)."""
MAX_PRIORITY = wire.MAX_PRIORITY
SHARED_FIXED_TIMES = 4.0
"""While tenants share the device, no batch is planned longer than this many times the time
model's fixed time per batch: the wait a batch on the device makes another tenant's query pay
stays near the query's own batch, and a full capped batch spends a quarter of its time on the
fixed cost."""
_CANDIDATES = 3
"""Batches weighed against each other per pick: the head's and up to two others."""
_CANDIDATE_SCAN = 64
"""How far down the line the packer looks for other anchors (a bound on pick cost)."""
_LENGTH_ORDER = operator.attrgetter("length", "seq")
"""The length view's order, as a sort key for items (a batch's rows go out in it)."""
_COST = operator.attrgetter("cost")
"""Rule 6's order of candidates: cost, which a batch's time rises with."""


@dataclass(slots=True)
class Item(Generic[T]):
    """One buffered request. Not frozen: made per request on the hot path
    (docs/decisions/0024-per-request-records-not-frozen.md)."""

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
    """A batch weighed in a pick: its anchor and its rows as (length, seq), ascending; its
    items are looked up only if it is chosen."""

    anchor: Item[T]
    rows: list[tuple[int, int]]
    cost: int
    sealed: bool

    @property
    def span(self) -> tuple[int, int]:
        """The shortest and the longest length among its rows."""
        return self.rows[0][0], self.rows[-1][0]


class BatchTimer:
    """``ms = fixed + per_token x cost``, fitted by least squares with exponential forgetting
    to the batches that ran; until ``min_batches`` it answers from a prior and caps nothing."""

    DECAY = 0.95
    """Each batch observed weighs this much less at every later one."""

    def __init__(self, *, min_batches: int = 8) -> None:
        self.min_batches = min_batches
        self.batches = 0
        self.fixed_ms = 1.0
        self.per_token_ms = 0.001
        self._sums = [0.0] * 5  # weight, x, y, xx, xy

    def observe(self, cost: int, ms: float) -> None:
        """One batch of ``cost`` tokens took ``ms`` milliseconds."""
        if cost < 1 or not ms >= 0 or ms == float("inf"):
            return
        sums = [value * self.DECAY for value in self._sums]
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

    def ms(self, cost: int) -> float:
        """The time a batch of ``cost`` tokens is expected to take."""
        return self.fixed_ms + self.per_token_ms * cost

    @property
    def learned(self) -> bool:
        return self.batches >= self.min_batches

    def cost_within(self, ms: float) -> int | None:
        """The largest cost expected to run within ``ms``; None until learned."""
        if not self.learned:
            return None
        return max(1, int((ms - self.fixed_ms) / self.per_token_ms))


Entry = tuple[float, int]
"""(virtual arrival, sequence): the line's order; sequences are unique."""
SLACK = 64
"""Removed entries of the line tolerated beyond the live count before the list is rebuilt."""


def _insert_sorted(ordered: list[Any], new: list[Any]) -> int:
    """Put ``new`` into the sorted list ``ordered``: one by a bisection, more appended and sorted
    once (about one pass over an already sorted list); the first position that changed."""
    if len(new) == 1:
        position = bisect.bisect_left(ordered, new[0])
        ordered.insert(position, new[0])
        return position
    ordered += new
    ordered.sort()
    return 0


class ArrivalLine:
    """The packer's line (rule 1's order), with requests taken out lazily: a removed entry
    stays, skipped, until the head passes it or removed ones outnumber live ones plus
    :data:`SLACK`; ``live`` (the packer's mapping) says which sequences are still buffered."""

    def __init__(self, live: Collection[int]) -> None:
        self._live = live
        self._entries: list[Entry] = []
        """Ascending; entries whose sequence is not in ``live`` are removed ones."""
        self._start = 0
        """Every entry before this index is a removed one."""
        self._removed = 0
        """How many removed entries the list still holds."""

    def add(self, entries: list[Entry]) -> None:
        """Put requests in line (their sequences must already be live)."""
        self._start = min(self._start, _insert_sorted(self._entries, entries))

    def removed(self, count: int) -> None:
        """``count`` requests left the buffer; rebuild when removed ones are too many."""
        self._removed += count
        if self._removed > len(self._live) + SLACK:
            live = self._live
            self._entries = [entry for entry in self._entries if entry[1] in live]
            self._start = self._removed = 0

    def head(self) -> int | None:
        """The first live sequence in line, or None when nothing is buffered."""
        line, live, start = self._entries, self._live, self._start
        end = len(line)
        while start < end and line[start][1] not in live:
            start += 1
        self._start = start
        return line[start][1] if start < end else None

    def seqs(self) -> Iterator[int]:
        """Live sequences in line order, from the head."""
        self.head()  # moves the start past removed entries at the front
        live = self._live
        return (seq for _, seq in itertools.islice(self._entries, self._start, None)
                if seq in live)

    def entries(self) -> list[Entry]:
        """The live entries, in order (a copy: for views and tests)."""
        live = self._live
        return [entry for entry in self._entries if entry[1] in live]

    def held(self) -> int:
        """Entries the list holds, removed ones included (the bound tests check)."""
        return len(self._entries)


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
        self._passed = (-1, 0.0)
        """(seq, ms): the head the last pick passed over, and when it was first passed over."""
        self.light: Callable[[T], bool] | None = None
        """Set while a tenant without a backlog is active beside another: which requests are
        its (rule 6); batches are capped (rule 4)."""

    def add(self, length: int, arrived_ms: float, payload: T, priority: int = 0) -> Item[T]:
        """Buffer one request whose exact token length is known."""
        return self.add_all([(length, arrived_ms, payload, priority)])[0]

    def add_all(self, requests: Iterable[tuple[int, float, T, int]]) -> list[Item[T]]:
        """Buffer a whole read: (exact length, arrival ms, payload, priority) each, appended and
        sorted once (docs/decisions/0005-packer-takes-whole-reads.md); a bad one adds nothing."""
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
        _insert_sorted(self._by_length, [(item.length, item.seq) for item in made])
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

    def next_batch(self, now_ms: float, *, flush: bool = False) -> Batch[T] | None:
        """The next batch for an idle device, or None to wait; ``flush`` skips the linger."""
        chosen = self._choose(now_ms, flush)
        if chosen is None:
            return None
        lookup = self._items
        items = tuple([lookup[seq] for _, seq in chosen.rows])
        self._discard_all(items)
        return Batch(items=items, cost=chosen.cost, sealed=chosen.sealed)

    def peek(self, now_ms: float) -> Batch[T] | None:
        """The head's batch (rules 2-4), ready or not, without removing it; the head first."""
        del now_ms  # the head's batch does not depend on time; kept for symmetry
        head = self.head()
        if head is None:
            return None
        built = self._build(head, self.budget_now())
        lookup = self._items
        rest = [lookup[seq] for _, seq in built.rows if seq != head.seq]
        return Batch(items=(head, *rest), cost=built.cost, sealed=built.sealed)

    def _choose(self, now_ms: float, flush: bool) -> Candidate[T] | None:
        """Rule 6: the cheapest batch that may go now; the head's once it was passed over for
        ``aging_ms``."""
        head = self.head()
        if head is None:
            return None
        budget = self.budget_now()
        first = self._build(head, budget)
        head_ready = self._ready(first, now_ms, flush)
        seq, since = self._passed
        if seq != head.seq:
            since = now_ms
        if head_ready and now_ms - since >= self.aging_ms:
            ready = [first]  # the aging bound: passed over this long, the head goes next
        elif head_ready:
            ready = [first, *(batch for batch in self._other_candidates(first, budget)
                              if self._ready(batch, now_ms, flush))]
        else:
            ready = [batch for batch in self._other_candidates(first, budget) if batch.sealed]
        light = self._light_batch(head, budget)
        if ready and light is not None:
            ready.append(light)
        chosen = min(ready, key=_COST, default=None)  # ties keep the head's
        if chosen is not None and chosen is not first:
            self._passed = (head.seq, since)
        return chosen

    def _other_candidates(self, first: Candidate[T], budget: Budget) -> list[Candidate[T]]:
        """Batches anchored further down the line, at requests of the head's priority or more;
        an anchor whose length lies within a batch already built would weigh nothing new."""
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

    def _light_batch(self, head: Item[T], budget: Budget) -> Candidate[T] | None:
        """The batch of requests ``light`` names around the first of them in line, at the
        head's priority or more (rule 6); None when it names none."""
        light, items = self.light, self._items
        if light is None:
            return None
        for seq in self._line.seqs():
            item = items[seq]
            if item.priority >= head.priority and light(item.payload):
                built = self._build(item, budget)
                rows = [row for row in built.rows if light(items[row[1]].payload)]
                total = sum(length for length, _ in rows)
                return Candidate(item, rows, budget.cost(len(rows), rows[-1][0], total),
                                 built.sealed)
        return None

    def _ready(self, batch: Candidate[T], now_ms: float, flush: bool) -> bool:
        return batch.sealed or flush or now_ms >= batch.anchor.arrived_ms + self.linger_ms

    def budget_now(self) -> Budget:
        """The budget batches are packed under now: ``budget``, capped by ``max_batch_ms`` and,
        while ``light`` is set, by a few fixed times per batch, once the time model has learned
        (rule 4)."""
        limits = [] if self.max_batch_ms is None else [self.max_batch_ms]
        if self.light is not None and self.timer.fixed_ms > 0:
            limits.append(SHARED_FIXED_TIMES * self.timer.fixed_ms)
        if not limits:
            return self.budget
        cap = self.timer.cost_within(min(limits))
        if cap is None or cap >= self.budget.max_batch_tokens:
            return self.budget
        return replace(self.budget, max_batch_tokens=cap)

    def _build(self, anchor: Item[T], budget: Budget) -> Candidate[T]:
        """Rules 2-4 and 7: the batch around ``anchor``, by the budget's cost model."""
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
            # Not even a 1-token request could join: lingering would only waste time.
            sealed = True
        return Candidate(anchor, rows, budget.cost(len(rows), longest, total), sealed)

    def _padded_rows(
        self, order: list[tuple[int, int]], position: int, budget: Budget
    ) -> tuple[int, int, bool]:
        """The padded batch around ``order[position]``: ``order[low:high]``, and whether sealed.

        Each step takes the side whose next request adds the least padding (ties: the
        shorter), and all of that length's run the budget allows: exactly the rows one request
        at a time would pick. A side closes when its next request breaks the padding guard
        (unsealed) or does not fit (sealed).
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
        """Take ``items`` (ascending (length, seq)) out of the buffer and both views: one slice
        when they are adjacent in the length view, else one bisection each."""
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
    """The ragged batch around ``order[position]``, ascending, and whether it is sealed: every
    request below (longest first, skipping what does not fit), then above until one does not."""
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


@dataclass(slots=True)
class AdaptiveBudget:
    """The token budget after out-of-memory errors: ``backoff`` x the failed cost (not below
    ``floor``), then ``growth`` x after ``recover_after`` clean batches, up to ``ceiling``."""

    ceiling: int
    floor: int
    _: KW_ONLY
    backoff: float = 0.75
    growth: float = 1.05
    recover_after: int = 20
    current: int = field(init=False)
    _streak: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError(f"need 1 <= floor ({self.floor}) <= ceiling ({self.ceiling})")
        if not 0 < self.backoff < 1 or self.growth <= 1 or self.recover_after < 1:
            raise ValueError("need 0 < backoff < 1, growth > 1, recover_after >= 1")
        self.current = self.ceiling

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
