"""``read_ahead_bytes`` is a bound: held < read_ahead_bytes + one largest entry, always.

The worker once turned the byte room into an XREADGROUP count through a
running mean of entry sizes: after many small entries, one read took 120
entries of 96 KB against a 1 MiB bound. :class:`~tokenq.worker.loop.intake.Intake`
counts every entry a read may bring as the largest a producer can write and
reserves that room until the entries are held. Here hypothesis drives it
through any interleaving of reads on several lanes (asked, answered with any
sizes up to the largest, failed) and publishes, checking the bound after
every step; and a real worker fed many tiny entries and then large ones is
watched through XPENDING to hold no more than the bound.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from tests.cli_support import SIM_FLAGS, wait_for
from tests.workers import Fleet
from tokenq.shared import keys, wire
from tokenq.worker.loop.intake import Intake

MAX_ENTRY = 1000


def byte_room(limit: int, max_entry: int) -> Intake:
    """An intake whose token room never binds: only its bytes decide a read's count."""
    return Intake(read_ahead_budgets=1e12, read_ahead_bytes=limit, max_entry_bytes=max_entry,
                  max_input_tokens=1)


class ReadAheadMachine(RuleBasedStateMachine):
    """Reads in flight on any lanes at once, answered in any order with any sizes."""

    reads = Bundle("reads")

    def __init__(self) -> None:
        super().__init__()
        self.room = byte_room(4000, MAX_ENTRY)
        self.next_ref = 0
        self.open: dict[int, tuple[int, object]] = {}
        """Reads asked for and not answered: their count and their reservation."""

    @precondition(lambda self: len(self.open) < 8)
    @rule(target=reads, cap=st.integers(1, 1024), readers=st.integers(1, 8))
    def ask(self, cap: int, readers: int) -> int:
        count = self.room.read_count(1, 0, readers=readers, cap=cap)
        if count == 0:
            assert self.room.used() >= self.room.limit  # refused only without room
            return -1
        assert count <= cap
        reservation = self.room.reserving(count)
        reservation.__enter__()
        key = len(self.open) + 1000 * self.next_ref
        self.next_ref += 1
        self.open[key] = (count, reservation)
        return key

    @rule(read=consumes(reads), sizes=st.lists(st.integers(1, MAX_ENTRY), max_size=1024),
          failed=st.booleans())
    def answer(self, read: int, sizes: list[int], failed: bool) -> None:
        if read not in self.open:
            return
        count, reservation = self.open.pop(read)
        if not failed:
            taken = sizes[:count]  # Redis returns at most COUNT entries
            ids = [b"e%d" % (self.next_ref + i) for i in range(len(taken))]
            self.next_ref += len(taken)
            fields = [{b"": b"x" * size} for size in taken]  # entries of exactly those sizes
            self.room.hold(read % 3, zip(ids, fields, strict=True))  # any lane: the bound spans all
        reservation.__exit__(None, None, None)  # type: ignore[attr-defined]

    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        held = sorted((lane, entry_id) for lane, ids in self.room.held_by_lane().items()
                      for entry_id in ids)
        if held:
            for lane, entry_id in data.draw(st.lists(st.sampled_from(held), max_size=len(held))):
                self.room.published(lane, [entry_id, b"never held"])

    @invariant()
    def bounded(self) -> None:
        sizes = [self.room.size_of(lane, entry_id)
                 for lane, ids in self.room.held_by_lane().items() for entry_id in ids]
        assert sum(size or 0 for size in sizes) <= self.room.used()
        assert self.room.used() < self.room.limit + self.room.max_entry


TestReadAheadBound = ReadAheadMachine.TestCase
TestReadAheadBound.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


@pytest.mark.unit
@given(st.integers(1, 10**9), st.integers(1, 10**7), st.integers(0, 10**9), st.integers(1, 4096),
       st.integers(1, 64))
def test_a_read_is_asked_for_whenever_there_is_room_and_never_beyond_it(
    limit: int, max_entry: int, used: int, cap: int, readers: int,
) -> None:
    room = byte_room(limit, max_entry)
    room.reserved = used
    count = room.read_count(1, 0, readers=readers, cap=cap)
    if used >= limit:
        assert count == 0
    else:
        assert 1 <= count <= cap  # progress: entries larger than the room are still read
        assert count == 1 or used + readers * count * max_entry <= limit


@pytest.mark.unit
def test_the_largest_entry_counts_every_field_a_producer_can_write() -> None:
    request = wire.Request(
        id="й" * wire.MAX_ID_CHARS, text="é" * 250, text_pair="é" * 250, tokens=wire.MAX_TOKENS,
        reply_to="ю" * wire.MAX_REPLY_TO_CHARS, deadline_ms=wire.MAX_EPOCH_MS,
        timeout_ms=wire.MAX_TIMEOUT_MS, priority=wire.MAX_PRIORITY,
        opts={"x": b"\0" * (wire.MAX_OPTS_BYTES - 16)},
    )
    fields = wire.encode_request(request)
    size = sum(len(str(k).encode()) + len(v if isinstance(v, bytes) else str(v).encode())
               for k, v in fields.items())
    assert size <= wire.max_entry_bytes(1000)


# ---------------------------------------------------------------- a real worker


def test_a_worker_fed_tiny_entries_then_large_ones_holds_no_more_than_the_bound(
    worker_env: dict[str, str], tmp_path: Path, r: redis.Redis, queue_name: str,
) -> None:
    limit, max_request = 1024 * 1024, 96 * 1024
    bound = limit + wire.max_entry_bytes(max_request)
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    fleet = Fleet(worker_env, tmp_path, SIM_FLAGS)
    try:
        fleet.start("--read-ahead-bytes", str(limit), "--max-request-bytes", str(max_request),
                    "--max-batch-size", "8", "--sim-batch-ms", "40", name="w",
                    ready=r, queue=queue_name)
        with r.pipeline(transaction=False) as pipe:  # teach any running mean "entries are tiny"
            for i in range(400):
                pipe.xadd(stream, {"v": "1", "id": f"t{i}", "text": "a"})
            pipe.execute()
        wait_for(lambda: r.xlen(stream) == 0, 60, "the tiny entries to be answered")
        big = {"v": "1", "text": "word " * (90 * 1024 // 5)}
        with r.pipeline(transaction=False) as pipe:
            for i in range(60):
                pipe.xadd(stream, {**big, "id": f"b{i}"})
            pipe.execute()
        size = sum(len(k) + len(v) for k, v in {**big, "id": "b00"}.items())
        most = 0
        deadline = time.monotonic() + 60
        while r.xlen(stream) and time.monotonic() < deadline:
            most = max(most, r.xpending(stream, keys.GROUP)["pending"])
            time.sleep(0.005)
        assert r.xlen(stream) == 0, fleet.logs()
        assert most * size < bound, (most, size, bound)
        assert most >= 2  # it did read ahead: the bound is not met by reading one at a time
    finally:
        fleet.close()
