"""The worker process: the Redis I/O and scheduling around the request pipeline.

Per-request rules are the pipeline's (``worker/pipeline``), batching decisions
the packer's. Tasks joined by bounded hand-offs (TEI's shape): **read** (one per
stream: ``reader.py``), **run** (:class:`~tokenq.worker.pipeline.feed.DeviceFeed`,
the next batch the moment the device frees), **publish** (``outbox.py``), **beat**
(``beat.py``) and **watchdog** (``watchdog.py``; a stage past its deadline,
``worker/loop/stages.py``, exits 3). Each part owns its state (docs/ARCHITECTURE.md);
:class:`Worker` wires them and reports to :class:`~tokenq.worker.health.Health`.
Nothing one entry contains can end the process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tokenq.shared import keys, wire
from tokenq.shared.failures import error_text, failure_message
from tokenq.shared.heartbeat import Heartbeat
from tokenq.shared.packer import AdaptiveBudget, Batch, Budget, Packer
from tokenq.worker import host_memory
from tokenq.worker.backends.base import Backend
from tokenq.worker.batch_stats import exit_line
from tokenq.worker.health import Health
from tokenq.worker.logs import FIELDS
from tokenq.worker.loop import presence, read_ahead
from tokenq.worker.loop.beat import Beat, streams_of
from tokenq.worker.loop.clock import RedisClock
from tokenq.worker.loop.intake import Intake
from tokenq.worker.loop.lanes import Lane, Ref, Retirement
from tokenq.worker.loop.lifecycle import STOP_GRACE_S, Lifecycle
from tokenq.worker.loop.loop_guard import LoopGuard
from tokenq.worker.loop.outbox import Outbox
from tokenq.worker.loop.publish import Publisher
from tokenq.worker.loop.reader import Reader
from tokenq.worker.loop.recorder import Recorder
from tokenq.worker.loop.recovery import Reclaimer
from tokenq.worker.loop.stages import (
    DEVICE,
    REDIS_CALL_BOUND,
    Overdue,
    StageClock,
    Stages,
    redis_call_deadline_s,
)
from tokenq.worker.loop.watchdog import Watchdog, WorkerHung, watchdog_period_s
from tokenq.worker.metrics import NullMetrics
from tokenq.worker.pipeline.execute import adapt_budget
from tokenq.worker.pipeline.feed import Aborted, DeviceFeed, ordinary, wait_event
from tokenq.worker.pipeline.jobs import DeadLetterPolicy
from tokenq.worker.pipeline.pipeline import BatchOutcome, Job, Pipeline, budget_for
from tokenq.worker.pipeline.tokenizing import pool_for
from tokenq.worker.redis_connect import connect
from tokenq.worker.server_check import check_server
from tokenq.worker.settings import WorkerSettings

__all__ = ["Plan", "Worker", "WorkerHung", "default_consumer_name", "plan",
           "redis_call_deadline_s", "watchdog_period_s"]

log = logging.getLogger("tokenq.worker")

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

        tokens, reason = calibrate_budget(backend, max_rows=settings.max_batch_size,
                                          share=settings.device_share)
        reason = f"auto: {reason}"
    else:
        tokens, reason = int(settings.max_batch_tokens), "set by --max-batch-tokens"
    budget = budget_for(info, tokens, settings.max_batch_size, settings.cost_model, reason)
    return Plan(budget=budget, budget_reason=reason, policy=settings.policy)


class Worker:
    """One worker process's loop over one queue: wires the parts and runs their tasks."""

    def __init__(
        self,
        settings: WorkerSettings,
        backend: Backend,
        *,
        client: aioredis.Redis | None = None,
        metrics: NullMetrics | None = None,
        health: Health | None = None,
        on_stuck: Callable[[Overdue], None] | None = None,
    ) -> None:
        """``on_stuck``: called by a :class:`~tokenq.worker.loop.loop_guard.LoopGuard` thread when
        the event loop is stuck in an overdue stage; None in tests that run in-process.
        """
        self.settings = settings
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.health = health if health is not None else Health(
            settings.heartbeat_s, watchdog_period_s(settings)
        )
        self.backend = backend
        self.queue = settings.queue_ref
        self.consumer = settings.consumer or default_consumer_name()
        self._retirement = Retirement(self.queue, settings.shards or 1)
        self.plan = plan(settings, backend)
        self._tokenizer_pool = pool_for(backend, settings.tokenize_processes)
        self.pipeline: Pipeline[Ref] = Pipeline(
            backend, policy=settings.policy, chunk_overlap=settings.chunk_overlap,
            tokenizer=self._tokenizer_pool,
        )
        self.packer: Packer[Job[Ref]] = Packer(
            self.plan.budget, settings.linger_ms, max_padding_ratio=settings.max_padding_ratio,
            aging_ms=settings.aging_ms, max_batch_ms=settings.max_batch_ms,
        )
        self.adaptive = AdaptiveBudget(
            self.plan.budget.max_batch_tokens, backend.info.max_input_tokens
        )
        period_s = watchdog_period_s(settings)
        stage_clock = StageClock(period_s)  # ticked by the guard: a stopped process's time left out
        self._lifecycle = Lifecycle(stage_clock)
        self._feed: DeviceFeed[Job[Ref], _Ran] = DeviceFeed(
            self.packer, self._execute,
            flushing=lambda: self._lifecycle.stopping.is_set(),
            finished=lambda: self._readers_done() and not self.packer,
            on_take=lambda: self._lifecycle.room_made.set(),
            may_take=lambda: self._intake.answers_fit(),
            name="tokenq-device",
        )
        self._client = client
        self._own_client = client is None
        self._recorder = Recorder(self.consumer, self.metrics, settings.batch_log)
        self.stats = self._recorder.stats
        self._stages = Stages(stage_clock)
        """The stages holding entries now, each with its deadline (the watchdog reads it)."""
        self._call_deadline = (redis_call_deadline_s(settings), REDIS_CALL_BOUND)
        self._clock = RedisClock()
        room = settings.read_ahead_bytes
        if room is None:  # not set: a share of the memory this worker may use
            room = read_ahead.auto_limit(host_memory.usable_bytes())
        self._intake = Intake(
            read_ahead_budgets=settings.read_ahead_budgets,
            read_ahead_bytes=room,
            max_entry_bytes=wire.max_entry_bytes(settings.max_request_bytes),
            max_input_tokens=backend.info.max_input_tokens,
        )
        self._outbox = Outbox(
            intake=self._intake, lifecycle=self._lifecycle, stages=self._stages,
            recorder=self._recorder, now_epoch_ms=self._clock.now_ms,
            call_deadline=self._call_deadline, room_made=self._room_made,
        )
        self.lanes: list[Lane] = []
        for queue in keys.lanes_of(self.queue, settings.shards or 1):
            self._add_lane(queue)
        self._reader: Reader | None = None
        """Built with the client, when the worker runs."""
        self._reply_ttl_ms = int(settings.reply_ttl_s * 1000)
        self._guard = None if on_stuck is None else LoopGuard(
            stages=self._stages, lifecycle=self._lifecycle,
            period_s=period_s, on_stuck=on_stuck, clock=stage_clock,
        )
        self.health.loaded()  # the backend is built and the plan holds: the model is in

    def _add_lane(self, queue: keys.QueueRef, *, retired: bool = False) -> Lane:
        """A lane read into the packer, with its own outbox (its index: its number)."""
        lane = Lane(len(self.lanes), queue, self._dead_letter_policy(queue), retired=retired)
        self.lanes.append(lane)
        self._outbox.add_lane()
        return lane

    def _dead_letter_policy(self, queue: keys.QueueRef) -> DeadLetterPolicy:
        """A lane's rules for dead letters and reply keys: replies stay in the lane's slot."""
        settings = self.settings
        return DeadLetterPolicy(
            worker=self.consumer,
            max_deliveries=settings.max_deliveries,
            default_reply_to=functools.partial(keys.reply, queue),
            max_request_bytes=settings.max_request_bytes,
            check_reply_to=keys.reply_to_check(queue, settings.reply_to_prefix_list),
            max_letter_bytes=settings.dead_max_letter_bytes,
        )

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            self._client = connect(self.settings)
        return self._client

    def stop(self) -> None:
        """Stop reading; finish and answer what was read; then return from run()."""
        if self._lifecycle.stop():
            log.info("stopping: finishing %d buffered requests", len(self.packer))
        self.health.stopping = True
        self._feed.wake()

    def _room_made(self) -> None:
        """Answers were published: the readers and the device may take more."""
        self._lifecycle.room_made.set()
        self._feed.wake()

    def _readers_done(self) -> bool:
        return self._reader is not None and self._reader.done

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Serve the queue until stop() is called (or the idle timeout passes)."""
        reader = self._reader = self._wire_reader()
        for lane in self.lanes:
            self._equip(lane)
        if self._tokenizer_pool is not None:
            await asyncio.to_thread(self._tokenizer_pool.start)
        if not await self._join(reader):  # stopped before Redis ever answered
            self._close_tokenizer_pool()
            if self._own_client and self._client is not None:
                await self._client.aclose()
            return
        self._log_start()
        self.health.running(time.monotonic())
        beat = asyncio.create_task(self._wire_beat().run(), name="tokenq-beat")
        reader.starting()
        tasks = [
            *(asyncio.create_task(reader.run(lane), name=f"tokenq-read-{lane.index}")
              for lane in self.lanes),
            asyncio.create_task(self._run_loop(), name="tokenq-run"),
            *(asyncio.create_task(self._outbox.run(lane), name=f"tokenq-publish-{lane.index}")
              for lane in self.lanes),
        ]
        watchdog = asyncio.create_task(self._wire_watchdog().run(), name="tokenq-watchdog")
        if self._guard is not None:
            self._guard.start()
        try:
            await _first_failure(tasks, watchdog)
        finally:
            if self._guard is not None:
                self._guard.stop()
            # redis-py can swallow a cancel that lands inside a command, so
            # the loops also watch closing, and the wait for them is bounded.
            self._lifecycle.closing.set()
            self.health.closed()  # no more ticks: the probes stop expecting them
            for task in (*tasks, watchdog, beat):
                task.cancel()
            await asyncio.wait({beat, watchdog, *tasks}, timeout=STOP_GRACE_S)
            try:
                await asyncio.wait_for(self._leave(), STOP_GRACE_S)
            except (RedisError, asyncio.TimeoutError) as exc:
                log.warning("could not deregister: %s", error_text(exc))
            self._recorder.close()
            self._close_tokenizer_pool()
            if self._own_client and self._client is not None:
                await self._client.aclose()
            fields = self._recorder.exit_fields(time.time())
            log.info(exit_line(fields), extra={FIELDS: fields})

    def _wire_reader(self) -> Reader:
        return Reader(
            self.client, consumer=self.consumer, settings=self.settings, lanes=self.lanes,
            intake=self._intake, lifecycle=self._lifecycle, stages=self._stages,
            feed=self._feed, pipeline=self.pipeline, outbox=self._outbox,
            recorder=self._recorder, health=self.health, now_epoch_ms=self._clock.now_ms,
            config_fields=self._config_fields, on_idle=self.stop,
            call_deadline=self._call_deadline,
        )

    def _wire_beat(self) -> Beat:
        return Beat(
            self.client, consumer=self.consumer, heartbeat_s=self.settings.heartbeat_s,
            lanes=self.lanes, intake=self._intake, lifecycle=self._lifecycle,
            health=self.health, recorder=self._recorder, clock=self._clock,
            retirement=self._retirement, status=self.status,
        )

    def _wire_watchdog(self) -> Watchdog:
        def wake() -> None:
            self._feed.wake()
            self._lifecycle.room_made.set()

        return Watchdog(
            period_s=watchdog_period_s(self.settings), stages=self._stages,
            lifecycle=self._lifecycle, health=self.health, wake=wake,
            unpublished=self._outbox.unpublished, drop_liveness=self._drop_liveness,
        )

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

    def _add_retired(self, queues: list[keys.QueueRef]) -> None:
        """Read retired shards too (``lanes.Retirement``): extra lanes into the same packer,
        each answered and dead-lettered on its own, until it is drained and removed."""
        for queue in queues:
            self._equip(self._add_lane(queue, retired=True))

    def _publish_refused(self, reason: str, error: str) -> None:
        """Redis refused a publish call (OOM, READONLY, ...): count it, and /readyz says why."""
        self._recorder.redis_refused(reason)
        self.health.publish_refused(f"{reason}: {error}"[:200])

    async def _leave(self) -> None:
        for lane in self.lanes:
            await presence.leave(self.client, lane.queue, self.consumer)

    async def _drop_liveness(self) -> None:
        for lane in self.lanes:
            await self.client.delete(keys.worker_alive(lane.queue, self.consumer))

    def _close_tokenizer_pool(self) -> None:
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.close()

    async def _join(self, reader: Reader) -> bool:
        """Create the group and publish the config, waiting for Redis if it is not up yet.

        Retries with backoff until Redis answers or a stop (False); each try pings first
        without redis-py's retries, so an absent Redis is named within a second.
        """
        delay = 0.5
        probe = connect(self.settings.model_copy(update={"retries": 0}))
        stopping = self._lifecycle.stopping
        try:
            while not stopping.is_set():
                try:
                    if await self._lifecycle.unless_stopping(self._join_once(reader, probe)):
                        self.health.redis_answered()
                        return True
                except RedisError as exc:
                    self.health.redis_answered(exc)
                    if stopping.is_set():
                        break
                    why = failure_message(exc, self.settings.redis_url,
                                          self.settings.socket_timeout_s) or error_text(exc)
                    log.warning("%s; retrying in %.1fs (a worker waits for Redis)",
                                why.rstrip("."), delay)
                    await wait_event(stopping, delay)
                    delay = min(delay * 2, 5.0)
            return False
        finally:
            await probe.aclose()

    async def _join_once(self, reader: Reader, probe: aioredis.Redis) -> None:
        """One try at the join: a ping without retries, then the join's writes."""
        await probe.ping()
        self._add_retired(await self._retirement.join(self.client))
        for lane in self.lanes:
            await reader.ensure_group(lane)
        await check_server(self.client)
        await self._clock.sync(self.client)
        for lane in self.lanes:
            await presence.write_config(self.client, lane.queue, self._config_fields())

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
            "budget=%d tokens (%s; %s) rows<=%d linger=%.1fms policy=%s read_ahead=%d MiB%s",
            self.consumer, streams_of(self.lanes), info.model, info.task,
            info.device, info.dtype,
            info.max_input_tokens, budget.max_batch_tokens, budget.cost_model.value,
            self.plan.budget_reason, budget.max_batch_size, self.settings.linger_ms,
            self.plan.policy, self._intake.bytes.limit // (1024 * 1024),
            f" pooling={info.pooling}" if info.pooling else "",
        )

    # ------------------------------------------------------------------------ run

    async def _run_loop(self) -> None:
        await self._feed.run(self._settle)
        self._outbox.close()

    def _execute(self, batch: Batch[Job[Ref]]) -> _Ran:
        """Run one batch and adapt the budget (device thread: the only one that changes it)."""
        # Only this thread picks and teaches the time model, after the batch, so the cap
        # the pick used has not moved.
        packed_under = self.packer.budget_now()
        now = self._clock.now_ms()
        with self._stages.running(
            DEVICE, f"a batch of {len(batch.payloads)} requests on the device",
            self.settings.batch_timeout_s, "batch_timeout_s",
        ):
            outcome = self.pipeline.run_batch(batch.payloads, now)
        adapt_budget(self.adaptive, self.packer, outcome.ooms, "worker")
        return _Ran(outcome, packed_under, now)

    async def _settle(self, batch: Batch[Job[Ref]], ran: _Ran) -> None:
        """Account for and answer one batch the device thread ran (on the event loop)."""
        self._recorder.batch(
            batch, ran.outcome, packed_under=ran.packed_under,
            started_epoch_ms=ran.started_epoch_ms,
            budget_now=self.packer.budget.max_batch_tokens,
        )
        self._outbox.emit_outcomes(self.pipeline, ran.outcome.answered)

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


@dataclass(frozen=True, slots=True)
class _Ran:
    """What the device thread hands the event loop for one batch."""

    outcome: BatchOutcome[Ref]
    packed_under: Budget
    started_epoch_ms: int


async def _first_failure(tasks: list[asyncio.Task[None]], watchdog: asyncio.Task[None]) -> None:
    """Wait until every task has finished, raising the first exception any of them raises."""
    pending: set[asyncio.Task[None]] = {*tasks, watchdog}
    while not all(task.done() for task in tasks):
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            # Only run() cancels these: one that ended cancelled met a plugin's
            # CancelledError, and going on without it would hang its entries.
            if task.cancelled():
                raise Aborted(f"task {task.get_name()} stopped on CancelledError")
            if task.exception() is not None:
                raise ordinary(task.exception(), f"task {task.get_name()}")  # type: ignore[arg-type]
