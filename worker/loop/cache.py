"""The queue's result cache on Redis: claimed before a read is tokenized (``cache_claim.lua``:
each digest's cached answer, or a claim so the fleet computes it once), written after a batch
(``cache_put.lua``, which keeps it within its byte budget and ends the claims). A failed lookup
is a miss and a refused write loses only the entry: the request is answered either way."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError, ResponseError

from tokenq.shared import functions, keys, redis_refusal, wire
from tokenq.shared.failures import error_text
from tokenq.worker.loop.lanes import Lane
from tokenq.worker.loop.lifecycle import Wiring
from tokenq.worker.pipeline.jobs import Answer

log = logging.getLogger("tokenq.worker")

ENTRY_OVERHEAD = 160
"""Bytes each entry is counted at besides its digest (twice: hash and index) and its value
(a quarter more: the allocator's rounding): the hash's and the sorted set's own structures,
as ``MEMORY USAGE`` measures them (the ``cache`` benchmark's ``budget`` row)."""
MEMORY_SHARE = 0.9
"""Past this share of Redis's maxmemory the cache adds nothing and gives back what Redis is
over by: the rest is the queue's (``cache_put.lua``); nor is anything claimed."""
MAX_WAITING = 8192
"""Entries waiting for the cache's one write in flight at most; more are not cached."""
HELD = b""
"""A lookup's verdict on a digest another worker holds: wait for its answer (:class:`Parking`)."""
RECHECK_S = 0.02
"""How often the parked requests' digests are looked up again (one call for all of them)."""
_STAMP = struct.Struct(">Q")


def cached_answer(entry_id: bytes, request: wire.Request, reply: bytes) -> Answer:
    """The answer to ``request`` from another request's ``reply``: the same, under its own id."""
    return Answer(entry_id, request.reply_to, wire.reply_with_id(reply, request.id), ok=True,
                  counted=request.counted)


class ResultCache:
    """Reads and writes one queue's cache (the plain ``{q}``: one slot for every shard)."""

    def __init__(self, wiring: Wiring, queue: keys.QueueRef, budget_bytes: int,
                 ttl_ms: int) -> None:
        self._w = wiring
        self._keys = list(keys.cache(queue))
        self._head = [budget_bytes, ttl_ms]
        self.budget_bytes = budget_bytes
        self._ttl_ms = ttl_ms
        self._task: asyncio.Task[None] | None = None
        self._keeping: asyncio.Task[None] | None = None
        self._waiting: list[tuple[bytes, bytes | None]] = []
        self.writing: dict[bytes, bytes] = {}
        """Replies on their way to Redis, answered from here meanwhile."""
        self._looking = 0
        self._written: dict[bytes, bytes] = {}
        """Replies written while a lookup was in flight, kept until none is: that lookup may
        have found this worker's own claim, not yet the reply."""
        self.counted_bytes = 0
        """The cache's bytes as the last write counted them."""
        self._queue = queue
        self._lease_ms = int(wiring.settings.heartbeat_s * 3000)
        """How long a claim holds: a worker silent that long is presumed dead."""
        self._claims = True
        """False once Redis refused a claim to this user (NOPERM): plain lookups from then."""
        self._warned = self._refused = False
        self._failing: set[str] = set()
        """What fails now ("lookup", "write"): warned at the first failure, not each one."""

    async def claim(self, digests: Sequence[bytes], take_over: int = 0) -> list[bytes | None]:
        """Per digest: its cached reply; None: computed here (claimed for this worker, or Redis
        failing); :data:`HELD`: another worker computes it. The first ``take_over`` are claimed
        whoever holds them."""
        if self.writing and all(digest in self.writing for digest in digests):
            return [self.writing[digest] for digest in digests]
        asked = list(dict.fromkeys(digests))  # identical requests in one read: asked once
        self._looking += 1
        try:
            values = await self._lookup(asked, take_over)
            written, writing = self._written, self.writing
        except RedisError as exc:
            self._failed("lookup", "failed", "computing instead", exc)
            return [None] * len(digests)
        finally:
            self._looking -= 1
            if not self._looking and self._written:
                self._written = {}
        self._went_through("lookup")
        oldest = self._w.clock.now_ms() - self._ttl_ms
        found = {digest: writing.get(digest) or written.get(digest)
                 or (value if value == HELD else None)
                 if value is None or len(value) <= 8 or _STAMP.unpack_from(value)[0] <= oldest
                 else self._checked(value[8:])
                 for digest, value in zip(asked, values, strict=True)}
        return [found[digest] for digest in digests]

    async def _lookup(self, digests: Sequence[bytes], take_over: int) -> list[bytes | None]:
        """The cache's values, by ``cache_claim.lua``; by HMGET (nothing claimed, nothing
        held) where Redis refuses the claim, a write (OOM, READONLY, NOPERM), logged once."""
        if self._claims:
            try:
                return await functions.AsyncFunction(self._w.client, "cache_claim")(
                    [self._keys[0], *(keys.cache_claim(self._queue, d) for d in digests)],
                    [self._w.consumer, self._w.clock.now_ms(), self._ttl_ms, self._lease_ms,
                     MEMORY_SHARE, take_over, *digests])
            except ResponseError as exc:
                self._claims = redis_refusal.error_code(exc) != "NOPERM"
                if not self._refused:
                    self._refused = True
                    log.warning("result cache claim refused (%s): computing instead; "
                                "identical requests on other workers may be computed again",
                                error_text(exc))
        return [value or None for value in await self._w.client.hmget(self._keys[0], digests)]

    def _checked(self, reply: bytes) -> bytes | None:
        """A cached reply, if it is one a worker would send (an answer, not an error); else
        None, a miss: an entry not written by a worker is computed over, never answered."""
        try:
            if wire.decode_reply(reply).ok:
                return reply
        except ValueError:  # DecodeError, or a field no reply carries
            pass
        if not self._warned:
            self._warned = True
            log.warning("result cache entry in %s is not a reply (written by someone other "
                        "than a worker?): computing instead", self._keys[0])
        return None

    def keep_claims(self, leading: Callable[[], list[bytes]]) -> None:
        """Claim ``leading()`` (what this worker computes now) again each beat while it has
        any: a claim lapses only when its holder is silent as long as a dead worker is."""
        if self._keeping is None or self._keeping.done():
            self._keeping = asyncio.create_task(self._keep(leading), name="tokenq-cache-claims")

    async def _keep(self, leading: Callable[[], list[bytes]]) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 3000)
            digests = leading()
            if not digests:
                return
            await self.claim(digests)

    def put(self, entries: Sequence[tuple[bytes, bytes | None]]) -> None:
        """Cache each (digest, reply) in the background, ending its claim (a reply of None:
        only that): one write in flight, which takes every entry that waited for it."""
        entries = entries[:MAX_WAITING - len(self._waiting)]
        if not entries:
            return
        self.writing.update((digest, reply) for digest, reply in entries if reply)
        self._waiting += entries
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="tokenq-cache-write")

    async def _drain(self) -> None:
        while self._waiting:
            entries, self._waiting = self._waiting, []
            await self._write(entries)

    async def _write(self, entries: Sequence[tuple[bytes, bytes | None]]) -> None:
        now = self._w.clock.now_ms()
        stamp = _STAMP.pack(now)
        args: list[bytes | int | float] = [*self._head, now, ENTRY_OVERHEAD, MEMORY_SHARE]
        for digest, reply in entries:
            args += [digest, stamp + reply if reply else b""]
        claims = [keys.cache_claim(self._queue, digest) for digest, _ in entries]
        try:
            self.counted_bytes = int(await functions.AsyncFunction(self._w.client, "cache_put")(
                [*self._keys, *claims], args))
            self._w.recorder.metrics.cache_bytes(self.counted_bytes)
            self._went_through("write")
        except RedisError as exc:
            self._failed("write", "refused", "the answers went out uncached", exc)
            if redis_refusal.is_out_of_memory(exc):
                await self._trim(now)
        finally:
            for digest, _ in entries:
                reply = self.writing.pop(digest, None)
                if reply is not None and self._looking:
                    self._written[digest] = reply

    def _failed(self, what: str, how: str, meaning: str, exc: RedisError) -> None:
        """A lookup or write failed: a warning at the first of a run, debug after (one a read
        or a batch would flood the log), as publish logs its refusals."""
        log.log(logging.DEBUG if what in self._failing else logging.WARNING,
                "result cache %s %s (%s): %s, until one goes through", what, how,
                error_text(exc), meaning)
        self._failing.add(what)

    def _went_through(self, what: str) -> None:
        if what in self._failing:
            self._failing.discard(what)
            log.info("result cache %ss go through again", what)

    async def _trim(self, now: int) -> None:
        """Redis is at maxmemory: give back half the cache, so queue writes fit again."""
        try:
            self.counted_bytes = int(await functions.AsyncFunction(self._w.client, "cache_trim")(
                self._keys, [self.counted_bytes // 2, self._ttl_ms, now, ENTRY_OVERHEAD,
                             MEMORY_SHARE]))
        except RedisError as exc:
            log.warning("result cache trim failed (%s)", error_text(exc))


Entry = tuple[bytes, dict[bytes, bytes]]
Take = Callable[[Lane, list[Entry], dict[bytes, int]], Awaitable[None]]
"""How a read's entries are taken (decoded, looked up, tokenized, buffered): the reader's."""


@dataclass(slots=True)
class _Parked:
    lane: Lane
    entry: Entry
    request: wire.Request
    deliveries: int | None
    until_ms: float
    """When it is computed here whoever holds its digest (epoch ms): half its time left."""


class Parking:
    """Each read's lookup (:meth:`look_up`), and the requests it finds another worker holds
    the digest of: held (in this worker's pending list), not tokenized, until that answer is
    cached (answered from it), the claim ends unanswered or lapses (its holder died), or half
    their time left is gone (computed here)."""

    def __init__(self, wiring: Wiring, cache: ResultCache,
                 emit: Callable[[int, list[Answer]], None], take: Take) -> None:
        self._w = wiring
        self._cache = cache
        self._emit = emit
        self._take = take
        self._parked: dict[bytes, list[_Parked]] = {}
        self._task: asyncio.Task[None] | None = None

    async def look_up(
        self, lane: Lane, requests: list[tuple[bytes, wire.Request]],
        digests: list[bytes | None], present: list[Entry], deliveries: dict[bytes, int],
    ) -> tuple[list[tuple[bytes, wire.Request]], list[bytes | None]]:
        """Answer one read's requests the cache holds and park those another worker holds,
        before tokenizing; the rest, to compute here, with their digests (``None``: not
        shared)."""
        asked = [digest for digest in digests if digest is not None]
        if not asked:
            return requests, digests
        found = dict(zip(asked, await self._cache.claim(asked), strict=True))
        rest, rest_digests, hits, parked, fields = [], [], [], 0, dict(present)
        for (entry_id, request), digest in zip(requests, digests, strict=True):
            reply = None if digest is None else found[digest]
            if reply is None:
                rest.append((entry_id, request))
                rest_digests.append(digest)
            elif reply == HELD and digest:
                parked += 1
                self._park(lane, (entry_id, fields[entry_id]), request, digest,
                           deliveries.get(entry_id))
            else:
                hits.append(cached_answer(entry_id, request, reply))
        self._w.recorder.shared("hit", len(hits))
        self._w.recorder.shared("miss", len(asked) - len(hits) - parked)
        if hits:
            self._emit(lane.index, hits)
        return rest, rest_digests

    def _park(self, lane: Lane, entry: Entry, request: wire.Request, digest: bytes,
              deliveries: int | None) -> None:
        now = self._w.clock.now_ms()
        deadline = wire.deadline_of(request, entry[0])
        until = float("inf") if deadline is None else now + (deadline - now) / 2
        self._parked.setdefault(digest, []).append(
            _Parked(lane, entry, request, deliveries, until))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._recheck(), name="tokenq-parked")

    async def _recheck(self) -> None:
        """Look every parked digest up again, in one call, until none is parked or the worker
        stops reading (what is parked then stays pending, for a peer or a restart)."""
        lifecycle = self._w.lifecycle
        while self._parked and lifecycle.reading():
            await asyncio.sleep(RECHECK_S)
            now = self._w.clock.now_ms()
            late = {digest for digest, parked in self._parked.items()
                    if min(p.until_ms for p in parked) <= now}
            digests = [*late, *(d for d in self._parked if d not in late)]
            computed: list[_Parked] = []
            for digest, verdict in zip(digests, await self._cache.claim(digests, len(late)),
                                       strict=True):
                if verdict == HELD:
                    continue
                parked = self._parked.pop(digest)
                if verdict is None:  # claimed for this worker now: taken again, computed
                    computed += parked
                    continue
                for p in parked:
                    self._emit(p.lane.index, [cached_answer(p.entry[0], p.request, verdict)])
                self._w.recorder.shared("coalesced", len(parked))
            for lane in {p.lane.index: p.lane for p in computed}.values():
                mine = [p for p in computed if p.lane is lane]
                await self._take(lane, [p.entry for p in mine], {
                    p.entry[0]: p.deliveries for p in mine if p.deliveries is not None})
