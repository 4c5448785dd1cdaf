"""Which entries a worker's scan takes over, on a real Redis: the rule of worker/loop/recovery.py.

Every pending entry is given an owner (this worker, a live peer, a dead
peer), an idle time (fresh, past a dead worker's three heartbeats, past the
safety net) and whether this worker holds it in memory; one scan must claim
exactly what docs/RELIABILITY.md ("Claiming the work of dead workers") says:

* never an entry the worker holds, whoever Redis says has it;
* a dead peer's entry once idle past the dead-worker limit;
* the worker's own entry that it does not hold (a lost read, a failover
  that took back its answer) once idle as long;
* anyone's entry idle past ``claim_idle``, the safety net.
"""

from __future__ import annotations

import asyncio
import uuid

import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenq.shared import keys
from tokenq.worker.loop.recovery import Reclaimer

ME, LIVE, DEAD = "me", "live-peer", "dead-peer"
DEAD_AFTER_MS = 5_000
CLAIM_IDLE_MS = 50_000
FRESH, PAST_DEAD, PAST_NET = 0, 20_000, 60_000

entries = st.lists(
    st.tuples(st.sampled_from([ME, LIVE, DEAD]), st.sampled_from([FRESH, PAST_DEAD, PAST_NET]),
              st.booleans()),
    min_size=1, max_size=12,
)


def expected(owner: str, idle_ms: int, held: bool) -> bool:
    """Whether one scan claims an entry: the rule, written out."""
    if held:
        return False
    if idle_ms >= CLAIM_IDLE_MS:
        return True
    return idle_ms >= DEAD_AFTER_MS and owner in (ME, DEAD)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=entries)
def test_a_scan_claims_exactly_what_the_rule_says(
    plan: list[tuple[str, int, bool]], r: redis.Redis, redis_url: str
) -> None:
    q = keys.QueueRef(f"rec{uuid.uuid4().hex[:10]}")
    stream = keys.requests(q)
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    ids = [r.xadd(stream, {"n": str(n)}) for n in range(len(plan))]
    r.xreadgroup(keys.GROUP, ME, {stream: ">"})
    for entry_id, (owner, idle_ms, _) in zip(ids, plan, strict=True):
        r.xclaim(stream, keys.GROUP, owner, 0, [entry_id], idle=idle_ms)
    for alive in (ME, LIVE):
        r.set(keys.worker_alive(q, alive), b"1", px=60_000)
    held = {entry_id for entry_id, (_, _, holds) in zip(ids, plan, strict=True) if holds}

    async def scan() -> set[bytes]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            reclaimer = Reclaimer(client, q, ME, dead_after_ms=DEAD_AFTER_MS,
                                  claim_idle_ms=CLAIM_IDLE_MS)
            claimed = await reclaimer.scan(100, held)
            return {entry_id for entry_id, _ in claimed.entries}
        finally:
            await client.aclose()

    try:
        want = {entry_id for entry_id, row in zip(ids, plan, strict=True) if expected(*row)}
        assert asyncio.run(scan()) == want
        for entry_id in want:  # claimed to this worker, with the delivery counted
            (pending,) = r.xpending_range(stream, keys.GROUP, entry_id, entry_id, 1)
            assert pending["consumer"] == ME.encode()
    finally:
        r.delete(stream, keys.workers(q), *(keys.worker_alive(q, n) for n in (ME, LIVE)))
