"""The dead-letter cap (sans-I/O): whatever an entry holds, its letter is bounded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.shared.dead_letter import MAX_LETTER_FIELDS, MAX_TRUNCATED_NAMES, capped_fields

pytestmark = pytest.mark.unit

names = st.binary(min_size=1, max_size=80)
fields = st.dictionaries(names, st.binary(max_size=5000), max_size=400)


@settings(max_examples=200, deadline=None)
@given(fields, st.integers(min_value=1024, max_value=20_000))
def test_a_letter_keeps_at_most_its_caps_and_names_what_it_cut(
    entry: dict[bytes, bytes], max_bytes: int
) -> None:
    kept, truncated = capped_fields(entry, max_bytes)
    own = {k: v for k, v in entry.items() if not k.startswith(b"dead_")}
    assert sum(len(k) + len(v) for k, v in kept) <= max_bytes
    assert len(kept) <= MAX_LETTER_FIELDS
    assert len(truncated.encode()) <= MAX_TRUNCATED_NAMES * 65 + 32
    for name, value in kept:
        assert own[name].startswith(value)
    whole = sum(len(k) + len(v) for k, v in own.items()) <= max_bytes
    if whole and len(own) <= MAX_LETTER_FIELDS:
        assert dict(kept) == own and truncated == ""
    else:
        assert truncated != ""
    assert not any(name.startswith(b"dead_") for name, _ in kept)
