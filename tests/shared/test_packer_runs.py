"""The packer's batches are the ones rule 2 picks one row at a time, whatever the input.

``Packer._build`` takes a whole run of equal lengths per step (padded) and
walks each side once (ragged), which is only correct if it picks exactly
what the plain rule picks: each step, the side whose next request adds the
least padding (ties: the shorter), a side closing when that request would add
more padding than it brings tokens or does not fit. :class:`OneRowAtATime`
is that rule written out in the most direct way; hypothesis drives both
packers through the same adds, removals and picks, with the few distinct
lengths, small budgets and row limits that make runs, partial runs and
skipped rows, and every batch must match: rows, order, cost and seal.
"""

from __future__ import annotations

import bisect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.shared.packer import Batch, Budget, Candidate, CostModel, Item, Packer

pytestmark = pytest.mark.unit

BELOW, ABOVE = 0, 1
"""The two sides of the anchor, ordered so that a tie goes below."""


class OneRowAtATime(Packer[int]):
    """The reference: rule 2 as one loop that takes one request per step."""

    def _build(self, anchor: Item[int], budget: Budget) -> Candidate[int]:
        order = self._by_length
        padded = budget.cost_model is CostModel.PADDED
        position = bisect.bisect_left(order, (anchor.length, anchor.seq))
        chosen = [anchor]
        longest = total = anchor.length
        below, above, end = position - 1, position + 1, len(order)
        sealed = False
        while True:
            rows = len(chosen)
            if rows >= budget.max_batch_size:
                sealed = True
                break
            if below < 0 and above >= end:
                break
            candidates = []
            if below >= 0:
                length = order[below][0]
                candidates.append((longest - length if padded else 0, length, BELOW))
            if above < end:
                length = order[above][0]
                candidates.append((rows * (length - longest) if padded else 0, length, ABOVE))
            padding, length, side = min(candidates)  # BELOW < ABOVE: ties go below
            if padding > self.max_padding_ratio * length:
                below, above = (-1, above) if side == BELOW else (below, end)
                continue
            new_longest = max(longest, length)
            if budget.fits(rows + 1, new_longest, total + length):
                index = below if side == BELOW else above
                chosen.append(self._items[order[index][1]])
                below, above = (below - 1, above) if side == BELOW else (below, above + 1)
                longest, total = new_longest, total + length
                continue
            sealed = True
            if side == ABOVE:
                above = end
            elif padded:
                below = -1
            else:
                below -= 1  # ragged: a shorter one further down may still fit
        if not sealed and not budget.fits(len(chosen) + 1, longest, total + 1):
            sealed = True
        rows = sorted((item.length, item.seq) for item in chosen)
        return Candidate(anchor, rows, budget.cost(len(chosen), longest, total), sealed)


# Few distinct lengths (long runs of equals) and small budgets (runs cut short).
run_lengths = st.integers(min_value=1, max_value=12)
requests = st.tuples(run_lengths, st.integers(min_value=0, max_value=50).map(float),
                     st.sampled_from([0, 0, 0, 1, 2]))
steps = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(requests, min_size=1, max_size=40)),
        st.tuples(st.just("pick"), st.integers(min_value=0, max_value=3000).map(float),
                  st.booleans()),
        st.tuples(st.just("remove"), st.integers(min_value=2, max_value=7)),
    ),
    min_size=1, max_size=30,
)


def shape(batch: Batch[int] | None) -> tuple[object, ...] | None:
    if batch is None:
        return None
    return tuple((item.length, item.seq) for item in batch.items), batch.cost, batch.sealed


@settings(max_examples=400, deadline=None)
@given(
    steps,
    st.integers(min_value=12, max_value=200),
    st.integers(min_value=1, max_value=40),
    st.sampled_from(list(CostModel)),
    st.sampled_from([0.0, 0.25, 1.0, 3.0]),
    st.sampled_from([0.0, 5.0]),
)
def test_every_batch_is_the_one_a_row_at_a_time_picks(
    plan: list[tuple[object, ...]], tokens: int, rows: int, model: CostModel,
    ratio: float, linger_ms: float,
) -> None:
    budget = Budget(tokens, rows, model)
    fast = Packer[int](budget, linger_ms, max_padding_ratio=ratio, aging_ms=1000.0)
    slow = OneRowAtATime(budget, linger_ms, max_padding_ratio=ratio, aging_ms=1000.0)
    added = 0
    for step in plan:
        if step[0] == "add":
            batch = [(length, at, added + i, priority)
                     for i, (length, at, priority) in enumerate(step[1])]  # type: ignore[arg-type]
            added += len(batch)
            fast.add_all(batch)
            slow.add_all(batch)
        elif step[0] == "remove":
            every = step[1]
            gone_fast = fast.remove_where(lambda payload: payload % every == 0)  # noqa: B023
            gone_slow = slow.remove_where(lambda payload: payload % every == 0)  # noqa: B023
            assert sorted(i.seq for i in gone_fast) == sorted(i.seq for i in gone_slow)
        else:
            now, flush = step[1], step[2]
            assert shape(fast.peek(now)) is None or fast.peek(now).items[0] is fast.head()
            assert shape(fast.next_batch(now, flush=flush)) == shape(  # type: ignore[arg-type]
                slow.next_batch(now, flush=flush))  # type: ignore[arg-type]
        assert fast._by_length == slow._by_length
        assert fast._line.entries() == slow._line.entries()
        assert fast.buffered_tokens == slow.buffered_tokens == sum(i.length for i in fast)
    while (batch := slow.next_batch(1e9, flush=True)) is not None:
        assert shape(fast.next_batch(1e9, flush=True)) == shape(batch)
    assert len(fast) == 0


def test_a_run_longer_than_the_budget_is_cut_where_the_budget_ends() -> None:
    """A thousand equal rows: the padded batch takes as many as fit, no more."""
    packer = Packer[int](Budget(100, 1000, CostModel.PADDED))
    packer.add_all([(7, 0.0, index, 0) for index in range(1000)])
    batch = packer.next_batch(0.0, flush=True)
    assert batch is not None and batch.rows == 100 // 7 and batch.cost == 14 * 7 and batch.sealed
    assert [item.payload for item in batch.items] == list(range(14))  # the first in line
    assert len(packer) == 1000 - 14
