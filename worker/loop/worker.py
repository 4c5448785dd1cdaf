"""The worker's loop over one queue: read (a task per lane) -> device (the packer, bounded by the
read-ahead room, and the device thread) -> publish (a task per lane), with beat and watchdog beside
them; :class:`Worker` wires the parts. Nothing one entry contains can end the process."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from tokenq.shared import keys, redis_refusal, wire
from tokenq.shared.failures import error_text, failure_message
from tokenq.shared.heartbeat import Heartbeat
from tokenq.shared.packer import Budget, Packer
from tokenq.shared.queue_config import describe, encode_config
from tokenq.shared.redis_refusal import error_code
from tokenq.worker import host_memory
from tokenq.worker.backends.base import Backend, weights_identity_of
from tokenq.worker.batch_stats import exit_line
from tokenq.worker.health import Health
from tokenq.worker.logs import FIELDS
from tokenq.worker.loop import presence, tenants
from tokenq.worker.loop.beat import Beat
from tokenq.worker.loop.cache import ResultCache
from tokenq.worker.loop.device import Device
from tokenq.worker.loop.intake import Intake, auto_limit
from tokenq.worker.loop.lanes import Lane, LaneSet, Ref, Retirement, Rotation, Stream
from tokenq.worker.loop.lifecycle import STOP_GRACE_S, Lifecycle, Recorder, Wiring
from tokenq.worker.loop.outbox import Outbox
from tokenq.worker.loop.publish import Publisher, Target
from tokenq.worker.loop.reader import Reader, stream_entries
from tokenq.worker.loop.recovery import Reclaimer
from tokenq.worker.loop.stages import Overdue, StageClock, Stages
from tokenq.worker.loop.watchdog import LoopGuard, WorkerHung, watch, watchdog_period_s
from tokenq.worker.metrics import NullMetrics
from tokenq.worker.pipeline.digest import cache_scope, model_identity
from tokenq.worker.pipeline.feed import Aborted, ordinary, wait_event
from tokenq.worker.pipeline.jobs import DeadLetterPolicy
from tokenq.worker.pipeline.pipeline import Job, Pipeline, budget_for
from tokenq.worker.pipeline.tokenizing import pool_for
from tokenq.worker.redis_connect import check_server, connect
from tokenq.worker.settings import WorkerSettings

__all__ = ["Worker", "WorkerHung", "watchdog_period_s"]

log = logging.getLogger("tokenq.worker")

ADDED_COUNT = 64
"""Most entries of ``tenants:added`` one read takes (enqueue.lua keeps 64; one written by hand
may hold millions): one is enough to look for new tenants."""

def choose_budget(settings: WorkerSettings, backend: Backend) -> tuple[Budget, str]:
    """The budget and cost model, and why that budget; refuses what the model cannot honour."""
    if settings.max_batch_tokens == "auto":
        from tokenq.worker.backends.calibrate import calibrate_budget

        tokens, reason = calibrate_budget(backend, max_rows=settings.max_batch_size,
                                          share=settings.device_share)
        reason = f"auto: {reason}"
    else:
        tokens, reason = int(settings.max_batch_tokens), "set by --max-batch-tokens"
    return budget_for(backend.info, tokens, settings.max_batch_size, settings.cost_model,
                      reason), reason


class Worker:
    """One worker process's loop over one queue: wires the parts and runs their tasks."""

    def __init__(
        self, settings: WorkerSettings, backend: Backend, *, metrics: NullMetrics | None = None,
        health: Health | None = None, on_stuck: Callable[[Overdue], None] | None = None,
    ) -> None:
        """``on_stuck``: called by a :class:`~tokenq.worker.loop.watchdog.LoopGuard` thread
        when the event loop is stuck in an overdue stage; None in tests that run in-process."""
        self.settings = settings
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.health = health if health is not None else Health(
            settings.heartbeat_s, watchdog_period_s(settings))
        self.backend = backend
        # host-pid-random: unique per process, readable in XINFO CONSUMERS
        self.consumer = (settings.consumer
                         or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")
        self._retirement = Retirement(settings.queue_ref, settings.shards or 1)
        self.budget, self._budget_reason = choose_budget(settings, backend)
        self._tokenizer_pool = pool_for(backend, settings.tokenize_processes)
        period_s = watchdog_period_s(settings)
        stage_clock = StageClock(period_s)  # ticked by the guard: a stopped process's time left out
        self._lifecycle = lifecycle = Lifecycle(stage_clock)
        lifecycle.on_stop.append(self._stopped)
        self._recorder = Recorder(self.consumer, self.metrics, settings.batch_log)
        self.stats = self._recorder.stats
        self._wiring = Wiring(self.consumer, settings, lifecycle, Stages(stage_clock),
                              self._recorder, self.health)
        room = settings.read_ahead_bytes
        if room is None:  # not set: a share of the memory this worker may use
            room = auto_limit(host_memory.usable_bytes())
        self._intake = Intake(
            read_ahead_budgets=settings.read_ahead_budgets, read_ahead_bytes=room,
            max_entry_bytes=wire.max_entry_bytes(settings.max_request_bytes),
            max_input_tokens=backend.info.max_input_tokens,
        )
        self._outbox = Outbox(self._wiring, self._intake, self._room_made)
        self.packer: Packer[Job[Ref]] = Packer(
            self.budget, settings.linger_ms, max_padding_ratio=settings.max_padding_ratio,
            aging_ms=settings.aging_ms, max_batch_ms=settings.max_batch_ms,
        )
        pipeline: Pipeline[Ref] = Pipeline(backend, policy=settings.policy,
                                           chunk_overlap=settings.chunk_overlap,
                                           tokenizer=self._tokenizer_pool)
        pipeline.cache_scope = self._cache_scopes(settings, backend)
        cache = None if not settings.cache_bytes else ResultCache(
            self._wiring, settings.queue_ref, settings.cache_bytes,
            int(settings.cache_ttl_s * 1000))
        self._device = Device(self._wiring, pipeline, self.packer, self._intake, self._outbox,
                              cache)
        self.lanes = LaneSet()
        self.lanes.fair.quantum = self.budget.max_batch_tokens
        self._guard = None if on_stuck is None else LoopGuard(
            stages=self._wiring.stages, lifecycle=lifecycle, period_s=period_s,
            on_stuck=on_stuck, clock=stage_clock)
        self.health.loaded()  # the backend is built and the budget holds: the model is in

    def _cache_scopes(self, settings: WorkerSettings, backend: Backend) -> Callable[[Ref], bytes]:
        """Each request's digest scope: its tenant's on the queue, or the queue's with
        ``--cache-across-tenants``. The weights are hashed only for a cache (they outlive this
        process there); coalescing needs no more than the process's own model."""
        identity = model_identity(backend.info, weights_identity_of(backend)
                                  if settings.cache_bytes else "")
        scope = functools.cache(
            lambda namespace: cache_scope(namespace, identity, settings.policy))
        if settings.cache_across_tenants:
            return lambda ref: scope(settings.queue)
        return lambda ref: scope(f"{settings.queue}/{self.lanes.tenant(ref)}")

    def _add_lane(
        self, queue: keys.QueueRef, *, retired: bool = False, tenant: str = keys.DEFAULT_TENANT
    ) -> Lane:
        """A lane read into the packer, with its own outbox and what reclaims and publishes on
        it (replies stay in the lane's slot); a retired one (``lanes.Retirement``) is read
        until drained, then removed; ``tenant``'s stream of ``queue`` (:mod:`.tenants`)."""
        self._outbox.add_lane()
        settings, client = self.settings, self._wiring.client
        stream = keys.tenant_requests(queue, tenant)
        return self.lanes.add(
            queue, DeadLetterPolicy(
                worker=self.consumer, max_deliveries=settings.max_deliveries,
                default_reply_to=functools.partial(keys.reply, queue),
                max_request_bytes=settings.max_request_bytes,
                check_reply_to=keys.reply_to_check(queue, settings.reply_to_prefix_list),
                max_letter_bytes=settings.dead_max_letter_bytes, tenant=tenant,
            ),
            Reclaimer(client, queue, self.consumer, dead_after_ms=int(settings.heartbeat_s * 3000),
                      claim_idle_ms=int(settings.claim_idle_s * 1000), tenant=tenant),
            Publisher(client, Target(stream, keys.dead(queue), keys.GROUP, self.consumer),
                      reply_ttl_ms=int(settings.reply_ttl_s * 1000),
                      dead_max_len=settings.dead_max_len,
                      dead_max_letter_bytes=settings.dead_max_letter_bytes, hooks=self._wiring),
            retired=retired, tenant=tenant,
        )

    def stop(self) -> None:
        """Stop reading; finish and answer what was read; then return from run()."""
        self._lifecycle.stop()

    def _stopped(self) -> None:
        log.info("stopping: finishing %d buffered requests", len(self.packer))
        self.health.stopping = True
        self._device.wake()

    def _room_made(self) -> None:
        """Answers were published: the readers and the device may take more."""
        self._lifecycle.room_made.set()
        self._device.wake()

    async def run(self) -> None:
        """Serve the queue until stop() is called (or the idle timeout passes)."""
        self._wiring.client = connect(self.settings)
        reader = Reader(self._wiring, self.lanes, self._intake, self._device, self._outbox,
                        self._config_fields)
        for queue in keys.lanes_of(self.settings.queue_ref, self.settings.shards or 1):
            self._add_lane(queue)
        if self._tokenizer_pool is not None:
            await asyncio.to_thread(self._tokenizer_pool.start)
        if not await self._join(reader):  # stopped before Redis ever answered
            await self._close()
            return
        self._log_start()
        self.health.running(time.monotonic())
        beat = asyncio.create_task(
            Beat(self._wiring, self.lanes, self._intake, self._retirement, self.status).run(),
            name="tokenq-beat")
        reader.starting()
        tasks = [
            *(asyncio.create_task(reader.run(lane), name=f"tokenq-read-{lane.index}")
              for lane in self.lanes),
            asyncio.create_task(self._device.run(), name="tokenq-run"),
            *(asyncio.create_task(self._outbox.run(lane), name=f"tokenq-publish-{lane.index}")
              for lane in self.lanes),
        ]
        tasks.append(asyncio.create_task(self._tenant_lanes(reader, tasks), name="tokenq-tenants"))
        watchdog = asyncio.create_task(
            watch(self._wiring, self.lanes, self._device, self._outbox),
            name="tokenq-watchdog")
        if self._guard is not None:
            self._guard.start()
        try:
            await _first_failure(tasks, watchdog, beat)  # the beat watched, as the watchdog
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
            await self._close()
            fields = self.stats.exit_fields(self.consumer, time.time())
            log.info(exit_line(fields), extra={FIELDS: fields})

    async def _tenant_lanes(self, reader: Reader, tasks: list[asyncio.Task[None]]) -> None:
        """Each heartbeat, and as soon as a producer adds a tenant stream, while reading: the
        operator's weights, and the tenant streams read (:class:`lanes.Rotation`), a retired
        shard's until drained: a lane (read and publish tasks added to ``tasks``) opened for
        each given a turn, closed for each giving its turn up or no longer listed (removed as
        idle: :class:`_Sweep`), removed once it holds nothing; fair-share state kept only for
        tenants listed or read."""
        lifecycle, added, ignored = self._lifecycle, asyncio.Event(), ""
        rotation = Rotation(tenants.MAX_TENANT_LANES, self.settings.heartbeat_s)
        sweep = _Sweep(self.settings)
        opened: dict[Stream, tuple[Lane, float, asyncio.Task[None]]] = {}
        closing: list[tuple[Lane, asyncio.Task[None]]] = []
        tasks.extend(asyncio.create_task(self._tenants_added(lane.queue, added),
                                         name=f"tokenq-tenants-added-{lane.index}")
                     for lane in self.lanes if not lane.retired)
        while lifecycle.reading():
            added.clear()
            homes = {lane.queue: lane.retired for lane in self.lanes  # drained retired: gone
                     if lane.tenant == keys.DEFAULT_TENANT}
            try:
                found = await lifecycle.until_stopped(tenants.discover(
                    self._wiring.client, homes, self.settings.queue_ref, self.lanes.fair), 0)
                if found is None:  # stopped while Redis had not answered (frozen, slow)
                    break
                streams, now_ignored = found
                if now_ignored and now_ignored != ignored:  # once while the hash holds it
                    log.warning("ignored in %s: %s", keys.weights(self.settings.queue_ref),
                                now_ignored)
                ignored = now_ignored
                for stream in await sweep.run(self._wiring.client, streams, homes):
                    del streams[stream]
                closing = [(lane, task) for lane, task in closing if not self._removed(lane, task)]
                opened = {stream: held for stream, held in opened.items() if not held[0].drained}
                opening, giving_up = rotation.plan(
                    {stream: at for stream, (_, at, _) in opened.items()}, len(closing),
                    {stream: n for stream, n in streams.items() if n or not homes[stream[0]]},
                    time.monotonic())
                giving_up += [stream for stream in opened  # removed, or the set is gone
                              if stream not in streams and stream not in giving_up]
                for stream in giving_up:
                    lane, _, read = opened.pop(stream)
                    self.lanes.close(lane)
                    closing.append((lane, read))
                for queue, tenant in opening:
                    opened[queue, tenant] = await self._open_lane(reader, tasks, queue, tenant,
                                                                  retired=homes[queue])
                self.lanes.fair.retain({lane.tenant for lane in self.lanes}
                                       | {tenant for _, tenant in streams})
                if giving_up:  # their reads end within a block: look again then, not a beat on
                    await asyncio.wait([read for _, read in closing],
                                       timeout=self.settings.block_ms / 1000 + 1.0)
                    continue
            except RedisError as exc:
                log.warning("could not read the tenant streams or weights: %s", error_text(exc))
            await lifecycle.until_stopped(wait_event(added, self.settings.heartbeat_s), 0)

    async def _open_lane(
        self, reader: Reader, tasks: list[asyncio.Task[None]], queue: keys.QueueRef, tenant: str,
        *, retired: bool,
    ) -> tuple[Lane, float, asyncio.Task[None]]:
        """A lane for ``tenant``'s stream of ``queue``, read and published by tasks added to
        ``tasks``: the lane, when it opened, and its read task."""
        lane = self._add_lane(queue, tenant=tenant, retired=retired)
        with contextlib.suppress(RedisError):  # else its reader makes it on NOGROUP
            await reader.ensure_group(lane)
        reader.adding()
        read = asyncio.create_task(reader.run(lane), name=f"tokenq-read-{lane.index}")
        tasks += [read, asyncio.create_task(self._outbox.run(lane),
                                            name=f"tokenq-publish-{lane.index}")]
        return lane, time.monotonic(), read

    def _removed(self, lane: Lane, read: asyncio.Task[None]) -> bool:
        """Remove a closed lane once its read has ended and it holds nothing (True)."""
        if not read.done() or self._intake.held_count(lane.index):
            return False
        self.lanes.remove(lane)
        self._outbox.remove_lane(lane.index)
        self._intake.forget(lane.index)
        return True

    async def _tenants_added(self, home: keys.QueueRef, added: asyncio.Event) -> None:
        """Set ``added`` as each stream joins ``home``'s tenants set (enqueue.lua's entry on
        :func:`keys.tenants_added`), blocking as a read does; a Redis that refuses the read (an
        ACL without it) leaves finding tenants to the heartbeat."""
        key, last, lifecycle = keys.tenants_added(home), "0-0", self._lifecycle
        while lifecycle.reading():
            try:
                reply = await lifecycle.until_stopped(self._wiring.client.xread(
                    {key: last}, count=ADDED_COUNT, block=self.settings.block_ms), 0)
            except RedisError as exc:
                if error_code(exc) == "NOPERM":
                    log.warning("cannot read %s (%s): new tenant streams are found at the next "
                                "heartbeat", key, error_text(exc))
                    return
                await wait_event(lifecycle.stopping, 1.0)  # the lanes' reads say why
                continue
            entries = stream_entries(reply)
            if entries:
                last = entries[-1][0]
                added.set()

    async def _leave(self) -> None:
        for lane in self.lanes:
            await presence.leave(self._wiring.client, lane.queue, self.consumer)

    async def _close(self) -> None:
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.close()
        await self._wiring.client.aclose()

    async def _join(self, reader: Reader) -> bool:
        """Create the group and publish the config, waiting for Redis if it is not up yet."""
        delay = 0.5
        probe = connect(self.settings.model_copy(update={"retries": 0}))
        stopping = self._lifecycle.stopping
        try:
            while not stopping.is_set():
                try:
                    if await self._lifecycle.until_stopped(self._join_once(reader, probe), 0):
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

    async def _join_once(self, reader: Reader, probe: aioredis.Redis) -> bool:
        """One try at the join: a ping without retries, then the join's writes (True)."""
        await probe.ping()
        client = self._wiring.client
        for queue in await self._retirement.join(client):
            self._add_lane(queue, retired=True)
        for lane in self.lanes:
            await reader.ensure_group(lane)
        await check_server(client)
        await self._wiring.clock.sync(client)
        for lane in self.lanes:
            await presence.write_config(client, lane.queue, self._config_fields())
        return True

    def _config_fields(self) -> dict[str, str]:
        """The config hash's fields (strings, so redis-cli HGETALL reads them)."""
        return encode_config(describe(
            self.backend.info, policy=self.settings.policy,
            max_batch_tokens=self.budget.max_batch_tokens, shards=self.settings.shards or 1,
            tokenize_processes=self.settings.tokenize_processes, updated_at=int(time.time())))

    def _log_start(self) -> None:
        info = self.backend.info
        budget = self.budget
        log.info(
            "worker %s on %s: model=%s task=%s device=%s dtype=%s max_input=%d "
            "budget=%d tokens (%s; %s) rows<=%d linger=%.1fms policy=%s read_ahead=%d MiB%s",
            self.consumer, self.lanes.streams(), info.model, info.task, info.device, info.dtype,
            info.max_input_tokens, budget.max_batch_tokens, budget.cost_model.value,
            self._budget_reason, budget.max_batch_size, self.settings.linger_ms,
            self.settings.policy, self._intake.limit // (1024 * 1024),
            f" pooling={info.pooling}" if info.pooling else "",
        )

    def status(self) -> Heartbeat:
        """What the heartbeat publishes (``tokenq stats`` reads it)."""
        return Heartbeat(
            **self.stats.snapshot(), host=socket.gethostname(), pid=os.getpid(),
            model=self.backend.info.model, at=time.time(),
            max_batch_tokens=self.packer.budget.max_batch_tokens,
            configured_batch_tokens=self.budget.max_batch_tokens,
            max_batch_size=self.budget.max_batch_size, buffered=len(self.packer),
            tenants=self._recorder.tenants.snapshot(),
        )


class _Sweep:
    """Every few heartbeats (:data:`tenants.SWEEP_BEATS`), the removal of the tenant streams
    of a worker's own shards idle ``tenant_idle_s`` (``remove_idle_tenants.lua``); refused for
    good (an ACL from before it), warned once and not tried again."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.every_s = tenants.SWEEP_BEATS * settings.heartbeat_s
        self.idle_ms = int(settings.tenant_idle_s * 1000)
        self.last = time.monotonic()
        self.refused = False

    async def run(self, client: aioredis.Redis, streams: dict[Stream, int],
                  homes: dict[keys.QueueRef, bool]) -> list[Stream]:
        """The streams of ``streams`` (listed, with their lengths) removed, if it is time."""
        now = time.monotonic()
        if self.refused or now - self.last < self.every_s:
            return []
        self.last = now
        removed: list[Stream] = []
        for home, retired in homes.items():
            empty = [tenant for (queue, tenant), n in streams.items() if queue == home and not n]
            if retired or not empty:
                continue  # a retired shard's streams go with it (remove_retired.lua)
            try:
                gone = await tenants.remove_idle(client, home, empty, self.idle_ms)
            except ResponseError as exc:
                if redis_refusal.refused_now(exc):
                    raise  # memory or a replica: the next sweep tries again
                self.refused = True
                log.warning("cannot remove idle tenant streams of %s (%s): every tenant named "
                            "stays in Redis", keys.tenants(home), error_text(exc))
                return removed
            removed += [(home, tenant) for tenant in gone]
        return removed


async def _first_failure(tasks: list[asyncio.Task[None]], *watched: asyncio.Task[None]) -> None:
    """Wait until every task has finished, raising the first exception any of them, or of
    ``watched`` (which run on after them), raises; finished tasks leave ``tasks`` (it grows
    as tenants' lanes open)."""
    while tasks:
        running = {*tasks, *(task for task in watched if not task.done())}
        done, _ = await asyncio.wait(running, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            # Only run() cancels these: one that ended cancelled met a plugin's
            # CancelledError, and going on without it would hang its entries.
            if task.cancelled():
                raise Aborted(f"task {task.get_name()} stopped on CancelledError")
            if task.exception() is not None:
                raise ordinary(task.exception(), f"task {task.get_name()}")  # type: ignore[arg-type]
        tasks[:] = [task for task in tasks if not task.done()]
