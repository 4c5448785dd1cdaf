"""The worker process: the Redis I/O and scheduling around the request pipeline.

Every per-request rule (deadlines, the over-length policy, tokenizer and row
isolation, OOM splitting, chunk settlement, reply encoding) is the
pipeline's (``worker/pipeline``), shared with the in-process batcher; every
batching decision is the packer's. What is left here is reading, holding,
claiming and publishing.

Four small tasks joined by bounded hand-offs (TEI's shape):

* **read**   XREADGROUP about ``read_ahead_budgets`` budgets of estimated tokens
  ahead, decode, admit through the pipeline in a thread, and buffer the jobs
  in the packer (one read task per stream of a sharded queue: ``lanes.py``);
* **run**    :class:`~tokenq.worker.pipeline.feed.DeviceFeed`: a device
  thread takes the packer's next batch the moment the device frees, runs it
  through the pipeline (one batch on the device at a time) and hands the
  outcome back to the event loop, which accounts for it and builds the
  answers;
* **publish** answer each batch in one script (reply, XACK, XDEL), retrying
  until Redis takes it (one publish task per stream, so a shard whose node
  is down holds back only its own answers; an answer holds its entry's
  read-ahead room until it is published);
* **beat**   heartbeat, and keep the buffered entries' idle time fresh so no
  other worker claims them;
* **watchdog** a stage that holds entries past its deadline is hung (a batch
  on the device or a read being tokenized past ``batch_timeout_s``, a Redis
  read or publish attempt past :func:`redis_call_deadline_s`; the rules:
  ``worker/stages.py``): stop reading and refreshing claims, publish what is
  done, and raise :class:`WorkerHung` (the command exits 3 and its supervisor
  restarts it; peers claim and answer its entries).

The beat, the watchdog, the join and the stop report to
:class:`~tokenq.worker.health.Health`, which the ``/livez`` and ``/readyz``
probes read (``worker/endpoint.py``).

Reading and tokenizing the next batch and publishing the last one overlap
with the device's work.

Containment: nothing one stream entry contains can end the process. Every
read is decoded, tokenized and buffered as a unit; if that raises anything,
the read is split and retried one entry at a time, and the entry that still
fails is dead-lettered. Only a failure of the worker itself (the device lost,
a bug in the loop) ends :meth:`Worker.run` with an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from tokenq.shared import keys, wire
from tokenq.shared.errors import ErrorCode, TokenqError
from tokenq.shared.heartbeat import Heartbeat
from tokenq.shared.packer import AdaptiveBudget, Batch, Budget, Packer
from tokenq.shared.settings import WorkerSettings
from tokenq.worker import depth, presence
from tokenq.worker.backends.base import Backend
from tokenq.worker.clock import RedisClock
from tokenq.worker.connection import connect
from tokenq.worker.health import Health
from tokenq.worker.lanes import Lane, Retirement, by_lane, entry_ids, split_ref, tagged
from tokenq.worker.logs import FIELDS
from tokenq.worker.metrics import NullMetrics
from tokenq.worker.pipeline.execute import adapt_budget
from tokenq.worker.pipeline.feed import DeviceFeed, monotonic_ms, wait_event
from tokenq.worker.pipeline.jobs import (
    Answer,
    DeadLetterPolicy,
    answer_of,
    dead_answer,
    decode_entries,
)
from tokenq.worker.pipeline.pipeline import (
    Admit,
    Admitted,
    BatchOutcome,
    Job,
    Pipeline,
    budget_for,
)
from tokenq.worker.pipeline.tokenizing import pool_for
from tokenq.worker.publish import Publisher
from tokenq.worker.read_ahead import ByteRoom
from tokenq.worker.recovery import Reclaimer
from tokenq.worker.server_check import check_server
from tokenq.worker.stages import DEVICE, PUBLISH, READ, TOKENIZING, Stages
from tokenq.worker.stats import BatchLog, BatchRecord, WorkerStats, exit_line

log = logging.getLogger("tokenq.worker")

_T = TypeVar("_T")

_HISTORY_COUNT = 256
_MAX_READ_COUNT = 1024
_PUBLISH_CHUNK = 2048
"""Most answers one publish call carries when several batches' answers are waiting."""
_STOP_GRACE_S = 5.0
"""How long a stopping worker keeps trying to publish and deregister while Redis is down."""


class WorkerHung(TokenqError):
    """A stage holding entries ran past its deadline (a batch on the device past
    ``batch_timeout_s``, a tokenizer that never returns); the process must be restarted.

    The thread running it cannot be stopped from Python, so the command that
    catches this exits the process (``os._exit``) with code 3.
    """


def watchdog_period_s(settings: WorkerSettings) -> float:
    """How often the watchdog looks at the stages (and ticks the event loop's liveness)."""
    return min(1.0, settings.batch_timeout_s / 4)


REDIS_CALL_BOUND = "twice the Redis call bound"


def redis_call_deadline_s(settings: WorkerSettings) -> float:
    """The deadline of one Redis read or publish attempt: twice what redis-py can take.

    Each of its ``retries + 1`` attempts connects (at most 5 s), sends and
    waits up to ``socket_timeout_s`` (a blocking read ``block_ms`` more),
    with at most 2 s of backoff between: a Redis that is down or frozen makes
    the call fail by then (not a hang: Redis away is not the worker's fault),
    so a call still running at twice that is stuck in the worker itself.
    """
    attempt = settings.block_ms / 1000 + settings.socket_timeout_s + min(
        5.0, settings.socket_timeout_s)
    return 2 * ((settings.retries + 1) * attempt + settings.retries * 2.0)


def default_consumer_name() -> str:
    """host-pid-random: unique per process, readable in XINFO CONSUMERS."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class Plan:
    """Limits the worker runs under, derived once from settings and the backend."""

    budget: Budget
    budget_reason: str
    policy: str


def plan(settings: WorkerSettings, backend: Backend) -> Plan:
    """Choose the budget and cost model; refuse settings the model cannot honour."""
    info = backend.info
    if settings.max_batch_tokens == "auto":
        from tokenq.worker.backends.calibrate import calibrate_budget

        tokens, reason = calibrate_budget(backend, max_rows=settings.max_batch_size)
        reason = f"auto: {reason}"
    else:
        tokens, reason = int(settings.max_batch_tokens), "set by --max-batch-tokens"
    budget = budget_for(info, tokens, settings.max_batch_size, settings.cost_model, reason)
    return Plan(budget=budget, budget_reason=reason, policy=settings.policy)


class Worker:
    """One worker process's loop over one queue."""

    def __init__(
        self,
        settings: WorkerSettings,
        backend: Backend,
        *,
        client: aioredis.Redis | None = None,
        metrics: NullMetrics | None = None,
        health: Health | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.health = health if health is not None else Health(
            settings.heartbeat_s, watchdog_period_s(settings)
        )
        self.backend = backend
        self.queue = settings.queue_ref
        self.consumer = settings.consumer or default_consumer_name()
        lanes = keys.lanes_of(self.queue, settings.shards or 1)
        self._retirement = Retirement(self.queue, settings.shards or 1)
        self.lanes = [
            Lane(index, queue, self._dead_letter_policy(settings, queue), tagged=len(lanes) > 1)
            for index, queue in enumerate(lanes)
        ]
        self.plan = plan(settings, backend)
        self._tokenizer_pool = pool_for(backend, settings.tokenize_processes)
        self.pipeline: Pipeline[bytes] = Pipeline(
            backend, policy=settings.policy, chunk_overlap=settings.chunk_overlap,
            tokenizer=self._tokenizer_pool,
        )
        self.packer: Packer[Job[bytes]] = Packer(
            self.plan.budget, settings.linger_ms, max_padding_ratio=settings.max_padding_ratio,
            aging_ms=settings.aging_ms, max_batch_ms=settings.max_batch_ms,
        )
        self.adaptive = AdaptiveBudget(
            self.plan.budget.max_batch_tokens, backend.info.max_input_tokens
        )
        self._feed: DeviceFeed[Job[bytes], _Ran] = DeviceFeed(
            self.packer, self._execute,
            flushing=lambda: self._stopping.is_set(),
            finished=lambda: self._reader_done and not self.packer,
            on_take=lambda: self._space.set(),
            name="tokenq-device",
        )
        self.stats = WorkerStats()
        self._client = client
        self._own_client = client is None
        self._batch_log = BatchLog(settings.batch_log)
        self._stopping = asyncio.Event()
        self._closing = asyncio.Event()
        self._space = asyncio.Event()
        # One outbox per lane, each drained by its own publish task, so a shard
        # whose node is down holds back only its own answers. Unbounded: what
        # waits in them still counts as held (bytes), so the read-ahead room
        # is what bounds them, as it bounds everything the worker holds.
        self._outboxes: list[asyncio.Queue[list[Answer] | None]] = [
            asyncio.Queue() for _ in self.lanes
        ]
        self._reader_done = False
        self._readers_left = len(self.lanes)
        self._inflight_estimate = 0
        self._stages = Stages(time.monotonic)
        """The stages holding entries now, each with its deadline (the watchdog reads it)."""
        self._redis_deadline_s = redis_call_deadline_s(settings)
        self._hung = False
        self._read_room = ByteRoom(
            settings.read_ahead_bytes, wire.max_entry_bytes(settings.max_request_bytes)
        )
        """The byte bound on read-ahead: held < read_ahead_bytes + one largest entry."""
        self._held_bytes = self._read_room.held
        """Raw size of each entry read and not yet answered."""
        self._clock = RedisClock()
        # Estimated tokens per request, which turns the read-ahead room into an
        # XREADGROUP count. It starts at the longest input the model takes, so
        # the first read cannot overshoot the room however long the requests
        # are (from 64, one idle worker took a whole burst while its peers
        # idled); each request read then counts as one step of a 0.1 EMA.
        self._avg_estimate = float(max(1, backend.info.max_input_tokens))
        self._last_activity = time.monotonic()
        self._reply_ttl_ms = int(settings.reply_ttl_s * 1000)
        self._stop_started: float | None = None
        self._publishing = 0
        """How many lanes' publish calls are in flight."""
        self._unpublished_answers = 0
        """Answers emitted and not yet published: they hold read-ahead room, in tokens too."""
        self._depth_failed = False
        self.health.loaded()  # the backend is built and the plan holds: the model is in

    def _dead_letter_policy(
        self, settings: WorkerSettings, queue: keys.QueueRef
    ) -> DeadLetterPolicy:
        """A lane's rules for dead letters and reply keys: replies stay in the lane's slot."""
        return DeadLetterPolicy(
            worker=self.consumer,
            max_deliveries=settings.max_deliveries,
            default_reply_to=functools.partial(keys.reply, queue),
            max_request_bytes=settings.max_request_bytes,
            check_reply_to=functools.partial(
                keys.reply_to_refusal, queue, extra_prefixes=settings.reply_to_prefix_list
            ),
            max_letter_bytes=settings.dead_max_letter_bytes,
        )

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            self._client = connect(self.settings)
        return self._client

    def stop(self) -> None:
        """Stop reading; finish and answer what was read; then return from run()."""
        if not self._stopping.is_set():
            log.info("stopping: finishing %d buffered requests", len(self.packer))
            self._stop_started = time.monotonic()
        self.health.stopping = True
        self._stopping.set()
        self._feed.wake()
        self._space.set()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Serve the queue until stop() is called (or the idle timeout passes)."""
        for lane in self.lanes:
            self._equip(lane)
        if self._tokenizer_pool is not None:
            await asyncio.to_thread(self._tokenizer_pool.start)
        if not await self._join():  # stopped before Redis ever answered
            self._close_tokenizer_pool()
            if self._own_client and self._client is not None:
                await self._client.aclose()
            return
        self._log_start()
        self.health.running(time.monotonic())
        beat = asyncio.create_task(self._beat_loop(), name="tokenq-beat")
        tasks = [
            *(asyncio.create_task(self._read_loop(lane), name=f"tokenq-read-{lane.index}")
              for lane in self.lanes),
            asyncio.create_task(self._run_loop(), name="tokenq-run"),
            *(asyncio.create_task(self._publish_loop(lane), name=f"tokenq-publish-{lane.index}")
              for lane in self.lanes),
        ]
        watchdog = asyncio.create_task(self._watchdog(), name="tokenq-watchdog")
        try:
            await _first_failure(tasks, watchdog)
        finally:
            # redis-py can swallow a cancel that lands inside a command, so
            # the loops also watch _closing, and the wait for them is bounded.
            self._closing.set()
            self.health.closed()  # no more ticks: the probes stop expecting them
            for task in (*tasks, watchdog, beat):
                task.cancel()
            await asyncio.wait({beat, watchdog, *tasks}, timeout=_STOP_GRACE_S)
            try:
                await asyncio.wait_for(self._leave(), _STOP_GRACE_S)
            except (RedisError, asyncio.TimeoutError) as exc:
                log.warning("could not deregister: %s", exc or "Redis did not answer")
            self._batch_log.close()
            self._close_tokenizer_pool()
            if self._own_client and self._client is not None:
                await self._client.aclose()
            fields = self.stats.exit_fields(self.consumer, time.time())
            log.info(exit_line(fields), extra={FIELDS: fields})

    def _equip(self, lane: Lane) -> None:
        """Give a lane what reclaims and publishes on it."""
        lane.reclaimer = Reclaimer(
            self.client, lane.queue, self.consumer,
            dead_after_ms=int(self.settings.heartbeat_s * 3000),
            claim_idle_ms=int(self.settings.claim_idle_s * 1000),
        )
        lane.publisher = Publisher(
            self.client, stream=lane.stream, dead=keys.dead(lane.queue), group=keys.GROUP,
            consumer=self.consumer, reply_ttl_ms=self._reply_ttl_ms,
            dead_max_len=self.settings.dead_max_len,
            dead_max_letter_bytes=self.settings.dead_max_letter_bytes,
            on_refused=self._publish_refused, on_published=self.health.publish_ok,
        )

    def _add_lanes(self, queues: list[keys.QueueRef]) -> None:
        """Read retired shards too (``lanes.Retirement``): extra lanes into the same packer,
        each answered and dead-lettered on its own, until it is drained and removed."""
        for queue in queues:
            lane = Lane(len(self.lanes), queue, self._dead_letter_policy(self.settings, queue),
                        tagged=True, retired=True)
            self._equip(lane)
            self.lanes.append(lane)
            self._outboxes.append(asyncio.Queue())
            self._readers_left += 1
        for lane in self.lanes if queues else ():
            lane.tagged = True  # nothing is read before the join: no reference changes name

    async def _tend_retired(self) -> None:
        """Once a beat: stop reading the retired lanes that are drained and removed."""
        for lane in await self._retirement.tend(self.client, self.lanes, self.consumer):
            lane.drained = True
            self.lanes.remove(lane)

    async def _leave(self) -> None:
        for lane in self.lanes:
            await presence.leave(self.client, lane.queue, self.consumer)

    def _close_tokenizer_pool(self) -> None:
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.close()

    async def _join(self) -> bool:
        """Create the group and publish the config, waiting for Redis if it is not up yet.

        A worker may start before Redis does (compose, Kubernetes); it retries
        with backoff until Redis answers or it is told to stop (False).
        """
        delay = 0.5
        while not self._stopping.is_set():
            try:
                self._add_lanes(await self._retirement.join(self.client))
                for lane in self.lanes:
                    await self._ensure_group(lane)
                await check_server(self.client)
                await self._clock.sync(self.client)
                for lane in self.lanes:
                    await presence.write_config(self.client, lane.queue, self._config_fields())
                self.health.redis_answered()
                return True
            except RedisError as exc:
                self.health.redis_answered(exc)
                log.warning("Redis not reachable at start (%s); retrying in %.1fs", exc, delay)
                await wait_event(self._stopping, delay)
                delay = min(delay * 2, 5.0)
        return False

    def _config_fields(self) -> dict[str, str]:
        return presence.config_fields(
            self.backend.info, policy=self.plan.policy,
            max_batch_tokens=self.plan.budget.max_batch_tokens,
            shards=self.settings.shards or 1,
            tokenize_processes=self.settings.tokenize_processes,
        )

    def _log_start(self) -> None:
        info = self.backend.info
        budget = self.plan.budget
        log.info(
            "worker %s on %s: model=%s task=%s device=%s dtype=%s max_input=%d "
            "budget=%d tokens (%s; %s) rows<=%d linger=%.1fms policy=%s",
            self.consumer, self._streams(), info.model, info.task,
            info.device, info.dtype,
            info.max_input_tokens, budget.max_batch_tokens, budget.cost_model.value,
            self.plan.budget_reason, budget.max_batch_size, self.settings.linger_ms,
            self.plan.policy,
        )

    def _streams(self) -> str:
        """The streams this worker reads, for its log lines."""
        return ", ".join(lane.stream for lane in self.lanes)

    async def _ensure_group(self, lane: Lane) -> None:
        try:
            await self.client.xgroup_create(lane.stream, keys.GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # ----------------------------------------------------------------------- read

    def _room(self) -> float:
        """Estimated tokens the worker may still read ahead."""
        limit = self.settings.read_ahead_budgets * self.packer.budget.max_batch_tokens
        waiting = self._unpublished_answers * self._avg_estimate
        return limit - self.packer.buffered_tokens - self._inflight_estimate - waiting

    def _read_count(self, cap: int = _MAX_READ_COUNT) -> int:
        """How many entries the next XREADGROUP may take (0: no room now).

        Bounded by both rooms. Tokens: from the exact lengths of what was read
        lately (not the producers' claims), about ``read_ahead_budgets``
        budgets, each lane its share. Bytes: a bound, not an estimate
        (``read_ahead.py``): the room over the largest entry, reserved while
        the read runs, so what the worker holds stays below
        ``read_ahead_bytes`` plus one largest entry whatever the sizes.
        """
        tokens = self._room()
        # Every lane reads at once, so each takes its share of both rooms.
        by_bytes = self._read_room.count(cap, readers=len(self.lanes))
        if tokens <= 0 or by_bytes == 0:
            return 0
        share = tokens // self._avg_estimate // len(self.lanes)
        return int(min(by_bytes, max(1, share)))

    def _reading(self) -> bool:
        return not (self._stopping.is_set() or self._hung)

    async def _read_loop(self, lane: Lane) -> None:
        self.health.reader_started(lane.index)
        try:
            await self._until_stopped(self._read_history(lane))
            backoff = 0.1
            while self._reading() and not lane.drained:
                if self._idle_expired():
                    log.info("queue idle for %.1fs; exiting", self.settings.exit_when_idle_s)
                    self.stop()
                    break
                count = self._read_count()
                if count == 0:
                    await self._wait_for_space()
                    continue
                try:
                    with self._read_room.reserving(count):
                        if await self._until_stopped(self._reclaim(lane, count)):
                            self.health.read_ok(lane.index)
                            continue
                        entries = await self._until_stopped(
                            self._xread(lane, ">", count, self.settings.block_ms)
                        )
                        self._hold(lane, entries or [])
                    self.health.read_ok(lane.index)
                    backoff = 0.1
                except RedisError as exc:
                    self.health.read_failed(lane.index, exc)
                    await self._on_read_error(lane, exc, backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                if entries:
                    await self._take(lane, entries, held=True)
        finally:
            self.health.reader_ended(lane.index)
            self._readers_left -= 1
            self._reader_done = self._readers_left == 0
            self._feed.wake()

    async def _wait_for_space(self) -> None:
        """Wait until something read was answered (or a second passed): room to read more."""
        self._space.clear()
        await wait_event(self._space, 1.0)

    def _hold(self, lane: Lane, entries: list[tuple[bytes, dict[bytes, bytes] | None]]) -> None:
        """Count a read's entries as held, before its reservation ends (``read_ahead.py``:
        the room they take is never free in between)."""
        ref, hold = lane.ref, self._read_room.hold  # bound once: per entry below
        for entry_id, fields in entries:
            if fields is not None:
                hold(ref(entry_id), _entry_bytes(fields))

    async def _until_stopped(self, read: Coroutine[Any, Any, _T]) -> _T | None:
        """Run one read; once the worker is told to stop, give it only a short grace.

        A read that Redis answers (a blocking XREADGROUP returns within
        ``block_ms``) is let finish and its entries are taken and answered: an
        abandoned read may already have delivered entries to this consumer.
        Only a read still unanswered after the grace — Redis down or frozen,
        redis-py spending its retries — is abandoned (None), so a stop never
        waits for that; whatever it delivered stays pending to this consumer
        and the safety net (or a restart's history read) hands it out again.
        """
        task = asyncio.ensure_future(read)
        stopped = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not task.done():
            await asyncio.wait({task}, timeout=self.settings.block_ms / 1000 + 1.0)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, RedisError):
            await task
        return None

    async def _reclaim(self, lane: Lane, count: int) -> bool:
        """Every heartbeat interval, take over entries of dead workers; True if any."""
        now = time.monotonic()
        if now - lane.last_reclaim < self.settings.heartbeat_s:
            return False
        lane.last_reclaim = now
        assert lane.reclaimer is not None
        # What we hold must not be run (and answered) twice: the scan claims none of it.
        with self._stages.running(READ, f"the reclaim scan on {lane.stream}",
                                  self._redis_deadline_s, REDIS_CALL_BOUND):
            claimed = await lane.reclaimer.scan(
                count, set(self._held_by_lane().get(lane.index, ())))
        if not claimed.entries:
            return False
        self.stats.reclaimed += len(claimed.entries)
        self.metrics.reclaimed(len(claimed.entries))
        await self._take(lane, claimed.entries, claimed.deliveries)
        return True

    async def _read_history(self, lane: Lane) -> None:
        """Re-read entries this consumer already owns (a restart under the same name).

        Each history read counts as a delivery, and the counts are looked up
        and honoured, so an entry that crashed the previous process under
        this name is dead-lettered after ``max_deliveries`` like any other.
        """
        last = "0"
        while self._reading():
            count = self._read_count(_HISTORY_COUNT)
            if count == 0:
                await self._wait_for_space()
                continue
            with self._read_room.reserving(count):
                entries = await self._xread(lane, last, count, None)
                self._hold(lane, entries)
            if not entries:
                return
            assert lane.reclaimer is not None
            deliveries = await lane.reclaimer.own_deliveries([e[0] for e in entries])
            await self._take(lane, entries, deliveries, held=True)
            last = entries[-1][0].decode()

    async def _xread(
        self, lane: Lane, last_id: str, count: int, block_ms: int | None
    ) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
        with self._stages.running(READ, f"an XREADGROUP on {lane.stream}",
                                  self._redis_deadline_s, REDIS_CALL_BOUND):
            reply = await self.client.xreadgroup(
                keys.GROUP, self.consumer, {lane.stream: last_id}, count=count, block=block_ms
            )
        if not reply:
            return []
        # RESP2 gives [[stream, entries]]; RESP3 gives {stream: [entries]}.
        if isinstance(reply, dict):
            return next(iter(reply.values()))[0] if reply else []
        return reply[0][1]

    async def _on_read_error(self, lane: Lane, exc: RedisError, backoff: float) -> None:
        # A retired lane's stream goes once it is drained: never made again here.
        # NOGROUP from XREADGROUP, "no such key" from the reclaim scan's XINFO: the
        # stream is gone (Redis restarted empty, or someone deleted it).
        missing = isinstance(exc, ResponseError) and any(
            sign in str(exc) for sign in ("NOGROUP", "no such key"))
        if missing and not lane.retired:
            log.warning("consumer group missing on %s (Redis restarted empty?); recreating it",
                        lane.stream)
            self.health.joined = False
            try:
                await self._ensure_group(lane)
                # An empty Redis lost the config hash too; producers need it back
                # for their early checks and exact estimates.
                await presence.write_config(self.client, lane.queue, self._config_fields())
                self.health.joined = True
                return
            except RedisError:
                pass
        log.warning("read failed (%s); retrying in %.1fs", exc, backoff)
        await wait_event(self._stopping, backoff)

    def _idle_expired(self) -> bool:
        limit = self.settings.exit_when_idle_s
        if limit is None or self._feed.held() or self._inflight_estimate:
            return False
        return time.monotonic() - self._last_activity >= limit

    async def _take(
        self,
        lane: Lane,
        entries: list[tuple[bytes, dict[bytes, bytes] | None]],
        deliveries: dict[bytes, int] | None = None,
        *,
        held: bool = False,
    ) -> None:
        """Decode, tokenize and buffer one read; no entry can make this raise.

        ``held``: the read already counted its entries as held (:meth:`_hold`,
        inside its reservation), so they are not sized a second time here.

        The read is prepared as a unit (:meth:`_prepare`: decoding and
        tokenizing, with no side effects) and only then buffered. If preparing
        raises anything, the read is split into single entries, and an entry
        that still fails alone is dead-lettered naming the error, so a poison
        entry costs its own answer, never the worker or its neighbours.
        """
        self._last_activity = time.monotonic()
        deliveries = deliveries or {}
        gone = [entry_id for entry_id, fields in entries if fields is None]
        if gone:  # deleted while pending to us: nothing to answer, just release
            await self._emit([Answer(lane.ref(entry_id), None, b"", ok=False) for entry_id in gone])
        present = [(entry_id, fields) for entry_id, fields in entries if fields is not None]
        if not held:
            self._hold(lane, entries)
        await self._take_present(lane, present, deliveries)
        self._feed.wake()

    async def _take_present(
        self, lane: Lane, present: list[tuple[bytes, dict[bytes, bytes]]],
        deliveries: dict[bytes, int],
    ) -> None:
        if not present:
            return
        try:
            jobs, answers = await self._prepare(lane, present, deliveries)
        except Exception as exc:
            if len(present) > 1:
                for one in present:
                    await self._take_present(lane, [one], deliveries)
                return
            entry_id, fields = present[0]
            log.exception("entry %r could not be taken; dead-lettering it", entry_id)
            why = f"{type(exc).__name__}: {exc}"
            jobs, answers = [], tagged(lane, [
                self._untakable(lane, entry_id, fields, why, deliveries, self._clock.now_ms())
            ])
        self._feed.add(jobs)
        if answers:
            dead = sum(bool(a.dead_fields) for a in answers)
            self.stats.requests_failed += len(answers)
            self.stats.dead_lettered += dead
            self.metrics.dead_lettered(dead)
            await self._emit(answers)

    async def _prepare(
        self, lane: Lane, present: list[tuple[bytes, dict[bytes, bytes]]],
        deliveries: dict[bytes, int],
    ) -> tuple[list[Job[bytes]], list[Answer]]:
        """Jobs to buffer and answers owed for one read, with no effect on the buffer.

        It moves only the in-flight estimate (restored on the way out) and the
        running means (by finite, bounded amounts), so a read that raises here
        can be retried entry by entry. Decoding and dead letters see the bare
        entry ids; jobs and answers leave named by the lane's references.
        """
        now = self._clock.now_ms()
        decoded = decode_entries(
            present, policy=lane.dead_letters, deliveries=deliveries, now_epoch_ms=now
        )
        answers = tagged(lane, decoded.answers)
        if not decoded.requests:
            return [], answers
        claimed = sum(max(1, request.tokens) for _, request in decoded.requests)
        self._inflight_estimate += claimed
        try:
            with self._stages.running(
                TOKENIZING, f"a read of {len(decoded.requests)} requests being tokenized",
                self.settings.batch_timeout_s, "batch_timeout_s", shortened_by_stop=True,
            ):
                admitted = await asyncio.to_thread(
                    self._admit, lane, decoded.requests, monotonic_ms(), now
                )
        finally:
            self._inflight_estimate -= claimed
        answers += [answer_of(self.pipeline, outcome) for outcome in admitted.answered]
        fields = dict(present) if admitted.broken else {}
        answers += tagged(lane, [
            self._untakable(lane, entry_id, fields[entry_id], why, deliveries, now)
            for entry_id, why in ((split_ref(item.ref)[1], why) for item, why in admitted.broken)
        ])
        self._learn(decoded.requests, admitted.jobs)
        return admitted.jobs, answers

    def _untakable(
        self, lane: Lane, entry_id: bytes, fields: dict[bytes, bytes], why: str,
        deliveries: dict[bytes, int], now_epoch_ms: int,
    ) -> Answer:
        """The dead letter of an entry the worker could not take, saying why."""
        return dead_answer(
            entry_id, fields, ErrorCode.BAD_REQUEST,
            f"the worker could not take this entry: {why}"[:1000],
            policy=lane.dead_letters, deliveries=deliveries.get(entry_id, 1),
            now_epoch_ms=now_epoch_ms,
        )

    def _admit(
        self, lane: Lane, requests: list[tuple[bytes, wire.Request]], read_ms: float,
        now_epoch_ms: int,
    ) -> Admitted[bytes]:
        """The pipeline's admission of one read (in a thread: it tokenizes)."""
        items = [
            Admit(lane.ref(entry_id), request, wire.deadline_of(request, entry_id), read_ms)
            for entry_id, request in requests
        ]
        started = time.perf_counter()
        admitted = self.pipeline.admit(items, now_epoch_ms)
        self.metrics.tokenized(time.perf_counter() - started)
        return admitted

    def _learn(
        self, requests: list[tuple[bytes, wire.Request]], jobs: list[Job[bytes]]
    ) -> None:
        """Move the running mean of tokens per entry towards this read.

        Exact lengths, not the producers' ``tokens`` claims: a claim is only a
        hint, and a lying one must not make the next read huge. Each entry
        counts as one step of a 0.1 EMA. (Bytes need no mean: ``read_ahead.py``.)
        """
        weight = 1.0 - 0.9 ** len(requests)
        exact = sum(job.encoding.length for job in jobs) or len(requests)
        self._avg_estimate += weight * (max(1.0, exact / len(requests)) - self._avg_estimate)

    async def _emit(self, answers: list[Answer]) -> None:
        """Hand answers to their lanes' publish tasks (their entries count as held until
        published)."""
        self._unpublished_answers += len(answers)
        for lane, owed in by_lane(answers).items():
            self._outboxes[lane].put_nowait(owed)

    # ------------------------------------------------------------------------ run

    async def _run_loop(self) -> None:
        await self._feed.run(self._settle)
        for outbox in self._outboxes:
            outbox.put_nowait(None)

    def _execute(self, batch: Batch[Job[bytes]]) -> _Ran:
        """Run one batch through the pipeline and adapt the budget (in the device thread).

        Only this thread changes the packer's budget, and it picks the next
        batch itself, so the new budget holds from that pick on.
        """
        # What the pick used: only this thread picks and teaches the time model,
        # and it does so after the batch, so the cap has not moved since.
        packed_under = self.packer.budget_now()
        now = self._clock.now_ms()
        with self._stages.running(
            DEVICE, f"a batch of {len(batch.payloads)} requests on the device",
            self.settings.batch_timeout_s, "batch_timeout_s",
        ):
            outcome = self.pipeline.run_batch(batch.payloads, now)
        adapt_budget(self.adaptive, self.packer, outcome.ooms, "worker")
        return _Ran(outcome, packed_under, now)

    async def _settle(self, batch: Batch[Job[bytes]], ran: _Ran) -> None:
        """Account for and answer one batch the device thread ran (on the event loop)."""
        answers = [answer_of(self.pipeline, done) for done in ran.outcome.answered]
        record = _batch_record(self.consumer, batch, ran.packed_under, ran.outcome)
        self.stats.record(record)
        if self.metrics.enabled:
            self.metrics.batch(
                record, entry_ids(job.ref for job in batch.payloads),
                input_tokens=[done.tokens for done in ran.outcome.answered if done.tokens],
                started_epoch_ms=ran.started_epoch_ms, budget=self.packer.budget.max_batch_tokens,
            )
        self._batch_log.write(record)
        if answers:
            await self._emit(answers)

    # -------------------------------------------------------------------- publish

    async def _publish_loop(self, lane: Lane) -> None:
        """Publish one lane's answers as they come, in bulk: whatever queued up meanwhile
        goes in one call.

        One script call carries every answer waiting (up to ``_PUBLISH_CHUNK``),
        so when batches finish faster than Redis answers a round trip, the
        round trips do not add up. Once published (or given up on), the
        entries stop counting as held, which makes room to read more.
        """
        outbox = self._outboxes[lane.index]
        assert lane.publisher is not None
        last = False
        while not last:
            answers = await outbox.get()
            if answers is None:
                return
            while len(answers) < _PUBLISH_CHUNK and not outbox.empty():
                more = outbox.get_nowait()
                if more is None:
                    last = True
                    break
                answers = [*answers, *more]
            self._publishing += 1
            try:
                with self._stages.running(
                    PUBLISH, f"publishing {len(answers)} answers on {lane.stream}",
                    self._redis_deadline_s, REDIS_CALL_BOUND,
                ) as restart:
                    await lane.publisher.publish(
                        answers, give_up=functools.partial(self._retrying, restart))
            finally:
                self._publishing -= 1
                self._unpublished_answers -= len(answers)
                ref, release = lane.ref, self._held_bytes.pop  # bound once: per answer
                for answer in answers:
                    release(ref(answer.entry_id), None)
                self._space.set()
            self.metrics.answered(answers, now_epoch_ms=self._clock.now_ms())

    def _publish_refused(self, reason: str, error: str) -> None:
        """Redis refused a publish call (OOM, READONLY, ...): count it, and /readyz says why."""
        self.metrics.redis_refused(reason)
        self.health.publish_refused(f"{reason}: {error}"[:200])

    def _retrying(self, restart: Callable[[], None]) -> bool:
        """Asked by the publisher before each retry: give up (:meth:`_past_grace`)?

        The attempt that failed has ended, so the publish stage's clock starts
        again: its deadline bounds one attempt, since a publish retried while
        Redis is away is waiting for Redis, not hung.
        """
        restart()
        return self._past_grace()

    def _past_grace(self) -> bool:
        """A stopping (or hung) worker gives up on an unreachable Redis after a grace."""
        if self._hung:
            return True
        started = self._stop_started
        return started is not None and time.monotonic() - started > _STOP_GRACE_S

    # ------------------------------------------------------------------- watchdog

    async def _watchdog(self) -> None:
        """Raise :class:`WorkerHung` once a stage holding entries is past its deadline.

        The stages and their deadlines are :class:`~tokenq.worker.stages.Stages`'
        (a batch on the device, a read being tokenized, a Redis read, a publish
        attempt). From that moment the worker reads nothing and refreshes no
        claims (the beat loop checks ``_hung``), publishes what is already done
        within a grace period, and deletes its liveness key so that peers may
        claim its entries as soon as they have been idle three heartbeats,
        instead of waiting for the key to expire too. ``/livez`` fails from
        then on; each turn of this loop is also a tick of the event loop's liveness.
        """
        while True:
            await asyncio.sleep(watchdog_period_s(self.settings))
            now = time.monotonic()
            self.health.tick(now)
            late = self._stages.overdue(now, self._stop_started, _STOP_GRACE_S)
            if late is None:
                continue
            self._hung = True
            self.health.stage_hung(late.stage.name, late.reason)
            log.critical(
                "%s hung: %s (for %.0fs); stopping to read and to keep claims, so that "
                "other workers take this worker's requests, and exiting",
                late.stage.name, late.reason, now - late.stage.started,
            )
            self._feed.wake()
            self._space.set()
            grace = time.monotonic() + _STOP_GRACE_S
            while self._unpublished() and time.monotonic() < grace:
                await asyncio.sleep(0.05)
            with contextlib.suppress(RedisError, asyncio.TimeoutError):
                await asyncio.wait_for(self._drop_liveness(), 2.0)
            raise WorkerHung(f"{late.stage.name} hung: {late.reason}")

    def _unpublished(self) -> bool:
        """Whether any answer waits for, or is in, a publish call."""
        return bool(self._publishing) or any(not outbox.empty() for outbox in self._outboxes)

    async def _drop_liveness(self) -> None:
        for lane in self.lanes:
            await self.client.delete(keys.worker_alive(lane.queue, self.consumer))

    # ---------------------------------------------------------------------- beat

    def status(self) -> Heartbeat:
        """What the heartbeat publishes (``tokenq stats`` reads it)."""
        return Heartbeat(
            **self.stats.snapshot(),
            host=socket.gethostname(),
            pid=os.getpid(),
            model=self.backend.info.model,
            at=time.time(),
            max_batch_tokens=self.packer.budget.max_batch_tokens,
            configured_batch_tokens=self.plan.budget.max_batch_tokens,
            max_batch_size=self.plan.budget.max_batch_size,
            buffered=len(self.packer),
        )

    async def _beat_loop(self) -> None:
        ttl_ms = int(self.settings.heartbeat_s * 3000)
        while not (self._hung or self._closing.is_set()):
            self.health.beat_started(time.monotonic())
            try:
                await self._beat_lanes(self.status(), ttl_ms)
                await self._tend_retired()
                await self._clock.sync(self.client)
                self.health.beat_finished()
            except RedisError as exc:
                self.health.beat_finished(exc)
                log.warning("heartbeat failed: %s", exc)
            except Exception:
                # A heartbeat that stops lets other workers take this one's work;
                # whatever went wrong, log it and keep beating.
                self.health.beat_finished()
                log.exception("heartbeat failed unexpectedly")
            if self.metrics.enabled and self.health.redis_error is None:
                await self._measure_depth()  # not after a failed beat: Redis is away
            await wait_event(self._closing, self.settings.heartbeat_s)

    async def _measure_depth(self) -> None:
        """Refresh the queue-depth gauges; a failure (an ACL without XLEN) is logged once."""
        try:
            found = await depth.measure(self.client, [lane.stream for lane in self.lanes])
        except RedisError as exc:
            if not self._depth_failed:
                log.warning("queue depth metrics unavailable (%s); needs XLEN and "
                            "XINFO GROUPS on %s", exc, self._streams())
            self._depth_failed = True
            return
        self._depth_failed = False
        self.metrics.queue_depth(found.length, found.pending, found.lag)

    async def _beat_lanes(self, status: Heartbeat, ttl_ms: int) -> None:
        """Beat, and keep held entries' claims fresh, on every lane.

        With several lanes each goes at once and is bounded by the liveness
        TTL, so a shard whose node is down or frozen cannot let the worker's
        liveness lapse on the others (peers would take over its work there).
        Raises when no lane took the beat.
        """
        held = self._held_by_lane()
        if len(self.lanes) == 1:
            await self._beat_lane(self.lanes[0], status, ttl_ms, held.get(0, []))
            return
        results = await asyncio.gather(*(
            asyncio.wait_for(self._beat_lane(lane, status, ttl_ms, held.get(lane.index, [])),
                             ttl_ms / 1000)
            for lane in self.lanes
        ), return_exceptions=True)
        failed = [(lane, outcome) for lane, outcome in zip(self.lanes, results, strict=True)
                  if isinstance(outcome, BaseException)]
        for lane, exc in failed:
            if not isinstance(exc, (RedisError, asyncio.TimeoutError)):
                raise exc
            log.warning("heartbeat on %s failed: %s", lane.stream, exc or "no answer in time")
        if len(failed) == len(self.lanes):
            raise RedisError(f"no stream took the heartbeat: {failed[0][1] or 'no answer'}")

    async def _beat_lane(
        self, lane: Lane, status: Heartbeat, ttl_ms: int, held: list[bytes]
    ) -> None:
        await presence.beat(self.client, lane.queue, self.consumer, status, ttl_ms)
        await self._keep_claims_fresh(lane, held)

    def _held_by_lane(self) -> dict[int, list[bytes]]:
        """The entry ids the worker holds (read, not yet answered on Redis), by lane.

        Buffered, on the device, and answered but waiting to be published
        alike: each is pending to this worker until its answer is published.
        """
        held: dict[int, list[bytes]] = {}
        for ref in self._held_bytes:
            lane, entry_id = split_ref(ref)
            held.setdefault(lane, []).append(entry_id)
        return held

    async def _keep_claims_fresh(self, lane: Lane, held: list[bytes]) -> None:
        """Reset the idle time of entries this worker holds, so nobody claims them.

        Never while a batch is hung: a worker whose device does not come back
        must let its entries go (the watchdog ends it soon after).
        """
        for start in range(0, len(held), 512):
            if self._hung:
                return
            await self.client.xclaim(
                lane.stream, keys.GROUP, self.consumer, 0, held[start:start + 512], justid=True
            )


@dataclass(frozen=True, slots=True)
class _Ran:
    """What the device thread hands the event loop for one batch."""

    outcome: BatchOutcome[bytes]
    packed_under: Budget
    started_epoch_ms: int


def _batch_record(
    worker: str, batch: Batch[Job[bytes]], packed_under: Budget, outcome: BatchOutcome[bytes]
) -> BatchRecord:
    """The batch log's line (and the stats' and metrics' input) for one batch."""
    return BatchRecord(
        worker=worker,
        rows=batch.rows,
        tokens=batch.tokens,
        padded_tokens=batch.padded_tokens,
        cost=batch.cost,
        max_batch_tokens=packed_under.max_batch_tokens,
        max_batch_size=packed_under.max_batch_size,
        sealed=batch.sealed,
        device_ms=round(outcome.device_ms, 3),
        failed=sum(not done.ok for done in outcome.answered),
        oom_splits=outcome.oom_splits,
    )


def _entry_bytes(fields: dict[bytes, bytes]) -> int:
    """What an entry costs the worker to hold: the raw size of its fields."""
    return sum(map(len, fields)) + sum(map(len, fields.values()))


async def _first_failure(tasks: list[asyncio.Task[None]], watchdog: asyncio.Task[None]) -> None:
    """Wait until every task has finished, raising the first exception any of them raises."""
    pending: set[asyncio.Task[None]] = {*tasks, watchdog}
    while not all(task.done() for task in tasks):
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
