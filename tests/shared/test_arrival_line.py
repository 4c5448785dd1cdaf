"""The packer's line (``ArrivalLine`` in ``shared/packer.py``) against a plain sorted list.

Any sequence of adds (one or many at a time, anywhere in the order) and
removals (any subset): the head, the walk from it and the live entries are
the sorted list's, and the removed entries it still holds never exceed the
live ones plus ``SLACK`` (each removal is O(1) amortised, each walk bounded).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.shared.packer import SLACK, ArrivalLine

pytestmark = pytest.mark.unit

steps = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 50), min_size=1, max_size=30)),
        st.tuples(st.just("remove"), st.integers(1, 4), st.integers(0, 3)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_the_line_reads_as_a_sorted_list_of_what_is_live(plan: list[tuple]) -> None:
    live: dict[int, float] = {}
    line = ArrivalLine(live.keys())
    next_seq = 0
    for step in plan:
        if step[0] == "add":
            added = []
            for arrival in step[1]:
                live[next_seq] = float(arrival)
                added.append((float(arrival), next_seq))
                next_seq += 1
            line.add(added)
        else:  # every n-th live request, from an offset: scattered, like a batch by length
            every, offset = step[1], step[2]
            gone = sorted(live)[offset::every]
            for seq in gone:
                del live[seq]
            line.removed(len(gone))
        model = sorted((arrival, seq) for seq, arrival in live.items())
        assert line.entries() == model
        assert line.head() == (model[0][1] if model else None)
        assert list(line.seqs()) == [seq for _, seq in model]
        assert line.held() - len(live) <= len(live) + SLACK


def test_a_request_added_ahead_of_removed_ones_is_the_head() -> None:
    """A priority request stands before entries the head already passed."""
    live: dict[int, float] = {0: 10.0, 1: 20.0, 2: 30.0}
    line = ArrivalLine(live.keys())
    line.add([(10.0, 0), (20.0, 1), (30.0, 2)])
    del live[0], live[1]
    line.removed(2)
    assert line.head() == 2
    live[3] = 5.0
    line.add([(5.0, 3)])
    assert line.head() == 3 and list(line.seqs()) == [3, 2]
