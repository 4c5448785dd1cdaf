"""Reading the worker's lanes: one task per lane, into the device's packer; where a read is
admitted (:class:`AdmitPlace`: on the event loop when that costs less than a thread hop)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError, ResponseError

from tokenq.shared import functions, keys, wire
from tokenq.shared.errors import ErrorCode
from tokenq.shared.failures import error_text
from tokenq.shared.redis_refusal import error_code
from tokenq.worker.loop import presence
from tokenq.worker.loop.cache import Parking
from tokenq.worker.loop.device import Device
from tokenq.worker.loop.intake import Intake
from tokenq.worker.loop.lanes import Lane, LaneSet, Ref
from tokenq.worker.loop.lifecycle import Wiring
from tokenq.worker.loop.outbox import Outbox, answers_by_lane
from tokenq.worker.loop.stages import READ, TOKENIZING
from tokenq.worker.pipeline.feed import monotonic_ms, wait_event
from tokenq.worker.pipeline.jobs import Answer, DeadLetterPolicy, dead_answer, decode_entries
from tokenq.worker.pipeline.pipeline import Admit, Admitted, Job, Pipeline

log = logging.getLogger("tokenq.worker")

HISTORY_COUNT = 256
MAX_READ_COUNT = 1024
EXCESS_AT_MOST = 256
"""Most entries past the length limit one check takes: the next read's check takes the next."""

REQUEST_UNITS = 64
"""What one request costs in characters' worth of work, besides its text."""
FALL = 0.1
"""How far the rate moves down towards a cheaper read's, per read."""
INLINE_LIMIT_S = 10.0
"""A read admitted on the loop is hung after this long (or ``batch_timeout_s``, if
shorter): it holds the whole loop while it runs."""
TURN_WAIT_S = 0.05
"""Longest a lane waiting for its tenant's turn sleeps before it looks again."""
INLINE_LIMIT_NAME = "the limit of a read admitted on the event loop"
"""How that deadline is named in ``/livez`` and the log."""


class AdmitPlace:
    """Decides, read by read, whether admission runs on the event loop or in a thread."""

    def __init__(self, budget_s: float, *, threads_only: bool = False) -> None:
        if budget_s < 0:
            raise ValueError(f"budget_s must be >= 0, got {budget_s}")
        self.budget_s = 0.0 if threads_only else budget_s
        self.seconds_per_unit: float | None = None
        """The learned cost of one unit of a read (None until a read was admitted)."""

    @staticmethod
    def units(requests: int, characters: int) -> int:
        """A read's size in units of work: its requests and its text."""
        return requests * REQUEST_UNITS + characters

    def on_loop(self, units: int) -> bool:
        """Whether a read of ``units`` is predicted to cost at most the budget."""
        rate = self.seconds_per_unit
        return rate is not None and rate * units <= self.budget_s

    def learn(self, units: int, seconds: float) -> None:
        """A read of ``units`` took ``seconds`` to admit (wherever it ran)."""
        if units <= 0 or seconds < 0:
            return
        observed = seconds / units
        rate = self.seconds_per_unit
        if rate is None or observed >= rate:
            self.seconds_per_unit = observed
        else:
            self.seconds_per_unit = rate + FALL * (observed - rate)


Entries = list[tuple[bytes, dict[bytes, bytes] | None]]
"""What XREADGROUP and XCLAIM return: ids and fields (``{}`` or None: deleted while pending)."""


def stream_entries(reply: Any) -> Entries:
    """The entries of an XREADGROUP reply on one stream, RESP2 or RESP3; None or empty: nothing."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return next(iter(reply.values()))[0]
    return reply[0][1]


async def claim_excess(
    client: Any, stream: str, consumer: str, max_len: int
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The newest undelivered entries of ``stream`` beyond ``max_len`` (written around
    enqueue's limit), made pending to ``consumer`` and deleted (``claim_excess.lua``)."""
    taken = await functions.AsyncFunction(client, "claim_excess")(
        keys=[stream], args=[keys.GROUP, consumer, max_len, EXCESS_AT_MOST])
    return [(entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
            for entry_id, flat in taken or []]


def excess_refusals(
    entries: list[tuple[bytes, dict[bytes, bytes]]], max_len: int, *, policy: DeadLetterPolicy,
    now_epoch_ms: int,
) -> list[Answer]:
    """A ``queue_full`` dead letter for each entry taken, answered on its reply key."""
    message = (f"the queue held more than its maximum length ({max_len}) when this request "
               "was written around tokenq's enqueue (a plain XADD?): it was refused as an "
               "enqueue past the limit is")
    # claim_excess took their counted tokens off already: publishing them takes off none.
    return [dead_answer(entry_id, fields, ErrorCode.QUEUE_FULL, message, policy=policy,
                        deliveries=1, now_epoch_ms=now_epoch_ms, counts=False)
            for entry_id, fields in entries]


class Reader:
    """Reads every lane into the packer, within the read-ahead room."""

    def __init__(
        self, wiring: Wiring, lanes: LaneSet, intake: Intake, device: Device, outbox: Outbox,
        config_fields: Callable[[], dict[str, str]],
    ) -> None:
        """``config_fields``: the queue's config hash, written again when Redis lost it."""
        self._w = wiring
        self._lanes = lanes
        self._intake = intake
        self._device = device
        self._outbox = outbox
        self._config_fields = config_fields
        self._readers_left = 0
        self._last_activity = time.monotonic()
        settings = wiring.settings
        self._admit_place = AdmitPlace(settings.admit_inline_ms / 1000,
                                       threads_only=settings.tokenize_processes > 0)
        self._length_limit = settings.max_queue_length
        """What :meth:`_refuse_excess` holds each lane to; 0 once Redis refused the check."""
        self._turn = asyncio.Event()
        """Set as a tenant's read comes back: a lane waiting for its turn looks again."""
        self._parking = None if device.cache is None else Parking(
            wiring, device.cache, outbox.emit, self._take)

    def _light(self, job: Job[Ref]) -> bool:
        """Whether ``job`` is a tenant's without a backlog (the packer serves it first)."""
        return self._lanes.fair.light(self._lanes.tenant(job.ref))

    def starting(self) -> None:
        """Called once, as the read tasks (one per lane) are started."""
        self._readers_left = len(self._lanes)

    def adding(self) -> None:
        """Called as a read task is started for a lane added later (a tenant's)."""
        self._readers_left += 1

    async def ensure_group(self, lane: Lane) -> None:
        """The group on ``lane``'s stream, from its first entry; a tenant's stream is not made
        here (one removed as idle, ``remove_idle_tenants.lua``, is made by its next request:
        made here it would be listed nowhere, never removed)."""
        own = lane.tenant == keys.DEFAULT_TENANT
        try:
            await self._w.client.xgroup_create(lane.stream, keys.GROUP, id="0", mkstream=own)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc) and (own or "requires the key" not in str(exc)):
                raise

    async def run(self, lane: Lane) -> None:
        """Read one lane, its own history first, until the worker stops or the lane is removed;
        a failed read (history ones too) is counted for ``/readyz`` and retried."""
        w, health, lifecycle = self._w, self._w.health, self._w.lifecycle
        health.reader_started(lane.index)
        history: str | None = "0"  # where the next history read starts; None: all read
        packer, fair = self._device.packer, self._lanes.fair
        # Once the worker is told to stop, a read gets only a short grace.
        until_stopped = functools.partial(lifecycle.until_stopped,
                                          grace_s=w.settings.block_ms / 1000 + 1.0)
        try:
            backoff = 0.1
            while lifecycle.reading() and not lane.drained:
                if history is None and self._idle_expired():
                    log.info("queue idle for %.1fs; exiting", w.settings.exit_when_idle_s)
                    lifecycle.stop()
                    break
                count = self._intake.read_count(
                    packer.budget.max_batch_tokens, packer.buffered_tokens,
                    readers=len(self._lanes), cap=MAX_READ_COUNT if history is None else
                    HISTORY_COUNT,
                    own=fair.own_room(lane.tenant, self._intake.held_count(lane.index)))
                count = fair.read_count(lane.tenant, count)
                if count == 0:  # wait until something read is answered (or a second passes)
                    lifecycle.room_made.clear()
                    await wait_event(lifecycle.room_made, 1.0)
                    continue
                try:
                    if history is not None:
                        history = await until_stopped(self._read_history(lane, history, count))
                    elif not fair.may_read(lane.tenant, time.monotonic()):
                        self._turn.clear()  # another tenant's turn: wait for a read of theirs
                        await wait_event(self._turn, TURN_WAIT_S)
                        continue
                    elif not await until_stopped(self._reclaim(lane, count)):
                        await until_stopped(self._refuse_excess(lane))
                        entries = await until_stopped(self._xread(lane, ">", count))
                        if entries is None:  # stopped mid-read: the loop's test ends it
                            continue
                        fair.arrived(lane.tenant, full=len(entries) >= count,
                                     now=time.monotonic())
                        if entries:
                            fair.took(lane.tenant, time.monotonic())
                            full_s = packer.timer.ms(packer.budget.max_batch_tokens) / 1000
                            packer.light = self._light if fair.sharing(
                                time.monotonic(), full_s) else None
                            await self._take(lane, entries)
                        self._turn.set()  # charged: a lane waiting for its turn looks again
                    health.read_ok(lane.index)
                    backoff = 0.1
                except RedisError as exc:
                    await self._on_read_error(lane, exc, backoff)
                    backoff = min(backoff * 2, 5.0)
        finally:
            health.reader_ended(lane.index)
            self._readers_left -= 1
            if self._readers_left <= 0:
                self._device.end_input()

    async def _reclaim(self, lane: Lane, count: int) -> bool:
        """Every heartbeat interval, take over entries of dead workers; True if any."""
        now = time.monotonic()
        if now - lane.last_reclaim < self._w.settings.heartbeat_s:
            return False
        lane.last_reclaim = now
        # What we hold must not be run (and answered) twice: the scan claims none of it.
        with self._intake.reserving(count), self._w.stages.running(
                READ, f"the reclaim scan on {lane.stream}", *self._w.call_deadline):
            claimed = await lane.reclaimer.scan(
                count, set(self._intake.held_by_lane().get(lane.index, ())))
            self._intake.hold(lane.index, claimed.entries)
        if not claimed.entries:
            return False
        self._w.recorder.reclaimed(len(claimed.entries))
        await self._take(lane, claimed.entries, claimed.deliveries)
        return True

    async def _refuse_excess(self, lane: Lane) -> None:
        """Refuse the entries past the queue's length limit; a Redis that refuses the check to
        this ACL user (FCALL's key, or a command the function runs) turns it off, warning once."""
        if not self._length_limit:
            return
        try:
            with self._w.stages.running(READ, f"the length check on {lane.stream}",
                                        *self._w.call_deadline):
                entries = await claim_excess(self._w.client, lane.stream, self._w.consumer,
                                             self._length_limit)
        except ResponseError as exc:  # a WRONGTYPE stream fails the read instead
            if error_code(exc) != "NOPERM" and "executing the script can't" not in str(exc):
                raise
            log.warning("cannot check %s against max_queue_length (%s): entries written "
                        "around enqueue's limit are not refused by this worker",
                        lane.stream, error_text(exc))
            self._length_limit = 0
            return
        if not entries:
            return
        log.warning("%d entries on %s were written past max_queue_length %d around "
                    "enqueue; refused as queue_full and dead-lettered", len(entries),
                    lane.stream, self._length_limit)
        # Not held: a claim refresh (XCLAIM) of an entry deleted from the stream would drop
        # it from the pending list before its answer is published.
        self._refused(lane, excess_refusals(entries, self._length_limit,
                                            policy=lane.dead_letters,
                                            now_epoch_ms=self._w.clock.now_ms()))

    async def _read_history(self, lane: Lane, last: str, count: int) -> str | None:
        """Re-read entries this consumer already owns after ``last`` (a restart under the same
        name); the next start, or None once all are read. Each counts as a delivery, so one
        that crashed the last process is dead-lettered after ``max_deliveries``."""
        entries = await self._xread(lane, last, count)
        if not entries:
            return None
        deliveries = await lane.reclaimer.own_deliveries([e[0] for e in entries])
        await self._take(lane, entries, deliveries)
        return entries[-1][0].decode()

    async def _xread(self, lane: Lane, last_id: str, count: int) -> Entries:
        """New entries (``last_id`` ``>``, blocking up to ``block_ms``), or history after it,
        held before the read's reservation ends."""
        with self._intake.reserving(count), self._w.stages.running(
                READ, f"an XREADGROUP on {lane.stream}", *self._w.call_deadline):
            reply = await self._w.client.xreadgroup(
                keys.GROUP, self._w.consumer, {lane.stream: last_id}, count=count,
                block=self._w.settings.block_ms if last_id == ">" else None)
            entries = stream_entries(reply)
            self._intake.hold(lane.index, entries)
        return entries

    async def _on_read_error(self, lane: Lane, exc: RedisError, backoff: float) -> None:
        """Wait out a failed read; counted for ``/readyz`` unless a tenant's stream was removed
        as idle. A retired lane's stream is never made again here."""
        if _tenant_removed(exc, lane):
            # Its next request makes it again (the group from id 0 here), or the tenants'
            # task closes the lane once the set no longer lists it.
            if not lane.drained:
                with contextlib.suppress(RedisError):
                    await self.ensure_group(lane)
                await wait_event(self._w.lifecycle.stopping, min(backoff, MISSING_WAIT_S))
            return
        self._w.health.read_failed(lane.index, exc)
        # NOGROUP or "no such key": the stream is gone (Redis restarted empty, or deleted).
        if _missing(exc) and not lane.retired:
            log.warning("consumer group missing on %s (Redis restarted empty?); recreating it",
                        lane.stream)
            self._w.health.joined = False
            try:
                await self.ensure_group(lane)
                # An empty Redis lost the config hash too; producers need it back
                # for their early checks and exact estimates.
                await presence.write_config(self._w.client, lane.queue, self._config_fields())
                self._w.health.joined = True
                return
            except RedisError:
                pass
        log.warning("read failed (%s); retrying in %.1fs", error_text(exc), backoff)
        await wait_event(self._w.lifecycle.stopping, backoff)

    def _idle_expired(self) -> bool:
        limit = self._w.settings.exit_when_idle_s
        if limit is None or self._device.feed.held() or self._intake.busy():
            return False
        return time.monotonic() - self._last_activity >= limit

    def _refused(self, lane: Lane, answers: list[Answer]) -> None:
        """Answers owed for entries of ``lane`` that never reach the device."""
        if answers:
            self._w.recorder.refused_at_intake(answers)
            self._outbox.emit(lane.index, answers)

    async def _take(
        self, lane: Lane, entries: Entries, deliveries: dict[bytes, int] | None = None
    ) -> None:
        """Decode, tokenize and buffer one read, held already; no entry can make this raise."""
        self._last_activity = time.monotonic()
        present = [(entry_id, fields) for entry_id, fields in entries if fields]
        if len(present) < len(entries):  # deleted while pending to us: nothing to answer
            self._outbox.emit(lane.index, [Answer(entry_id, None, b"", ok=False)
                                           for entry_id, fields in entries if not fields])
        if present:
            await self._take_present(lane, present, deliveries or {})
        self._device.wake()

    async def _take_present(
        self, lane: Lane, present: list[tuple[bytes, dict[bytes, bytes]]],
        deliveries: dict[bytes, int],
    ) -> None:
        """A read that fails is taken entry by entry; an entry that fails is dead-lettered."""
        try:
            jobs, answers = await self._prepare(lane, present, deliveries)
        except Exception as exc:
            if len(present) > 1:
                for one in present:
                    await self._take_present(lane, [one], deliveries)
                return
            log.exception("entry %r could not be taken; dead-lettering it", present[0][0])
            jobs, answers = [], [_untakable(lane, *present[0], f"{type(exc).__name__}: {exc}",
                                            deliveries, self._w.clock.now_ms())]
        self._device.add(jobs)
        self._refused(lane, answers)

    async def _prepare(
        self, lane: Lane, present: list[tuple[bytes, dict[bytes, bytes]]],
        deliveries: dict[bytes, int],
    ) -> tuple[list[Job[Ref]], list[Answer]]:
        """Jobs to buffer and answers owed for one read, with no effect on the buffer; admitted
        on the event loop when ``AdmitPlace`` says it is cheap, else in a thread."""
        now = self._w.clock.now_ms()
        decoded = decode_entries(
            present, policy=lane.dead_letters, deliveries=deliveries, now_epoch_ms=now
        )
        answers, requests = list(decoded.answers), decoded.requests
        digests: list[bytes | None] | None = None
        if requests and self._parking is not None:
            digest = self._device.pipeline.digest
            requests, digests = await self._parking.look_up(lane, requests, [
                digest(Ref(lane.index, entry_id), request) for entry_id, request in requests
            ], present, deliveries)
        if not requests:
            return [], answers
        units = AdmitPlace.units(len(requests), sum(
            len(request.text) + len(request.text_pair or "") for _, request in requests))
        admit = functools.partial(_admit, self._device.pipeline, lane, requests, monotonic_ms(),
                                  now, digests)
        settings = self._w.settings
        on_loop = self._admit_place.on_loop(units)
        if on_loop:
            where, limit = " on the event loop", (
                min(INLINE_LIMIT_S, settings.batch_timeout_s), INLINE_LIMIT_NAME)
        else:
            where, limit = "", (settings.batch_timeout_s, "batch_timeout_s")
        claimed = sum(max(1, request.tokens) for _, request in requests)
        with self._intake.estimating(claimed), self._w.stages.running(
            TOKENIZING, f"a read of {len(requests)} requests being tokenized{where}",
            *limit, shortened_by_stop=True,
        ):
            admitted, seconds = admit() if on_loop else await asyncio.to_thread(admit)
        self._w.recorder.metrics.tokenized(seconds)
        self._admit_place.learn(units, seconds)
        if digests is not None and self._device.cache is not None and (
                admitted.answered or admitted.broken):  # else every request is a job
            self._device.cache.put(_unrun(requests, digests, admitted.jobs))
        for owed in answers_by_lane(self._device.pipeline, admitted.answered).values():
            answers += owed  # all on this lane: the read's own entries
        fields = dict(present) if admitted.broken else {}
        answers += [
            _untakable(lane, item.ref.entry_id, fields[item.ref.entry_id], why, deliveries, now)
            for item, why in admitted.broken
        ]
        exact = sum(job.encoding.length for job in admitted.jobs)
        self._intake.learn(len(requests), exact)
        self._lanes.fair.charge(lane.tenant, exact, len(requests))
        return admitted.jobs, answers


MISSING_WAIT_S = 1.0
"""Longest wait between looks at a tenant's stream that is gone (its next request makes it)."""


def _missing(exc: RedisError) -> bool:
    """Whether ``exc`` says the stream or its group is gone."""
    return isinstance(exc, ResponseError) and any(
        sign in str(exc) for sign in ("NOGROUP", "no such key"))


def _tenant_removed(exc: RedisError, lane: Lane) -> bool:
    """Whether ``exc`` says a tenant's stream is gone: missing, or deleted under a blocked read
    (UNBLOCKED), as ``remove_idle_tenants.lua`` does to an idle one."""
    return lane.tenant != keys.DEFAULT_TENANT and (
        _missing(exc) or (isinstance(exc, ResponseError) and "no longer exists" in str(exc)))


def _admit(
    pipeline: Pipeline[Ref], lane: Lane, requests: list[tuple[bytes, wire.Request]],
    read_ms: float, now_epoch_ms: int, digests: list[bytes | None] | None = None,
) -> tuple[Admitted[Ref], float]:
    """The pipeline's admission of one read and the seconds it took (in a thread, or on the
    event loop when ``AdmitPlace`` says it is cheap); ``digests``: the cache lookup's."""
    deadline_of = wire.deadline_of
    items = [
        Admit(ref, request, deadline_of(request, entry_id), read_ms)
        for ref, (entry_id, request) in zip(
            lane.refs([entry_id for entry_id, _ in requests]), requests, strict=True)
    ]
    if digests is not None:
        for item, digest in zip(items, digests, strict=True):
            item.digest = digest
    started = time.perf_counter()
    admitted = pipeline.admit(items, now_epoch_ms)
    return admitted, time.perf_counter() - started


def _unrun(requests: list[tuple[bytes, wire.Request]], digests: list[bytes | None],
           jobs: list[Job[Ref]]) -> list[tuple[bytes, None]]:
    """Claims to end now: the digests of requests admission answered (late, refused) or could
    not take, none a job of this read runs; held, an identical request elsewhere would wait
    for the claim to lapse."""
    taken, running = {job.ref.entry_id for job in jobs}, {job.digest for job in jobs}
    return [(digest, None) for digest in dict.fromkeys(
        digest for (entry_id, _), digest in zip(requests, digests, strict=True)
        if digest is not None and entry_id not in taken and digest not in running)]


def _untakable(
    lane: Lane, entry_id: bytes, fields: dict[bytes, bytes], why: str,
    deliveries: dict[bytes, int], now_epoch_ms: int,
) -> Answer:
    """The dead letter of an entry the worker could not take, saying why."""
    return dead_answer(
        entry_id, fields, ErrorCode.BAD_REQUEST,
        f"the worker could not take this entry: {why}"[:1000],
        policy=lane.dead_letters, deliveries=deliveries.get(entry_id, 1),
        now_epoch_ms=now_epoch_ms,
    )
