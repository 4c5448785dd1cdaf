"""Taking over the entries of workers that died, of this one's own forgotten entries, and of any
entry idle past ``claim_idle_s`` (``XPENDING`` then a min-idle ``XCLAIM``: no lock)."""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from tokenq.shared import keys
from tokenq.shared.redis_text import as_text
from tokenq.worker.loop import presence

log = logging.getLogger("tokenq.worker")


@dataclass(slots=True)
class Claimed:
    """Entries taken over in one scan, with how often each has now been delivered."""

    entries: list[tuple[bytes, dict[bytes, bytes] | None]] = field(default_factory=list)
    deliveries: dict[bytes, int] = field(default_factory=dict)


@dataclass(slots=True)
class Reclaimer:
    """One worker's view of who else holds work, and the claiming of it."""

    client: aioredis.Redis
    queue: keys.QueueRef
    consumer: str
    dead_after_ms: int = field(kw_only=True)
    claim_idle_ms: int = field(kw_only=True)
    tenant: str = field(kw_only=True, default=keys.DEFAULT_TENANT)
    _cursor: str = field(init=False, default="-")
    _stream: str = field(init=False)

    def __post_init__(self) -> None:
        self._stream = keys.tenant_requests(self.queue, self.tenant)

    async def scan(self, limit: int, held: Container[bytes]) -> Claimed:
        """Claim at most ``limit`` entries: dead consumers', forgotten ones, then long-idle ones;
        none in ``held``. (A dead consumer may hold what it once claimed from us while we were
        presumed dead.)"""
        claimed = Claimed()
        for find, min_idle_ms in ((self._from_dead_consumers, self.dead_after_ms),
                                  (self._forgotten, self.dead_after_ms),
                                  (self._long_idle, self.claim_idle_ms)):
            room = limit - len(claimed.entries)
            if room <= 0:
                break
            await self._claim(await find(room, held), min_idle_ms, claimed)
        return claimed

    async def own_deliveries(self, entry_ids: list[bytes]) -> dict[bytes, int]:
        """How often each of this consumer's own pending entries has been delivered."""
        if not entry_ids:
            return {}
        pending = await self.client.xpending_range(
            self._stream, keys.GROUP, min=entry_ids[0], max=entry_ids[-1],
            count=len(entry_ids), consumername=self.consumer,
        )
        return _deliveries(pending)

    async def _from_dead_consumers(self, limit: int, held: Container[bytes]) -> dict[bytes, int]:
        candidates: dict[bytes, int] = {}
        consumers = await self.client.xinfo_consumers(self._stream, keys.GROUP)
        # Heartbeat rows of workers gone from the group (it was recreated, or one was removed
        # by hand) are dropped.
        rows = await self.client.hkeys(keys.workers(self.queue))
        members = {as_text(info["name"]) for info in consumers}
        for name in {as_text(row) for row in rows} - members - {self.consumer}:
            await presence.drop_consumer(self.client, self.queue, name)
        for info in consumers:
            name = as_text(info["name"])
            if name == self.consumer:
                continue
            if await self.client.exists(keys.worker_alive(self.queue, name)):
                continue
            if int(info["pending"]) == 0:
                if int(info["idle"]) >= self.dead_after_ms:
                    await presence.drop_consumer(self.client, self.queue, name)
                continue
            # Gone with entries pending: the script drops its stale heartbeat
            # row and keeps it in the group until its entries are claimed.
            await presence.drop_consumer(self.client, self.queue, name)
            pending = await self.client.xpending_range(
                self._stream, keys.GROUP, min="-", max="+",
                count=limit - len(candidates), consumername=name,
            )
            candidates.update(_deliveries(pending, held))
            if len(candidates) >= limit:
                break
        return candidates

    async def _forgotten(self, limit: int, held: Container[bytes]) -> dict[bytes, int]:
        """This consumer's entries idle as long as a dead consumer's that it does not hold."""
        pending = await self.client.xpending_range(
            self._stream, keys.GROUP, min="-", max="+", count=limit,
            idle=self.dead_after_ms, consumername=self.consumer,
        )
        forgotten = _deliveries(pending, held)
        if forgotten:
            log.warning("%d entries pending to this worker on %s were unknown to it (a lost "
                        "read, or a failover); taking them again", len(forgotten), self._stream)
        return forgotten

    async def _long_idle(self, limit: int, held: Container[bytes]) -> dict[bytes, int]:
        pending = await self.client.xpending_range(
            self._stream, keys.GROUP, min=self._cursor, max="+", count=limit,
            idle=self.claim_idle_ms,
        )
        if len(pending) < limit:
            self._cursor = "-"  # walked to the end; start over next scan
        else:
            self._cursor = "(" + as_text(pending[-1]["message_id"])
        return _deliveries(pending, held)

    async def _claim(self, delivered: dict[bytes, int], min_idle_ms: int, into: Claimed) -> None:
        if not delivered:
            return
        entries = await self.client.xclaim(
            self._stream, keys.GROUP, self.consumer, min_idle_ms, list(delivered))
        for entry_id, fields in entries:
            into.entries.append((entry_id, fields))
            into.deliveries[entry_id] = delivered.get(entry_id, 0) + 1
        if entries:
            log.warning("claimed %d entries from workers presumed dead", len(entries))


def _deliveries(pending: list[dict[str, Any]], held: Container[bytes] = ()) -> dict[bytes, int]:
    """How often each pending entry (of an XPENDING range) was delivered; none in ``held``."""
    return {p["message_id"]: int(p["times_delivered"]) for p in pending
            if p["message_id"] not in held}
