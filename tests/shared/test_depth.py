"""The queue-depth rule ``tokenq stats`` and the worker's gauges share (shared/queue_depth.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenq.shared.queue_depth import depth

pytestmark = pytest.mark.unit


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.booleans(),
       st.none() | st.integers(0, 10**6))
def test_lag_is_never_negative_and_exact_only_when_redis_or_no_group_says(
    length: int, pending: int, group: bool, reported: int | None
) -> None:
    found = depth(length, pending, group_exists=group, reported_lag=reported)
    assert found.lag >= 0 and found.length == length
    if not group:
        assert (found.pending, found.lag, found.lag_exact) == (0, length, True)
    elif reported is None:
        assert found.lag == max(0, length - pending) and not found.lag_exact
    else:
        assert found.lag == reported and found.lag_exact
