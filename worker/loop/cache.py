"""The queue's result cache on Redis: looked up before a read is tokenized, written after a
batch (``cache_put.lua``, which keeps it within its byte budget). A failed lookup is a miss
and a refused write loses only the entry: the request is answered either way."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Sequence

from redis.exceptions import RedisError

from tokenq.shared import functions, keys, redis_refusal, wire
from tokenq.shared.failures import error_text
from tokenq.worker.loop.lifecycle import Wiring

log = logging.getLogger("tokenq.worker")

ENTRY_OVERHEAD = 160
"""Bytes each entry is counted at besides its digest (twice: hash and index) and its value
(a quarter more: the allocator's rounding): the hash's and the sorted set's own structures,
as ``MEMORY USAGE`` measures them (the ``cache`` benchmark's ``budget`` row)."""
MEMORY_SHARE = 0.9
"""Past this share of Redis's maxmemory the cache adds nothing and gives back what Redis is
over by: the rest is the queue's (``cache_put.lua``)."""
MAX_WAITING = 8192
"""Entries waiting for the cache's one write in flight at most; more are not cached."""
_STAMP = struct.Struct(">Q")


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
        self._waiting: list[tuple[bytes, bytes]] = []
        self.writing: dict[bytes, bytes] = {}
        """Replies on their way to Redis, answered from here meanwhile."""
        self.counted_bytes = 0
        """The cache's bytes as the last write counted them."""
        self._warned = False

    async def get(self, digests: Sequence[bytes]) -> list[bytes | None]:
        """The cached reply of each digest, or None (missing, expired, or Redis failing)."""
        if self.writing and all(digest in self.writing for digest in digests):
            return [self.writing[digest] for digest in digests]
        try:
            values = await self._w.client.hmget(self._keys[0], list(digests))
        except RedisError as exc:
            log.warning("result cache lookup failed (%s): computing instead", error_text(exc))
            return [None] * len(digests)
        oldest = self._w.clock.now_ms() - self._ttl_ms
        return [self.writing.get(digest) if value is None or len(value) <= 8
                or _STAMP.unpack_from(value)[0] <= oldest else self._checked(value[8:])
                for digest, value in zip(digests, values, strict=True)]

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

    def put(self, entries: Sequence[tuple[bytes, bytes]]) -> None:
        """Cache each (digest, reply) in the background: one write in flight, which takes
        every entry that waited for it."""
        entries = entries[:MAX_WAITING - len(self._waiting)]
        if not entries:
            return
        self.writing.update(entries)
        self._waiting += entries
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="tokenq-cache-write")

    async def _drain(self) -> None:
        while self._waiting:
            entries, self._waiting = self._waiting, []
            await self._write(entries)

    async def _write(self, entries: Sequence[tuple[bytes, bytes]]) -> None:
        now = self._w.clock.now_ms()
        stamp = _STAMP.pack(now)
        args: list[bytes | int | float] = [*self._head, now, ENTRY_OVERHEAD, MEMORY_SHARE]
        for digest, reply in entries:
            args += [digest, stamp + reply]
        try:
            self.counted_bytes = int(await functions.AsyncFunction(self._w.client, "cache_put")(
                self._keys, args))
            self._w.recorder.metrics.cache_bytes(self.counted_bytes)
        except RedisError as exc:
            log.warning("result cache write refused (%s): the answers went out uncached",
                        error_text(exc))
            if redis_refusal.is_out_of_memory(exc):
                await self._trim(now)
        finally:
            for digest, _ in entries:
                self.writing.pop(digest, None)

    async def _trim(self, now: int) -> None:
        """Redis is at maxmemory: give back half the cache, so queue writes fit again."""
        try:
            self.counted_bytes = int(await functions.AsyncFunction(self._w.client, "cache_trim")(
                self._keys, [self.counted_bytes // 2, self._ttl_ms, now, ENTRY_OVERHEAD,
                             MEMORY_SHARE]))
        except RedisError as exc:
            log.warning("result cache trim failed (%s)", error_text(exc))

