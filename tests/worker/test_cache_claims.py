"""Claims on the result cache (docs/OPERATIONS.md, "Result cache"): identical requests in
flight are computed once across the fleet; a request another worker holds waits, parked,
for that answer, and is computed here when the claim lapses (its holder died), ends
unanswered or the request's own time runs short; a Redis that refuses the claim's write
leaves every request computed and answered."""

from __future__ import annotations

import asyncio
import logging
import time
import types

import pytest
import redis.asyncio as aioredis

from tests.redis_full import fill, full_fixture
from tests.support import FAST_BEAT, SIM_FLAGS, SimModel, starter_fixture, wait_for
from tokenq.producer import AsyncClient, Client
from tokenq.producer.ops.snapshot import heartbeats
from tokenq.shared import keys, wire
from tokenq.shared.errors import DeadlineExceeded
from tokenq.worker.loop.cache import HELD, ResultCache
from tokenq.worker.metrics import NullMetrics

start_worker = starter_fixture("start_worker", *SIM_FLAGS, "--cache-bytes", "200000")
full = full_fixture()
SIM = SimModel()
Q = keys.QueueRef("claims")
REPLY = wire.encode_embedding_reply("x", b"\0" * 16, 4, tokens=3)


def cache_of(client: aioredis.Redis, consumer: str, heartbeat_s: float = 2.0) -> ResultCache:
    wiring = types.SimpleNamespace(
        client=client, consumer=consumer, clock=types.SimpleNamespace(now_ms=lambda: 1_000_000),
        settings=types.SimpleNamespace(heartbeat_s=heartbeat_s),
        recorder=types.SimpleNamespace(metrics=NullMetrics()))
    return ResultCache(wiring, Q, 1_000_000, 60_000)  # type: ignore[arg-type]


def test_a_claim_holds_for_its_lease_and_ends_as_its_answer_is_written(redis_url, r) -> None:
    """Held against others, its own to its holder, taken over when asked; deleted with its
    answer; lapsed after three beats; one longer than a lease is no worker's."""
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        a, b = cache_of(client, "a", heartbeat_s=0.1), cache_of(client, "b", heartbeat_s=0.1)
        assert await a.claim([b"one", b"two"]) == [None, None]
        assert r.get(keys.cache_claim(Q, b"one")) == b"a"
        assert 0 < r.pttl(keys.cache_claim(Q, b"one")) <= 300  # 3 beats
        assert await b.claim([b"one"]) == [HELD]
        assert await a.claim([b"one"]) == [None]  # its own: computed (coalesced) here
        assert await b.claim([b"one", b"two"], take_over=1) == [None, HELD]
        assert await a.claim([b"one"]) == [HELD]
        await a._write([(b"one", REPLY), (b"two", None)])  # an answer; an unanswered end
        assert not r.exists(keys.cache_claim(Q, b"one"), keys.cache_claim(Q, b"two"))
        assert await b.claim([b"one", b"two"]) == [REPLY, None]
        assert r.hlen(keys.cache(Q)[0]) == 1  # "two" was not cached
        await asyncio.sleep(0.4)  # b's lease on "two" lapses: its holder is presumed dead
        assert await a.claim([b"two"]) == [None]
        r.set(keys.cache_claim(Q, b"forged"), "no worker")  # no lease: no worker wrote it
        r.set(keys.cache_claim(Q, b"longer"), "no worker", px=10_000)
        assert await a.claim([b"forged", b"longer"]) == [None, None]
        assert r.get(keys.cache_claim(Q, b"forged")) == b"a"
        await client.aclose()

    asyncio.run(main())


def test_a_reply_written_while_a_lookup_was_in_flight_answers_that_lookup(redis_url) -> None:
    """The lookup found this worker's own claim (compute) while its reply was computed and
    written: the reply answers it, never a second row; kept only while lookups are in flight."""
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        cache = cache_of(client, "a")
        assert await cache.claim([b"in flight"]) == [None]  # claimed: computed here
        lookup = cache._lookup
        release = asyncio.Event()

        async def slow_lookup(digests, take_over):
            found = await lookup(digests, take_over)  # its own claim: None
            await release.wait()
            return found

        cache._lookup = slow_lookup  # type: ignore[method-assign]
        in_flight = asyncio.create_task(cache.claim([b"in flight"]))
        await asyncio.sleep(0.05)
        cache.put([(b"in flight", REPLY)])
        await cache._task  # written, its claim ended, no longer in ``writing``
        assert not cache.writing
        release.set()
        assert await in_flight == [REPLY]
        assert cache._written == {}  # nothing kept once no lookup is in flight
        await client.aclose()

    asyncio.run(main())


def test_past_the_memory_share_nothing_is_claimed_and_at_oom_a_lookup_still_answers(
        full, caplog) -> None:
    url, sync = full

    async def main() -> None:
        client = aioredis.Redis.from_url(url)
        a = cache_of(client, "a")
        await a._write([(b"cached", REPLY)])
        used = int(sync.info("memory")["used_memory"])
        sync.config_set("maxmemory", int(used / 0.95))  # past 90 %, under maxmemory
        assert await a.claim([b"new"]) == [None]
        assert not sync.exists(keys.cache_claim(Q, b"new"))
        sync.config_set("maxmemory", "16mb")
        fill(sync)  # at maxmemory: the claim (a write) is refused, the lookup is not
        with caplog.at_level(logging.WARNING, "tokenq.worker"):
            for _ in range(2):
                assert await a.claim([b"cached", b"other"]) == [REPLY, None]
        assert caplog.text.count("result cache claim refused") == 1
        await client.aclose()

    asyncio.run(main())


def rows(*workers) -> int:
    return sum(batch["rows"] for worker in workers for batch in worker.batches())


def test_two_workers_compute_64_identical_requests_as_one_row(
        start_worker, redis_url, r, queue_name) -> None:
    """The first worker reads one entry at a time: the other reads most, and whichever does
    not hold the digest parks its requests until the holder's answer is cached."""
    one = start_worker("--sim-batch-ms", "200", "--read-ahead-bytes", "1", name="one")
    other = start_worker("--sim-batch-ms", "200", name="other")

    async def burst() -> list:
        async with AsyncClient(redis_url=redis_url, queue=queue_name) as client:
            return await asyncio.gather(*(client.infer("asked by 64", timeout_s=60)
                                          for _ in range(64)))

    results = asyncio.run(burst())
    assert all(SIM.vector_ok(result.embedding, "asked by 64") for result in results)
    assert rows(one, other) == 1
    q = keys.QueueRef(queue_name)

    def answered_without_a_row() -> int:
        beats = heartbeats(r, q)
        worker = one if rows(other) else other
        beat = beats.get(worker.name)
        return 0 if beat is None else beat.cache_hits + beat.coalesced

    wait_for(answered_without_a_row, 10, "the worker without the row to answer some")
    assert not r.keys(keys.cache_claim(q, b"") + "*")  # the claim ended


def parked_behind_a_slow_holder(start_worker, redis_url, r, queue_name, *flags):
    """A holder that reads one entry at a time and takes 6 s a batch has claimed "slow text";
    a second worker has read more of it, and parked them."""
    holder = start_worker("--sim-batch-ms", "6000", "--read-ahead-bytes", "1", *flags,
                          name="holder")
    client = Client(redis_url=redis_url, queue=queue_name)
    first = client.submit("slow text")
    wait_for(lambda: r.keys(keys.cache_claim(keys.QueueRef(queue_name), b"") + "*"), 10,
             "the holder's claim")
    parker = start_worker("--sim-batch-ms", "0", *flags, name="parker")
    return holder, parker, client, first


@pytest.mark.parametrize("killed", ["holder", "parker"])
def test_parked_requests_are_answered_when_either_worker_is_killed(
        killed, start_worker, redis_url, r, queue_name) -> None:
    """A live holder keeps its claim past a lease. Killed (-9) mid-batch, the parker computes
    once its lease lapses; the parker killed, the holder reclaims what it held and answers it
    from the cache."""
    holder, parker, client, first = parked_behind_a_slow_holder(
        start_worker, redis_url, r, queue_name, *FAST_BEAT)
    ids = [client.submit("slow text") for _ in range(4)]
    stream = keys.requests(keys.QueueRef(queue_name))
    wait_for(lambda: r.xpending(stream, keys.GROUP)["pending"] == 5, 10, "the parker's read")
    time.sleep(1.6)  # past a lease (3 beats of 0.5 s): the holder, alive, keeps its claim
    assert rows(parker) == 0  # parked: not computed while the holder's claim holds
    (claim,) = r.keys(keys.cache_claim(keys.QueueRef(queue_name), b"") + "*")
    assert r.get(claim) == b"holder"
    (holder if killed == "holder" else parker).kill()
    results = client.results([first, *ids], timeout_s=30)
    client.close()
    assert all(SIM.vector_ok(result.embedding, "slow text") for result in results)
    assert rows(holder, parker) in (1, 2)  # the reclaimed entry may run again, not more


def test_a_parked_request_short_of_time_is_computed_whoever_holds_it(
        start_worker, redis_url, r, queue_name) -> None:
    holder, parker, client, first = parked_behind_a_slow_holder(
        start_worker, redis_url, r, queue_name)
    started = time.monotonic()
    result = client.infer("slow text", timeout_s=3)  # computed here after 1.5 s
    assert SIM.vector_ok(result.embedding, "slow text")
    assert time.monotonic() - started < 3 and rows(parker) == 1
    assert SIM.vector_ok(client.result(first, timeout_s=30).embedding, "slow text")
    client.close()
    assert holder.process.poll() is None


def test_a_request_refused_as_it_is_read_ends_its_claim_with_the_refusal(
        start_worker, redis_url, r, queue_name) -> None:
    """A request whose deadline passed while it waited in the stream is refused at admission:
    its claim ends then, not a lease (three beats) later, so an identical request elsewhere is
    not parked behind a request that will never run."""
    start_worker("--sim-batch-ms", "1000", "--read-ahead-bytes", "1")
    claims = keys.cache_claim(keys.QueueRef(queue_name), b"") + "*"
    with Client(redis_url=redis_url, queue=queue_name) as client:
        ahead = client.submit("ahead of it")
        wait_for(lambda: r.keys(claims), 10, "the first request's claim")
        late = client.submit("late text", deadline_s=0.2)  # read after the 1 s batch
        with pytest.raises(DeadlineExceeded):
            client.result(late, timeout_s=10)
        wait_for(lambda: not r.keys(claims), 1.5, "every claim to end (the lease is 6 s)")
        assert SIM.vector_ok(client.result(ahead, timeout_s=10).embedding, "ahead of it")
