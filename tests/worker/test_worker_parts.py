"""The worker's parts, each driven on its own.

* :class:`~tokenq.worker.loop.intake.Intake` is pure: hypothesis drives it with
  plain numbers (the byte bound over any sequence of reads and publishes,
  the token room, the running mean).
* :class:`~tokenq.worker.loop.reader.Reader` and :class:`~tokenq.worker.loop.outbox.Outbox`
  run against a small in-memory fake of the stream commands they send
  (XREADGROUP, XGROUP CREATE, the publisher's call), no Redis: entries become
  jobs named by their lane (:class:`~tokenq.worker.loop.lanes.Ref`), a poison entry
  costs only its own dead letter, and answers leave on their own lane under
  their bare entry id, giving their read-ahead room back.

The same parts run against a real Redis in every end-to-end test.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError

from tokenq.shared import keys, wire
from tokenq.shared.packer import Budget, Packer
from tokenq.worker.backends.sim import SimBackend
from tokenq.worker.health import READ_FAILURES_BEFORE_UNREADY, Health
from tokenq.worker.loop.device import Device
from tokenq.worker.loop.intake import Intake, entry_bytes
from tokenq.worker.loop.lanes import LaneSet, Ref
from tokenq.worker.loop.lifecycle import Lifecycle, Recorder, Wiring
from tokenq.worker.loop.outbox import Outbox
from tokenq.worker.loop.reader import Reader
from tokenq.worker.loop.recovery import Claimed
from tokenq.worker.loop.stages import Stages
from tokenq.worker.metrics import NullMetrics
from tokenq.worker.pipeline.jobs import Answer, DeadLetterPolicy
from tokenq.worker.pipeline.pipeline import Failure, Outcome, Pipeline
from tokenq.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit

MAX_ENTRY = 1000

# ------------------------------------------------------------------- intake (pure)


def _intake(limit: int = 10_000, budgets: float = 2.0, max_input: int = 512) -> Intake:
    return Intake(read_ahead_budgets=budgets, read_ahead_bytes=limit,
                  max_entry_bytes=MAX_ENTRY, max_input_tokens=max_input)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 50_000), st.integers(1, 4), st.lists(st.tuples(
    st.lists(st.integers(1, MAX_ENTRY), max_size=20), st.integers(0, 30)), max_size=40))
def test_what_the_intake_holds_stays_under_the_byte_bound(
    limit: int, readers: int, rounds: list[tuple[list[int], int]]
) -> None:
    intake = _intake(limit)
    serial = 0
    for sizes, publish in rounds:
        count = intake.read_count(1_000_000, 0, readers=readers, cap=1024)
        room = intake.limit - intake.used()
        assert (count == 0) == (room <= 0)
        if count:
            with intake.reserving(count):
                entries = []
                for size in sizes[:count]:
                    serial += 1
                    entries.append((b"1-%d" % serial, {b"f": b"x" * (size - 1)}))
                intake.hold(serial % readers, entries)
            assert intake.used() < limit + MAX_ENTRY  # held, the reservation gone
        for lane, ids in list(intake.held_by_lane().items())[:1]:
            answered = ids[:publish]  # answers no larger than their requests: bound unmoved
            intake.emitted(lane, answered, [intake.size_of(lane, i) or 0 for i in answered])
            intake.published(lane, answered)
        assert intake.used() < limit + MAX_ENTRY
    assert intake.reserved == 0


@given(st.integers(1, 100_000), st.integers(0, 100_000), st.integers(0, 1000),
       st.integers(1, 8))
def test_no_token_room_means_no_read(budget: int, buffered: int, unpublished: int,
                                     readers: int) -> None:
    intake = _intake(limit=1 << 30)
    intake.emitted(0, [b"%d-0" % i for i in range(unpublished)], [1] * unpublished)
    count = intake.read_count(budget, buffered, readers=readers, cap=1024)
    if intake.room(budget, buffered) <= 0:
        assert count == 0
    else:
        assert 1 <= count <= 1024


def test_a_lanes_own_room_reads_past_a_full_token_room_but_never_past_the_bytes() -> None:
    intake = _intake(limit=100_000)
    assert intake.read_count(1000, 2000, readers=2, cap=64) == 0  # the token room is full
    assert intake.read_count(1000, 2000, readers=2, cap=64, own=3) == 3
    intake.hold(0, [(b"1-0", {b"f": b"x" * 100_000})])  # the byte room is full
    assert intake.held_count(0) == 1 and intake.held_count(1) == 0
    assert intake.read_count(1000, 2000, readers=2, cap=64, own=3) == 0


@given(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 100_000)), max_size=50))
def test_the_running_mean_stays_within_what_was_read(reads: list[tuple[int, int]]) -> None:
    intake = _intake(max_input=512)
    low, high = 1.0, 512.0
    for requests, tokens in reads:
        intake.learn(requests, tokens)
        per_entry = max(1.0, (tokens or requests) / requests)
        low, high = min(low, per_entry), max(high, per_entry)
        assert low - 1e-9 <= intake.avg_estimate <= high + 1e-9


def test_an_estimate_in_flight_is_given_back_even_when_tokenizing_fails() -> None:
    intake = _intake()
    with pytest.raises(RuntimeError), intake.estimating(40):
        assert intake.busy()
        raise RuntimeError("tokenizer crashed")
    assert not intake.busy() and intake.inflight_estimate == 0


def test_unpublished_answers_take_token_room_at_the_running_mean() -> None:
    intake = _intake(max_input=100)
    before = intake.room(1000, 0)
    intake.emitted(0, [b"1-0", b"2-0", b"3-0"], [1, 1, 1])
    assert intake.room(1000, 0) == before - 300


# ------------------------------------------------------------- fakes of Redis


class FakeStreams:
    """The stream commands the reader sends, over in-memory streams (one consumer)."""

    def __init__(self) -> None:
        self.entries: dict[str, list[tuple[bytes, dict[bytes, bytes]]]] = {}
        self.delivered: dict[str, int] = {}
        self.groups: set[str] = set()
        self.failing_history = 0
        """How many history reads (``XREADGROUP ... 0``) fail WRONGTYPE before one goes."""

    def xadd(self, stream: str, fields: dict[str, str | bytes] | dict[bytes, bytes]) -> bytes:
        held = self.entries.setdefault(stream, [])
        entry_id = b"%d-0" % (len(held) + 1)
        held.append((entry_id, {_b(k): _b(v) for k, v in fields.items()}))
        return entry_id

    async def xgroup_create(self, name: str, groupname: str, id: str = "$",
                            mkstream: bool = False) -> bool:
        if name in self.groups:
            raise ResponseError("BUSYGROUP Consumer Group name already exists")
        self.groups.add(name)
        return True

    async def xreadgroup(self, groupname: str, consumername: str, streams: dict[str, str],
                         count: int | None = None, block: int | None = None) -> Any:
        ((stream, last),) = streams.items()
        if last != ">" and self.failing_history:
            self.failing_history -= 1
            raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind")
        if stream not in self.groups:
            raise ResponseError("NOGROUP No such key or consumer group")
        held = self.entries.get(stream, [])
        done = self.delivered.get(stream, 0)
        if last == ">":
            found = held[done:done + (count or len(held))]
            self.delivered[stream] = done + len(found)
        else:  # history: what was delivered to this consumer after ``last``
            after = int(last.split("-")[0])
            found = [e for e in held[:done] if int(e[0].split(b"-")[0]) > after][:count]
        if not found:
            if block:
                await asyncio.sleep(block / 1000)
            return []
        return [[stream.encode(), found]]


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class FakeReclaimer:
    """Nobody else's entries to take over."""

    async def scan(self, limit: int, held: Any) -> Claimed:
        return Claimed()

    async def own_deliveries(self, entry_ids: list[bytes]) -> dict[bytes, int]:
        return {}


class FakePublisher:
    """Takes every call at once and remembers what it published."""

    def __init__(self) -> None:
        self.published: list[Answer] = []

    async def publish(self, answers: list[Answer], give_up: Any) -> None:
        self.published.extend(answers)


# --------------------------------------------------------------- reader, outbox


class Parts:
    """A reader and an outbox wired as the Worker wires them, on fakes of Redis
    (``shards`` > 1: that many lanes plus the queue's own, as ``keys.lanes_of`` says)."""

    def __init__(self, shards: int = 2) -> None:
        # max_queue_length 0: the fake has no FCALL for the length check.
        self.settings = WorkerSettings(queue="parts", block_ms=5, heartbeat_s=60.0,
                                       max_queue_length=0)
        self.client = FakeStreams()
        self.backend = SimBackend(max_input_tokens=64)
        self.intake = Intake(read_ahead_budgets=4.0, read_ahead_bytes=1 << 20,
                             max_entry_bytes=wire.max_entry_bytes(1 << 16), max_input_tokens=64)
        self.lifecycle = Lifecycle()
        self.recorder = Recorder("me", NullMetrics(), None)
        self.wiring = Wiring("me", self.settings, self.lifecycle, Stages(time.monotonic),
                             self.recorder, Health(60.0))
        self.wiring.client = self.client
        self.pipeline: Pipeline[Ref] = Pipeline(self.backend)
        self.packer: Packer[Any] = Packer(Budget(4096, 64))
        self.outbox = Outbox(self.wiring, self.intake, self.lifecycle.room_made.set)
        self.device = Device(self.wiring, self.pipeline, self.packer, self.intake, self.outbox)
        self.lanes = LaneSet()
        for queue in keys.lanes_of(keys.QueueRef("parts"), shards):
            self.lanes.add(queue, self._policy(queue), FakeReclaimer(),  # type: ignore[arg-type]
                           FakePublisher())  # type: ignore[arg-type]
            self.outbox.add_lane()
        self.lane_list = list(self.lanes)
        self.reader = Reader(self.wiring, self.lanes, self.intake, self.device, self.outbox,
                             dict)

    def _policy(self, queue: keys.QueueRef) -> DeadLetterPolicy:
        return DeadLetterPolicy(
            worker="me", max_deliveries=5, default_reply_to=functools.partial(keys.reply, queue),
            max_request_bytes=1 << 16,
            check_reply_to=functools.partial(keys.reply_to_refusal, queue),
            max_letter_bytes=1 << 16,
        )

    def add(self, lane: int, text: str) -> bytes:
        queue = self.lane_list[lane].queue
        request_id = f"r-{len(self.client.entries.get(self.lane_list[lane].stream, []))}"
        request = wire.Request(request_id, text, 0, keys.reply(queue, request_id))
        return self.client.xadd(self.lane_list[lane].stream, wire.encode_request(request))

    def published(self, lane: int) -> list[Answer]:
        return self.lane_list[lane].publisher.published  # type: ignore[union-attr]

    async def serve_until(self, jobs: int) -> None:
        """Run the read and publish tasks until ``jobs`` are buffered, then stop them."""
        for lane in self.lanes:
            await self.reader.ensure_group(lane)
        self.reader.starting()
        reading = [asyncio.create_task(self.reader.run(lane)) for lane in self.lanes]
        publishing = [asyncio.create_task(self.outbox.run(lane)) for lane in self.lanes]
        for _ in range(500):
            if len(self.packer) >= jobs:
                break
            await asyncio.sleep(0.01)
        self.lifecycle.stop()
        await asyncio.wait_for(asyncio.gather(*reading), 10)
        self.outbox.close()
        await asyncio.wait_for(asyncio.gather(*publishing), 10)


def test_the_reader_buffers_each_lanes_entries_under_their_lane_on_fake_streams() -> None:
    parts = Parts(shards=2)
    first = [parts.add(0, f"zero {k}") for k in range(3)]
    garbage = parts.client.xadd(parts.lane_list[0].stream, {b"v": b"1", b"nonsense": b"x"})
    second = [parts.add(1, f"one {k}") for k in range(2)]
    asyncio.run(parts.serve_until(jobs=5))

    refs = {job.ref for job in (item.payload for item in parts.packer)}
    assert refs == {Ref(0, i) for i in first} | {Ref(1, i) for i in second}
    # The undecodable entry is dead-lettered on its own lane, under its bare id ...
    assert [a.entry_id for a in parts.published(0)] == [garbage]
    assert parts.published(0)[0].dead_fields and parts.published(1) == []
    # ... and its room is given back, while what is buffered still holds its bytes.
    assert _held_refs(parts) == refs
    assert parts.intake.unpublished_answers == 0
    assert parts.device.input_ended and parts.recorder.stats.dead_lettered == 1


def test_a_restart_reads_its_own_history_first() -> None:
    parts = Parts(shards=1)
    ids = [parts.add(0, f"again {k}") for k in range(3)]
    parts.client.groups.add(parts.lane_list[0].stream)
    parts.client.delivered[parts.lane_list[0].stream] = 3  # delivered to "me" before a crash
    asyncio.run(parts.serve_until(jobs=3))
    assert sorted(item.payload.ref for item in parts.packer) == [Ref(0, i) for i in ids]


def test_a_failed_history_read_is_counted_and_retried_not_fatal() -> None:
    parts = Parts(shards=1)
    ids = [parts.add(0, f"again {k}") for k in range(2)]
    parts.client.groups.add(parts.lane_list[0].stream)
    parts.client.delivered[parts.lane_list[0].stream] = 2
    parts.client.failing_history = READ_FAILURES_BEFORE_UNREADY
    asyncio.run(parts.serve_until(jobs=2))
    assert sorted(item.payload.ref for item in parts.packer) == [Ref(0, i) for i in ids]
    assert parts.client.failing_history == 0


def test_a_poison_entry_costs_only_its_own_dead_letter() -> None:
    parts = Parts(shards=1)
    admit = parts.pipeline.admit

    def fragile(items: list[Any], now_epoch_ms: int) -> Any:
        if any(item.request.text == "poison" for item in items):
            raise RuntimeError("the tokenizer choked")
        return admit(items, now_epoch_ms)

    parts.pipeline.admit = fragile  # type: ignore[method-assign]
    ids = [parts.add(0, text) for text in ("fine", "poison", "also fine")]
    asyncio.run(parts.serve_until(jobs=2))
    assert sorted(item.payload.ref.entry_id for item in parts.packer) == [ids[0], ids[2]]
    (letter,) = parts.published(0)
    assert letter.entry_id == ids[1] and letter.dead_fields
    assert b"could not take this entry: RuntimeError" in letter.payload


def test_the_outbox_answers_each_lane_under_bare_ids_and_gives_room_back() -> None:
    parts = Parts(shards=2)
    for lane in range(3):
        parts.intake.hold(lane, [(b"7-0", {b"f": b"x"})])
    request = wire.Request("r", "t", 1, "r")
    outcomes = [Outcome(Ref(lane, b"7-0"), request, Failure("x", "y")) for lane in (2, 0)]

    async def publish() -> None:
        tasks = [asyncio.create_task(parts.outbox.run(lane)) for lane in parts.lanes]
        parts.outbox.emit_outcomes(parts.pipeline, outcomes)
        assert parts.outbox.unpublished()
        parts.outbox.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)

    asyncio.run(publish())
    assert [len(parts.published(lane)) for lane in range(3)] == [1, 0, 1]
    assert all(a.entry_id == b"7-0" for lane in (0, 2) for a in parts.published(lane))
    assert _held_refs(parts) == {Ref(1, b"7-0")}
    assert parts.intake.unpublished_answers == 0 and not parts.outbox.unpublished()
    assert parts.lifecycle.room_made.is_set()


def _held_refs(parts: Parts) -> set[Ref]:
    return {Ref(lane, entry_id) for lane, ids in parts.intake.held_by_lane().items()
            for entry_id in ids}


def test_the_same_entry_id_on_two_lanes_is_held_and_released_apart() -> None:
    """Streams hand out ids of their own: one id read on two lanes is two entries."""
    intake = _intake(10_000)
    intake.hold(0, [(b"5-0", {b"f": b"abc"})])
    intake.hold(1, [(b"5-0", {b"f": b"abcdefg"}), (b"6-0", None)])
    assert intake.held_by_lane() == {0: [b"5-0"], 1: [b"5-0"]}
    assert intake.used() == 4 + 8
    intake.emitted(0, [b"5-0"], [4])
    intake.published(0, [b"5-0"])
    assert intake.held_by_lane() == {1: [b"5-0"]} and intake.used() == 8
    intake.emitted(1, [b"5-0"], [8])
    intake.emitted(1, [b"9-9"], [0])  # an entry deleted while pending: answered with nothing
    intake.published(1, [b"5-0", b"9-9"])
    assert intake.held_by_lane() == {} and intake.used() == 0
    assert intake.unpublished_answers == 0


def test_entry_bytes_are_the_raw_size_of_the_fields() -> None:
    assert entry_bytes({b"ab": b"cde", b"f": b""}) == 6


@pytest.mark.parametrize("package", ["worker", "producer", "shared"])
def test_no_class_is_longer_than_400_lines(package: str) -> None:
    """A class that outgrows 400 lines owns too much state for one part."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / package
    long = [
        f"{path.relative_to(root)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400
    ]
    assert long == []
