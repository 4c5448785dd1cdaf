"""Property tests of the sans-I/O packer: every rule in shared/packer.py, driven by hypothesis.

The packer never reads a clock, so these tests pass ``now_ms`` explicitly and
never sleep. Each property below is one rule a worker relies on: the budget is
a memory bound (a. g), nothing is lost or duplicated (b), nothing starves (c),
lingering is bounded (d), removal keeps the token count honest (e), and packing
by nearest length actually saves padding (f).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tokenq.shared import packer as rules
from tokenq.shared.packer import MAX_PRIORITY, Batch, BatchTimer, Budget, CostModel, Item, Packer

pytestmark = pytest.mark.unit

PROPERTY = settings(max_examples=200, deadline=None)

lengths = st.integers(min_value=1, max_value=4096)
arrivals = st.integers(min_value=0, max_value=10_000).map(float)
cost_models = st.sampled_from(list(CostModel))
row_limits = st.integers(min_value=1, max_value=64)
lingers = st.integers(min_value=0, max_value=50).map(float)
priorities = st.sampled_from([0, 0, 0, 1, 2])


@st.composite
def workloads(
    draw: st.DrawFn, *, allow_oversize: bool = False, max_items: int = 60
) -> tuple[Budget, list[tuple[int, float]]]:
    """A budget and a list of (length, arrived_ms) to buffer.

    Unless ``allow_oversize``, the token budget is at least the longest length,
    as the worker guarantees at start-up (docs/ARCHITECTURE.md, "Over-long input").
    """
    items = draw(st.lists(st.tuples(lengths, arrivals), min_size=1, max_size=max_items))
    longest = max(length for length, _ in items)
    low = 1 if allow_oversize else longest
    tokens = draw(st.integers(min_value=low, max_value=max(low, 8 * longest)))
    budget = Budget(
        max_batch_tokens=tokens, max_batch_size=draw(row_limits), cost_model=draw(cost_models)
    )
    return budget, items


def fill(packer: Packer[int], items: Iterable[tuple[int, float]]) -> None:
    """Buffer items whose payload is their index, so batches are easy to check."""
    for index, (length, arrived) in enumerate(items):
        packer.add(length, arrived, index)


def drain(packer: Packer[int], now_ms: float = 1e12) -> list[Batch[int]]:
    """Empty the packer the way a worker does on shutdown."""
    batches = []
    while (batch := packer.next_batch(now_ms, flush=True)) is not None:
        batches.append(batch)
    return batches


def assert_within_budget(batch: Batch[int], budget: Budget) -> None:
    """Rule 3 and 5: within the limits, unless one item alone breaks the budget."""
    assert 1 <= batch.rows <= budget.max_batch_size
    assert batch.cost == budget.cost(batch.rows, batch.longest, batch.tokens)
    if batch.cost > budget.max_batch_tokens:
        assert batch.rows == 1, f"an oversize item rode with company: {batch}"
        assert batch.items[0].length > budget.max_batch_tokens
    lengths_in_order = [item.length for item in batch.items]
    assert lengths_in_order == sorted(lengths_in_order)


def head_of(items: Iterable[Item[int]], aging_ms: float) -> Item[int]:
    """The head of the line rule 1 promises: earliest virtual arrival, then earliest added."""
    return min(items, key=lambda item: (item.arrived_ms - item.priority * aging_ms, item.seq))


# ------------------------------------------------------------ (a) (b) (g) budget


@PROPERTY
@given(workloads(), lingers)
def test_drain_respects_budget_and_yields_every_item_once(
    workload: tuple[Budget, list[tuple[int, float]]], linger_ms: float
) -> None:
    budget, items = workload
    packer: Packer[int] = Packer(budget, linger_ms=linger_ms)
    fill(packer, items)
    assert packer.buffered_tokens == sum(length for length, _ in items)

    batches = drain(packer)

    for batch in batches:
        assert_within_budget(batch, budget)
        # The budget is at least the longest item here, so nothing may exceed it.
        assert batch.cost <= budget.max_batch_tokens
        if budget.cost_model is CostModel.RAGGED:
            assert batch.tokens <= budget.max_batch_tokens
        else:
            assert batch.rows * batch.longest <= budget.max_batch_tokens
    seen = [payload for batch in batches for payload in batch.payloads]
    assert sorted(seen) == list(range(len(items)))
    assert len(packer) == 0
    assert packer.buffered_tokens == 0
    assert packer.peek(0.0) is None
    assert packer.ready_at() is None


@PROPERTY
@given(workloads(allow_oversize=True))
def test_oversize_items_go_alone_and_everything_else_fits(
    workload: tuple[Budget, list[tuple[int, float]]],
) -> None:
    budget, items = workload
    packer: Packer[int] = Packer(budget)
    fill(packer, items)

    batches = drain(packer)

    for batch in batches:
        assert_within_budget(batch, budget)
        for item in batch.items:
            if item.length > budget.max_batch_tokens:
                assert batch.rows == 1
    assert sorted(p for batch in batches for p in batch.payloads) == list(range(len(items)))


def test_ragged_cost_is_the_sum_of_lengths() -> None:
    """A varlen model fits rows a padded one could not: 60+30+10 = 100, not 3 x 60."""
    items = [(60, 0.0), (30, 1.0), (10, 2.0)]
    ragged: Packer[int] = Packer(Budget(100, 8, CostModel.RAGGED))
    fill(ragged, items)
    batch = ragged.next_batch(0.0, flush=True)
    assert batch is not None
    assert (batch.rows, batch.cost, batch.tokens, batch.padded_tokens) == (3, 100, 100, 180)

    padded: Packer[int] = Packer(Budget(100, 8, CostModel.PADDED), max_padding_ratio=float("inf"))
    fill(padded, items)
    # Padded, the oldest (60) cannot take the 30 (2 x 60 > 100) and goes alone.
    assert [b.payloads for b in drain(padded)] == [[0], [2, 1]]


def test_row_limit_seals_a_batch() -> None:
    packer: Packer[int] = Packer(Budget(10_000, 3), linger_ms=100.0)
    fill(packer, [(5, 0.0)] * 7)
    assert [b.rows for b in drain(packer)] == [3, 3, 1]


def test_fills_with_the_nearest_lengths() -> None:
    """Rule 2: the oldest 100-token request rides with 90-110, not with 1000s."""
    packer: Packer[int] = Packer(Budget(1000, 64))
    fill(packer, [(100, 0.0), (1000, 1.0), (10, 2.0), (110, 3.0), (90, 4.0), (999, 5.0)])
    batch = packer.next_batch(10.0, flush=True)
    assert batch is not None
    # Rule 3: the 10 would add 100 tokens of padding (more than its own 10) and
    # the 999 would add far more than 999, so both wait; nothing broke the
    # budget, so the batch is not sealed (it may linger for company).
    assert not batch.sealed
    assert sorted(item.length for item in batch.items) == [90, 100, 110]


# ------------------------------------------------------------ (c) (d) (e) state


class PackerMachine(RuleBasedStateMachine):
    """Interleaved add / next_batch / remove_where against a plain-list model.

    Arrival times are not monotonic (a claimed-back request may be older than
    what is buffered), and the clock only moves forward, as in a worker.
    """

    def __init__(self) -> None:
        super().__init__()
        self.packer: Packer[int] = Packer(Budget(1, 1))
        self.model: dict[int, Item[int]] = {}
        self.next_payload = 0
        self.now = 0.0
        self.passed: tuple[int, float] = (-1, 0.0)  # the head passed over, and since when

    @initialize(
        tokens=st.integers(min_value=1, max_value=16_384),
        rows=row_limits,
        model=cost_models,
        linger_ms=lingers,
        aging_ms=st.sampled_from([30.0, 100.0, 1000.0]),
    )
    def start(
        self, tokens: int, rows: int, model: CostModel, linger_ms: float, aging_ms: float
    ) -> None:
        # Lengths may exceed the budget: rule 7 must hold mid-stream too.
        self.packer = Packer(Budget(tokens, rows, model), linger_ms=linger_ms, aging_ms=aging_ms)

    @rule(length=lengths, age=st.integers(min_value=0, max_value=100), priority=priorities)
    def add(self, length: int, age: int, priority: int) -> None:
        payload = self.next_payload
        self.next_payload += 1
        item = self.packer.add(length, self.now - age, payload, priority)
        assert (item.length, item.payload, item.priority) == (length, payload, priority)
        self.model[payload] = item

    @rule(requests=st.lists(st.tuples(lengths, st.integers(min_value=0, max_value=100),
                                      priorities), max_size=8))
    def add_all(self, requests: list[tuple[int, int, int]]) -> None:
        """A whole read at once (the worker's path), interleaved with single adds."""
        payloads = range(self.next_payload, self.next_payload + len(requests))
        self.next_payload += len(requests)
        made = self.packer.add_all([(length, self.now - age, payload, priority)
                                    for (length, age, priority), payload
                                    in zip(requests, payloads, strict=True)])
        assert [(item.length, item.payload, item.priority) for item in made] == [
            (length, payload, priority)
            for (length, _, priority), payload in zip(requests, payloads, strict=True)]
        self.model.update((item.payload, item) for item in made)

    @rule(step=st.integers(min_value=0, max_value=60), flush=st.booleans())
    def next_batch(self, step: int, flush: bool) -> None:
        self.now += step
        preview = self.packer.peek(self.now)
        ready = self.packer.ready_at()
        batch = self.packer.next_batch(self.now, flush=flush)
        if not self.model:
            assert preview is None and batch is None and ready is None
            return
        head = head_of(self.model.values(), self.packer.aging_ms)
        assert preview is not None
        assert preview.items[0] == head
        assert ready == head.arrived_ms + self.packer.linger_ms
        due = preview.sealed or flush or self.now >= ready
        if batch is None:
            assert not due, "a due batch was held back"
            return
        assert_within_budget(batch, self.packer.budget)
        if head not in batch.items:
            # Rule 6: only a batch anchored at the head's class or above goes first,
            # only a sealed one while the head lingers, never past an aged head.
            assert max(item.priority for item in batch.items) >= head.priority
            assert due or batch.sealed, "an unsealed batch jumped a lingering head"
            since = self.passed[1] if self.passed[0] == head.payload else self.now
            assert not (due and self.now - since >= self.packer.aging_ms), (
                "a head passed over for aging_ms was passed over again"
            )
            self.passed = (head.payload, since)
        for item in batch.items:
            del self.model[item.payload]

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove_where(self, data: st.DataObject) -> None:
        doomed = data.draw(st.sets(st.sampled_from(sorted(self.model))))
        gone = self.packer.remove_where(lambda payload: payload in doomed)
        assert sorted(item.payload for item in gone) == sorted(doomed)
        for payload in doomed:
            del self.model[payload]

    @invariant()
    def buffer_matches_model(self) -> None:
        assert len(self.packer) == len(self.model)
        assert {item.payload for item in self.packer} == set(self.model)
        assert self.packer.buffered_tokens == sum(i.length for i in self.model.values())

    @invariant()
    def views_are_sorted_and_whole(self) -> None:
        """The length view and the line hold every buffered item once, in order (rules 1-2
        read them by bisection, so one out of place would mis-pack silently)."""
        by_length, line = self.packer._by_length, self.packer._line.entries()
        items = list(self.packer)
        assert by_length == sorted((item.length, item.seq) for item in items)
        assert line == sorted((self.packer.virtual_arrival(item), item.seq) for item in items)


PackerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPackerMachine = PackerMachine.TestCase


@PROPERTY
@given(workloads(), lingers, st.integers(min_value=0, max_value=20_000).map(float))
def test_linger_holds_an_unsealed_batch_until_its_oldest_is_due(
    workload: tuple[Budget, list[tuple[int, float]]], linger_ms: float, now: float
) -> None:
    budget, items = workload
    packer: Packer[int] = Packer(budget, linger_ms=linger_ms)
    fill(packer, items)
    preview = packer.peek(now)
    assert preview is not None
    due_at = preview.items[0].arrived_ms + linger_ms
    assert packer.ready_at() == due_at

    if preview.sealed:
        # A sealed batch goes at once, whatever the clock says: the head's, or
        # a cheaper one that rule 6 lets go first.
        assert packer.next_batch(min(now, due_at - 1.0)) is not None
        return
    early = packer.next_batch(due_at - 0.5)
    # Only a sealed batch (anchored elsewhere) may go while the head lingers.
    assert early is None or early.sealed
    assert len(packer) == len(items) - (early.rows if early else 0)
    if early is not None:
        return
    batch = packer.next_batch(due_at)
    assert batch is not None
    # The head's batch, or one anchored elsewhere that rule 6 preferred.
    assert len(packer) == len(items) - batch.rows


def test_lone_request_lingers_then_goes() -> None:
    packer: Packer[str] = Packer(Budget(1000, 8), linger_ms=5.0)
    packer.add(10, 100.0, "a")
    assert packer.next_batch(104.9) is None
    assert packer.next_batch(100.0, flush=True) is not None  # flush skips the linger
    packer.add(10, 200.0, "b")
    batch = packer.next_batch(205.0)
    assert batch is not None and batch.payloads == ["b"] and not batch.sealed


def test_a_batch_that_cannot_grow_does_not_linger() -> None:
    """A full budget or a lone oversize request gains nothing from waiting."""
    full: Packer[str] = Packer(Budget(120, 8), linger_ms=1000.0)
    full.add(60, 0.0, "a")
    full.add(60, 0.0, "b")
    ragged: Packer[str] = Packer(Budget(100, 8, CostModel.RAGGED), linger_ms=1000.0)
    ragged.add(60, 0.0, "a")
    ragged.add(40, 0.0, "b")
    oversize: Packer[str] = Packer(Budget(100, 8), linger_ms=1000.0)
    oversize.add(500, 0.0, "big")
    for packer, expected in ((full, ["a", "b"]), (ragged, ["b", "a"]), (oversize, ["big"])):
        batch = packer.next_batch(0.0)
        assert batch is not None and batch.sealed
        assert batch.payloads == expected


# ------------------------------------------------------------------ (e) remove


@PROPERTY
@given(workloads(), st.data())
def test_remove_where_removes_exactly_the_matches(
    workload: tuple[Budget, list[tuple[int, float]]], data: st.DataObject
) -> None:
    budget, items = workload
    packer: Packer[int] = Packer(budget)
    fill(packer, items)
    doomed = data.draw(st.sets(st.integers(min_value=0, max_value=len(items) - 1)))

    gone = packer.remove_where(lambda payload: payload in doomed)

    assert sorted(item.payload for item in gone) == sorted(doomed)
    kept = [i for i in range(len(items)) if i not in doomed]
    assert len(packer) == len(kept)
    assert packer.buffered_tokens == sum(items[i][0] for i in kept)
    assert packer.remove_where(lambda payload: payload in doomed) == []
    assert sorted(p for batch in drain(packer) for p in batch.payloads) == kept
    assert packer.buffered_tokens == 0


# -------------------------------------------------------------- (f) efficiency


def padding_efficiency(lengths_in: list[int], budget: Budget) -> float:
    """Real tokens over padded tokens when the whole buffer is present at once."""
    packer: Packer[int] = Packer(budget)
    fill(packer, [(length, float(i)) for i, length in enumerate(lengths_in)])
    batches = drain(packer)
    return sum(b.tokens for b in batches) / sum(b.padded_tokens for b in batches)


@settings(max_examples=50, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from([64, 256]))
def test_bimodal_lengths_pack_with_little_padding(rng: random.Random, rows: int) -> None:
    """Queries (~20 tokens) and passages (~1500) arriving shuffled are not mixed.

    A count-based batcher would pad every query to ~1500 tokens; packing around
    the oldest request by nearest length keeps the two populations apart.
    """
    mixed = [rng.randint(15, 25) for _ in range(100)] + [
        rng.randint(1400, 1600) for _ in range(100)
    ]
    rng.shuffle(mixed)
    assert padding_efficiency(mixed, Budget(16_384, rows, CostModel.PADDED)) >= 0.9


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_tokens": 0, "max_batch_size": 1}, "max_batch_tokens"),
        ({"max_batch_tokens": 1, "max_batch_size": 0}, "max_batch_size"),
    ],
)
def test_budget_rejects_nonpositive_limits(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Budget(**kwargs)


def test_packer_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="linger_ms"):
        Packer(Budget(10, 1), linger_ms=-1.0)
    packer: Packer[str] = Packer(Budget(10, 1))
    with pytest.raises(ValueError, match="length"):
        packer.add(0, 0.0, "empty")
    assert len(packer) == 0 and packer.buffered_tokens == 0
    # One bad request in a read: nothing of the read is buffered.
    for bad, named in (((0, 0.0, "empty", 0), "length"),
                       ((1, 0.0, "urgent", MAX_PRIORITY + 1), "priority")):
        with pytest.raises(ValueError, match=named):
            packer.add_all([(3, 0.0, "fine", 0), bad, (4, 0.0, "also fine", 0)])
        assert len(packer) == 0 and packer.buffered_tokens == 0
        assert packer.next_batch(1e9, flush=True) is None


@PROPERTY
@given(workloads(), st.floats(min_value=0, max_value=1e6))
def test_peek_does_not_change_the_buffer(
    workload: tuple[Budget, list[tuple[int, float]]], now: float
) -> None:
    budget, items = workload
    packer: Packer[int] = Packer(budget)
    fill(packer, items)
    first, second = packer.peek(now), packer.peek(now)
    assert first == second
    assert len(packer) == len(items)


def test_a_request_that_would_mostly_add_padding_waits_for_its_own_kind() -> None:
    """Queries do not ride in a passage batch, nor a passage in a query batch."""
    items = [(20, 0.0), (1500, 1.0), (22, 2.0), (1480, 3.0), (18, 4.0)]
    packer: Packer[int] = Packer(Budget(16384, 64))
    fill(packer, items)
    assert [sorted(b.payloads) for b in drain(packer)] == [[0, 2, 4], [1, 3]]

    # The ratio is the padding a candidate adds over its own length: at 2.0 a
    # 10-token row may join a batch padded to 30 (20 padding), at 1.0 it may not.
    for ratio, expected in [(1.0, [[0], [1]]), (2.0, [[0, 1]])]:
        packer = Packer(Budget(1000, 8), max_padding_ratio=ratio)
        fill(packer, [(30, 0.0), (10, 1.0)])
        assert [sorted(b.payloads) for b in drain(packer)] == expected


# ------------------------------------------------- (h) lanes, aging, cost, time


def test_a_higher_class_goes_first_and_a_lower_one_ages_into_the_front() -> None:
    """Rule 1: priority 1 stands aging_ms earlier in line than it arrived."""
    packer: Packer[str] = Packer(Budget(1000, 1), aging_ms=100.0)
    packer.add(10, 0.0, "old-low")
    packer.add(10, 50.0, "new-high", priority=1)  # virtual arrival -50: ahead
    packer.add(10, 150.0, "late-high", priority=1)  # virtual arrival 50: behind old-low
    now = 1000.0
    assert [b.payloads for b in iter(lambda: packer.next_batch(now, flush=True), None)] == [
        ["new-high"], ["old-low"], ["late-high"],
    ]


def test_a_cheap_batch_does_not_wait_behind_an_expensive_one() -> None:
    """Rule 6b: a ready query batch goes before the passages' batch, until the passages' head
    has been passed over for aging_ms; then it goes whatever is cheaper."""
    timer = BatchTimer(min_batches=1)
    for cost in (100, 8000):
        timer.observe(cost, 1.0 + cost / 1000)  # 1 ms + 1 us per token
    packer: Packer[str] = Packer(Budget(8192, 64), aging_ms=500.0, timer=timer)
    for index in range(5):
        packer.add(1500, 0.0, f"passage{index}")
    for index in range(4):
        packer.add(20, 15.0, f"query{index}")
    batch = packer.next_batch(20.0)  # the passages came first; the queries cost less
    assert batch is not None and all(p.startswith("query") for p in batch.payloads)
    for index in range(4):
        packer.add(20, 520.0, f"late{index}")
    batch = packer.next_batch(525.0)  # the passages' head passed over for 505 ms
    assert batch is not None and all(p.startswith("passage") for p in batch.payloads)


def test_queries_are_not_held_behind_passages_read_during_a_long_batch() -> None:
    """Rule 6 on a slow device (a CPU): passages read while a batch longer than aging_ms ran
    have waited past aging_ms when it ends, yet queries that came meanwhile go first; the
    passages go once passed over for aging_ms."""
    packer: Packer[str] = Packer(Budget(8192, 256), linger_ms=2.0, aging_ms=1000.0)
    packer.add_all([(256, 100.0, f"passage{index}", 0) for index in range(16)])
    packer.add_all([(20, 1400.0 + index, f"query{index}", 0) for index in range(6)])
    batch = packer.next_batch(1600.0)  # the last batch ran 1,500 ms
    assert batch is not None and sorted(batch.payloads) == [f"query{i}" for i in range(6)]
    packer.add_all([(24, 1650.0, "query6", 0), (24, 1650.0, "query7", 0)])
    batch = packer.next_batch(1700.0)  # passed over for 100 ms: the queries still go
    assert batch is not None and sorted(batch.payloads) == ["query6", "query7"]
    packer.add(20, 2590.0, "query8")
    batch = packer.next_batch(2600.0)  # passed over for 1,000 ms: the passages go
    assert batch is not None and len(batch.items) == 16
    assert all(p.startswith("passage") for p in batch.payloads)
    batch = packer.next_batch(2600.0)
    assert batch is not None and batch.payloads == ["query8"]


def test_the_device_does_not_idle_while_a_full_batch_waits() -> None:
    """Rule 6a: while the head's batch lingers, a sealed batch of its class goes."""
    packer: Packer[str] = Packer(Budget(3000, 64), linger_ms=50.0)
    packer.add(20, 0.0, "query")
    packer.add(20, 0.0, "query2")  # two queries: a passage would pad both (rule 3)
    packer.add(1500, 1.0, "p1")
    packer.add(1500, 1.0, "p2")
    batch = packer.next_batch(2.0)
    assert batch is not None and sorted(batch.payloads) == ["p1", "p2"] and batch.sealed
    assert packer.next_batch(2.0) is None  # the query lingers until 50 ms
    assert packer.ready_at() == 50.0
    # A sealed batch of a lower class may not jump a lingering higher-class head.
    packer.add(1500, 3.0, "p3")
    packer.add(1500, 3.0, "p4")
    packer.add(20, 4.0, "urgent", priority=1)
    assert packer.next_batch(5.0) is None
    batch = packer.next_batch(54.0)
    assert batch is not None and sorted(batch.payloads) == ["query", "query2", "urgent"]


def test_a_light_tenants_requests_go_next_in_a_batch_of_their_own() -> None:
    """Rule 6, shared: a light tenant's lingering query, in line behind more of the other
    tenant's passages than a pick looks at, goes next, without a passage to ride with; even
    before a head passed over for aging_ms."""
    packer: Packer[str] = Packer(Budget(8192, 256), linger_ms=2.0, aging_ms=1000.0)
    packer.add_all([(1500, 0.0, f"a{index}", 0) for index in range(100)])
    packer.add(20, 10.0, "b0")
    batch = packer.next_batch(10.5)
    assert batch is not None and "b0" not in batch.payloads
    packer.light = lambda payload: payload.startswith("b")
    batch = packer.next_batch(10.6)
    assert batch is not None and batch.payloads == ["b0"]
    packer.add(20, 1700.0, "b1")
    batch = packer.next_batch(1700.0)
    assert batch is not None and batch.payloads == ["b1"]
    batch = packer.next_batch(1700.0)
    assert batch is not None and all(payload.startswith("a") for payload in batch.payloads)


@PROPERTY
@given(workloads(max_items=40), st.integers(min_value=1, max_value=8), st.data())
def test_max_batch_ms_caps_every_batch_once_the_time_model_has_learned(
    workload: tuple[Budget, list[tuple[int, float]]], cap_ms: int, data: st.DataObject
) -> None:
    """Rule 4: no batch is planned past max_batch_ms, except a lone request too long alone."""
    budget, items = workload
    timer = BatchTimer(min_batches=2)
    timer.observe(10, 1.0 + 0.01)
    timer.observe(1000, 1.0 + 1.0)  # 1 ms + 1 us per token
    packer: Packer[int] = Packer(budget, max_batch_ms=float(cap_ms), timer=timer)
    fill(packer, items)
    cap = timer.cost_within(float(cap_ms))
    assert cap is not None
    assert packer.budget_now().max_batch_tokens == min(cap, budget.max_batch_tokens)
    for batch in drain(packer):
        assert batch.cost <= max(cap, budget.max_batch_tokens) or batch.rows == 1
        if batch.rows > 1:
            assert batch.cost <= cap


def test_while_tenants_share_the_device_a_batch_is_capped_at_a_few_fixed_times() -> None:
    """Rule 4: shared, no batch is planned past SHARED_FIXED_TIMES the fixed time per batch,
    so another tenant's query waits for a short batch; alone, the full budget."""
    timer = BatchTimer(min_batches=2)
    timer.observe(10, 2.0 + 0.01)
    timer.observe(8000, 2.0 + 8.0)  # 2 ms + 1 us per token
    packer: Packer[str] = Packer(Budget(8192, 256), timer=timer)
    for n in range(10):
        packer.add(1600, 0.0, f"p{n}")
    assert packer.budget_now().max_batch_tokens == 8192
    packer.light = lambda payload: False  # a light tenant is active; none of these is its
    cap = timer.cost_within(rules.SHARED_FIXED_TIMES * 2.0)
    assert cap is not None and cap < 8192
    assert packer.budget_now().max_batch_tokens == cap
    batch = packer.next_batch(0.0)
    assert batch is not None and batch.rows == cap // 1600 and batch.cost <= cap
    packer.light = None
    batch = packer.next_batch(0.0)
    assert batch is not None and batch.rows == 5


@given(
    st.floats(min_value=0.0, max_value=20.0), st.floats(min_value=1e-4, max_value=0.01),
    st.lists(st.integers(min_value=1, max_value=16_384), min_size=3, max_size=30, unique=True),
)
def test_batch_timer_learns_a_straight_line(
    fixed: float, per_token: float, costs: list[int]
) -> None:
    timer = BatchTimer(min_batches=3)
    assert timer.cost_within(10.0) is None  # nothing learned yet: no cap
    for cost in costs:
        timer.observe(cost, fixed + per_token * cost)
    assert timer.fixed_ms == pytest.approx(fixed, rel=1e-3, abs=1e-3)
    assert timer.per_token_ms == pytest.approx(per_token, rel=1e-3)
    within = timer.cost_within(fixed + per_token * 5000)
    assert within is not None and abs(within - 5000) <= max(2, 5000 * 1e-3)


def test_priority_is_range_checked() -> None:
    packer: Packer[str] = Packer(Budget(10, 1))
    for bad in (-1, MAX_PRIORITY + 1):
        with pytest.raises(ValueError, match="priority"):
            packer.add(1, 0.0, "x", priority=bad)
    assert len(packer) == 0
