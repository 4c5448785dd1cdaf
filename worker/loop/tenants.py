"""Tenants: which tenant streams a worker reads (:func:`discover`), the operator's weights
(:func:`parse_weights`), and the weighted fair share of reads by tokens (:class:`FairShare`, pure).

Fairness is decided where work enters the worker: its read-ahead room is bounded, so over time
the tokens each tenant gets read are the tokens it gets processed, whatever order the packer
runs them in."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

import redis.asyncio as aioredis

from tokenq.shared import functions, keys
from tokenq.shared.redis_text import as_text

log = logging.getLogger("tokenq.worker")

MAX_TENANT_LANES = 256
"""Most tenant streams one worker reads at once (each is a lane: a read and a publish task);
past it they take turns (``lanes.Rotation``)."""
MAX_WEIGHT = 1_000_000.0
ACTIVE_S = 1.0
"""A tenant whose last read brought entries this recently shares the device (:meth:`sharing`)."""
ACTIVE_BATCHES = 4
"""... or this many full batches' time, on a device slower than that: a light tenant's next read
comes about one batch after its last."""
SWEEP_BEATS = 5
"""A worker looks for idle tenant streams to remove every this many heartbeats."""
SWEEP_BATCH = 128
"""Most streams one call of ``remove_idle_tenants.lua`` looks at (a short script)."""
STALE_S = 10.0
"""A tenant whose last full read is older than this holds no one back (its lane may be gone)."""


class FairShare:
    """Weighted fair reading over tokens: start-time fair queuing, deficit round robin without
    rounds. A tenant's tag is the tokens read for it over its weight; a tenant may read while its
    tag is under the lowest tag of the other backlogged tenants (their last read was full) plus
    one quantum, so what a read overshoots is paid back by waiting. A tenant back from idle starts
    at that lowest tag: no credit is saved up while idle, and its lone request is read at once."""

    def __init__(self, quantum: float = 1.0, *, stale_s: float = STALE_S) -> None:
        self.quantum = quantum
        self.stale_s = stale_s
        self.weights: dict[str, float] = {}
        self.default_weight = 1.0
        self._tag: dict[str, float] = {}
        self._backlogged: dict[str, float] = {}
        """Tenant -> when its last read was full (more is waiting)."""
        self._mean: dict[str, float] = {}
        """Tenant -> its tokens per entry (a running mean), which sizes its reads."""
        self._took: dict[str, float] = {}
        """Tenant -> when a read last brought it entries."""

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def _floor(self, now: float, other_than: str) -> float | None:
        """The lowest tag among the other tenants with a backlog; None: none has one."""
        tags = [self._tag.get(tenant, 0.0) for tenant, at in self._backlogged.items()
                if tenant != other_than and now - at <= self.stale_s]
        return min(tags) if tags else None

    def may_read(self, tenant: str, now: float) -> bool:
        """Whether ``tenant`` may read now (else another tenant's turn comes first)."""
        floor = self._floor(now, tenant)
        return floor is None or self._tag.get(tenant, 0.0) < floor + self.quantum

    def arrived(self, tenant: str, *, full: bool, now: float) -> None:
        """A read of ``tenant`` came back, ``full`` when it took all it asked for; its first
        (nothing learned of it, so it asked for one: :meth:`own_room`) shows no backlog."""
        if tenant not in self._backlogged:  # back from idle: from the others' lowest tag
            floor = self._floor(now, tenant)
            if floor is not None:
                self._tag[tenant] = max(self._tag.get(tenant, 0.0), floor)
        if full and tenant in self._mean:
            self._backlogged[tenant] = now
        else:
            self._backlogged.pop(tenant, None)

    def took(self, tenant: str, now: float) -> None:
        """A read of ``tenant`` brought entries."""
        self._took[tenant] = now

    def sharing(self, now: float, batch_s: float = 0.0) -> bool:
        """Whether a tenant without a backlog is active (its reads brought entries within
        :data:`ACTIVE_S`, or :data:`ACTIVE_BATCHES` full batches of ``batch_s``) beside another
        active one (or one with a backlog): its queries wait for the others' batches. Tenants
        all backlogged wait for their backlogs instead."""
        since = max(ACTIVE_S, ACTIVE_BATCHES * batch_s)
        active = {tenant for tenant, at in self._took.items() if now - at <= since}
        active.update(tenant for tenant, at in self._backlogged.items()
                      if now - at <= self.stale_s)
        return len(active) > 1 and any(tenant not in self._backlogged for tenant in active)

    def light(self, tenant: str) -> bool:
        """Whether ``tenant`` has no backlog (its last read was not full)."""
        return tenant not in self._backlogged

    def read_count(self, tenant: str, count: int) -> int:
        """``count`` cut to about one quantum of ``tenant``'s tokens, so a tenant of long entries
        does not read far past its turn on a mean learned from another's short ones."""
        mean = self._mean.get(tenant)
        return count if mean is None else min(count, max(1, int(self.quantum / mean)))

    def own_room(self, tenant: str, held: int) -> int:
        """Entries ``tenant`` may read whatever the shared read-ahead room, holding ``held``: up
        to one quantum of its tokens, so one tenant's backlog filling the room does not hold
        another's lone query back until a batch is taken; none for a tenant with a backlog,
        which competes for the shared room (reading past it would read past its share)."""
        if not self.light(tenant):
            return 0
        mean = self._mean.get(tenant)
        if mean is None:
            return 0 if held else 1
        return max(0, int(self.quantum / mean) - held)

    def known(self) -> set[str]:
        """The tenants it keeps state for."""
        return {*self._tag, *self._backlogged, *self._mean, *self._took}

    def retain(self, tenants: set[str]) -> None:
        """Forget every tenant not in ``tenants`` (those with a lane or a listed stream): a
        worker's state is bounded by the tenants active in the last idle window. One back
        starts level with the others, as from idle."""
        for state in (self._tag, self._backlogged, self._mean, self._took):
            for tenant in [tenant for tenant in state if tenant not in tenants]:
                del state[tenant]

    def charge(self, tenant: str, tokens: int, entries: int) -> None:
        """``entries`` holding ``tokens`` (exact, as tokenized) were read for ``tenant``."""
        self._tag[tenant] = self._tag.get(tenant, 0.0) + tokens / self.weight(tenant)
        if entries > 0:
            mean = self._mean.get(tenant)
            per_entry = max(1.0, tokens / entries)
            self._mean[tenant] = per_entry if mean is None else mean + 0.5 * (per_entry - mean)


def parse_weights(raw: Mapping[object, object]) -> tuple[dict[str, float], float | None, list[str]]:
    """The weights hash as {tenant: weight}, the weight of tenants not named (field ``*``; None:
    not set) and what was ignored, each a line naming the field and why."""
    weights: dict[str, float] = {}
    default = None
    ignored = []
    for field, value in raw.items():
        name, text = as_text(field), as_text(value)
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not 0 < weight <= MAX_WEIGHT:  # nan and inf fail too
            ignored.append(f"{name!r}: {text[:40]!r} is not a weight (0 < w <= {MAX_WEIGHT:g})")
        elif name == "*":
            default = weight
        else:
            weights[name] = weight
    return weights, default, ignored


# ------------------------------------------------ the tenant streams a worker may read

async def discover(
    client: aioredis.Redis, queues: Iterable[keys.QueueRef], weights_of: keys.QueueRef,
    fair: FairShare,
) -> tuple[dict[tuple[keys.QueueRef, str], int], str]:
    """Read the operator's weights into ``fair``, and every tenant stream registered on
    ``queues`` (stream names that are not a tenant's left out) with its length, in one
    pipeline: {(queue, tenant): entries}, and what the weights hash holds that was ignored
    ("": nothing)."""
    weights, default, ignored = parse_weights(await client.hgetall(keys.weights(weights_of)))
    fair.weights, fair.default_weight = weights, 1.0 if default is None else default
    found = [(queue, tenant) for queue in queues
             for stream in await client.smembers(keys.tenants(queue))
             if (tenant := keys.tenant_of(queue, stream)) is not None]
    async with client.pipeline(transaction=False) as pipe:
        for queue, tenant in found:
            pipe.xlen(keys.tenant_requests(queue, tenant))
        lengths = await pipe.execute(raise_on_error=False) if found else []
    counted = {pair: length if isinstance(length, int) else 0  # not a stream: nothing to read
               for pair, length in zip(found, lengths, strict=True)}
    return counted, "; ".join(ignored)


async def remove_idle(
    client: aioredis.Redis, queue: keys.QueueRef, tenants: Iterable[str], idle_ms: int,
) -> list[str]:
    """Remove ``tenants``' streams of ``queue`` that are empty, hold nothing unanswered and
    were written last ``idle_ms`` ago or more, with their place in the tenants set and their
    pending field (``remove_idle_tenants.lua``, :data:`SWEEP_BATCH` a call); the tenants
    removed."""
    script = functions.AsyncFunction(client, "remove_idle_tenants")
    names = [keys.tenant_requests(queue, tenant) for tenant in tenants]
    removed: list[str] = []
    for at in range(0, len(names), SWEEP_BATCH):
        gone = await script(keys=[keys.tenants(queue), *names[at:at + SWEEP_BATCH]],
                            args=[keys.GROUP, idle_ms])
        removed += [tenant for stream in gone or ()
                    if (tenant := keys.tenant_of(queue, stream)) is not None]
    return removed
