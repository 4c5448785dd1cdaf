"""The streams one worker reads (its lanes) and :class:`Ref`, an entry's lane and id."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from tokenq.shared import functions, keys, redis_refusal
from tokenq.shared.failures import error_text
from tokenq.shared.redis_text import as_text
from tokenq.worker.loop.tenants import FairShare

log = logging.getLogger("tokenq.worker")

if TYPE_CHECKING:
    from tokenq.worker.loop.publish import Publisher
    from tokenq.worker.loop.recovery import Reclaimer
    from tokenq.worker.pipeline.jobs import DeadLetterPolicy


class Ref(NamedTuple):
    """The worker's name for an entry it holds: its lane's index and its entry id (hashable)."""

    lane: int
    entry_id: bytes


@dataclass(slots=True)
class Lane:
    """One stream the worker reads, with what answers and reclaims on it."""

    index: int
    queue: keys.QueueRef
    dead_letters: DeadLetterPolicy
    reclaimer: Reclaimer
    publisher: Publisher
    last_reclaim: float = 0.0
    retired: bool = False
    """A shard beyond the queue's shard count, read until drained (:class:`Retirement`)."""
    drained: bool = False
    """Nothing reads it any more: a retired lane removed, or a tenant's lane closed
    (:meth:`LaneSet.close`), which beats and answers on until it is removed."""
    tenant: str = keys.DEFAULT_TENANT
    """Whose stream this is: the queue's own for the default tenant (:mod:`.tenants`)."""
    stream: str = field(init=False)

    def __post_init__(self) -> None:
        self.stream = keys.tenant_requests(self.queue, self.tenant)

    def refs(self, entry_ids: Iterable[bytes]) -> list[Ref]:
        """The worker's names for entries of this lane, a read's at once (made per request:
        ``tuple.__new__`` skips the NamedTuple's own ``__new__``, half the cost)."""
        index, new = self.index, _new_ref
        return [new(Ref, (index, entry_id)) for entry_id in entry_ids]


_new_ref = tuple.__new__


class LaneSet:
    """The worker's lanes, owned here: the worker adds, the beat removes drained retired ones,
    every other part asks (iterating a snapshot)."""

    def __init__(self) -> None:
        self._lanes: list[Lane] = []
        self._tenants: dict[int, str] = {}  # by lane index
        self._count = 0
        self.fair = FairShare()
        """Whose turn it is to read, among the tenants' lanes."""

    def add(
        self, queue: keys.QueueRef, dead_letters: DeadLetterPolicy, reclaimer: Reclaimer,
        publisher: Publisher, *, retired: bool = False, tenant: str = keys.DEFAULT_TENANT,
    ) -> Lane:
        """A lane for ``queue`` (``tenant``'s stream), numbered in the order added (its outbox's
        index)."""
        lane = Lane(self._count, queue, dead_letters, reclaimer, publisher, retired=retired,
                    tenant=tenant)
        self._count += 1
        self._lanes.append(lane)
        self._tenants[lane.index] = tenant
        return lane

    def tenant(self, ref: Ref) -> str:
        """Whose request ``ref`` is: its lane's tenant."""
        return self._tenants[ref.lane]

    def close(self, lane: Lane) -> None:
        """Stop reading ``lane`` (a tenant's, giving its turn up): it beats and answers on
        what it holds until :meth:`remove`."""
        lane.drained = True
        self.fair.arrived(lane.tenant, full=False, now=time.monotonic())  # holds nobody back

    def remove(self, lane: Lane) -> None:
        """A drained retired lane, or a closed one holding nothing: nothing reads, beats or
        answers on it any more."""
        lane.drained = True
        if lane in self._lanes:  # a closed retired lane: removed by the beat or as closed
            self._lanes.remove(lane)
        self._tenants.pop(lane.index, None)

    def __iter__(self) -> Iterator[Lane]:
        return iter(tuple(self._lanes))

    def __len__(self) -> int:
        return len(self._lanes)

    def streams(self) -> str:
        """The streams read, for log lines."""
        return ", ".join(lane.stream for lane in self._lanes)


Stream = tuple[keys.QueueRef, str]
"""A tenant's stream: its queue (or shard) and tenant."""


class Rotation:
    """Which tenant streams a worker reads, ``limit`` at most at once (a lane each: a blocking
    read holds a connection). Every stream while there is room; past it, streams with entries
    take turns: one waiting gets the first lane free, idle lanes give theirs up first, then
    those read longest (once read ``turn_s``), so none with entries goes unread for long."""

    def __init__(self, limit: int, turn_s: float) -> None:
        self.limit = limit
        self.turn_s = turn_s
        self._since: dict[Stream, float] = {}
        """A stream with entries and no lane -> since when it waits (first in, first read)."""

    def plan(self, reading: Mapping[Stream, float], closing: int, lengths: Mapping[Stream, int],
             now: float) -> tuple[list[Stream], list[Stream]]:
        """The streams to open lanes for and those whose lanes to close, given the streams
        read (-> when opened), how many closed lanes still hold entries, and every tenant
        stream's length (``lengths``: entries waiting or held)."""
        unread = [stream for stream in lengths if stream not in reading]
        self._since = {stream: self._since.get(stream, now) for stream in unread
                       if lengths[stream] > 0}
        waiting = sorted(self._since, key=lambda stream: (self._since[stream], _named(stream)))
        idle = sorted((stream for stream in unread if stream not in self._since), key=_named)
        free = max(0, self.limit - len(reading) - closing)
        short = len(waiting) - free - closing
        if short <= 0:
            return (waiting + idle)[:free], []
        by_turn = sorted(reading, key=lambda stream: (lengths.get(stream, 0) > 0, reading[stream]))
        return waiting[:free], [stream for stream in by_turn if not lengths.get(stream, 0)
                                or now - reading[stream] >= self.turn_s][:short]


def _named(stream: Stream) -> tuple[str, str]:
    return str(stream[0].shard), stream[1]


class Retirement:
    """The shards a queue served beyond its count today: found at a worker's join, drained,
    then removed (docs/OPERATIONS.md, "Changing K")."""

    def __init__(self, queue: keys.QueueRef, shards: int) -> None:
        self.queue = queue
        self.shards = shards
        self._found: set[keys.QueueRef] = set()
        self._unremovable: set[keys.QueueRef] = set()  # removal refused for good: warned

    async def join(self, client: aioredis.Redis) -> list[keys.QueueRef]:
        """Mark the retired shards and unmark this worker's own; the retired shards with a
        stream not returned before (a join is retried until Redis answers)."""
        recorded = await self._served(client)
        if recorded is None:
            return []
        served = max(self.shards, recorded)
        for shard in keys.shards_of(self.queue, self.shards) if self.shards > 1 else ():
            await client.delete(keys.retired(shard))  # served again (grown back): takes requests
        retired = keys.retired_shards(self.queue, self.shards, served)
        for shard in retired:  # the marker first: then what EXISTS sees is all there will be
            await client.set(keys.retired(shard), str(self.shards))
        existing = [shard for shard in retired if await client.exists(keys.requests(shard))]
        if existing:
            await client.set(keys.shards_served(self.queue), str(served))
        else:
            await client.delete(keys.shards_served(self.queue))
        new = [shard for shard in existing if shard not in self._found]
        self._found.update(new)
        return new

    async def tend(
        self, client: aioredis.Redis, lanes: Iterable[Lane], consumer: str
    ) -> list[Lane]:
        """Remove the retired lanes that are drained (or ``gone``); those nobody reads any more."""
        retired = [lane for lane in lanes if lane.retired]
        if not retired:
            return []
        script = functions.AsyncFunction(client, "remove_retired")  # remove_retired.lua, FCALL
        done = []
        for lane in retired:
            q = lane.queue
            try:
                state = await script(
                    keys=[keys.requests(q), keys.dead(q), keys.retired(q), keys.workers(q),
                          keys.config(q)],
                    args=[keys.GROUP],
                )
            except ResponseError as exc:
                if redis_refusal.refused_now(exc):
                    raise  # Redis refuses writes now (OOM ...): the beat reports it, tries again
                # Refused for good (wrong key type, ACL): warned once and read on, rather than
                # a failing beat turning /readyz red for ever.
                if q not in self._unremovable:
                    self._unremovable.add(q)
                    log.warning("cannot remove the drained retired shard %s (%s); it is still "
                                "read, and stays until an operator fixes its keys",
                                keys.requests(q), error_text(exc))
                continue
            if as_text(state) in ("removed", "gone"):  # nobody reads the lane any more
                await client.delete(keys.worker_alive(q, consumer))
                await client.hdel(keys.workers(q), consumer)
                done.append(lane)
        if len(done) == len(retired):
            served = await self._served(client) or 1
            left = [shard for shard in keys.retired_shards(self.queue, self.shards, served)
                    if await client.exists(keys.requests(shard))]
            if not left:
                await client.delete(keys.shards_served(self.queue))
        return done

    async def _served(self, client: aioredis.Redis) -> int | None:
        """The highest shard count on record: ``shards_served``, or the config hash's count."""
        try:
            recorded = await client.get(keys.shards_served(self.queue))
            published = await client.hget(keys.config(self.queue), "shards")
        except NoPermissionError as exc:
            log.warning("cannot read %s (%s): retired shards of %r are not drained by this "
                        "worker", keys.shards_served(self.queue), error_text(exc), self.queue.name)
            return None
        return max(_count(recorded), _count(published))


def _count(raw: object) -> int:
    """A recorded shard count; 1 for one missing or not a count (written by someone else)."""
    text = as_text(raw) if raw is not None else ""
    return min(int(text), keys.MAX_SHARDS) if text.isascii() and text.isdigit() else 1
