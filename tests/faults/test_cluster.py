"""A sharded queue on a real Redis Cluster, and failover on a Cluster and under Sentinel.

The local cluster is 3 masters and 3 replicas on loopback
(``tests/redis_cluster.py``). What is tested is what an operator is
promised (docs/RELIABILITY.md, "Replicas and failover"):

* a queue of 3 shards spreads over the 3 masters, and 3 workers answer
  20,000 requests through it, each exactly once;
* when a master dies, its replica is promoted (by the Cluster, or by
  Sentinel) and producers and workers carry on by themselves;
* requests the dead master acknowledged but never replicated are lost
  without ``durable_replicas``, and exactly those: the test cuts the
  replication link first so the count is known, not left to timing; with
  ``durable_replicas=1`` such requests raise ``NotReplicated`` instead, so
  no request the producer was told is accepted is ever lost.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import redis

from tests.redis_cluster import (  # noqa: F401
    LocalCluster,
    LocalSentinel,
    redis_cluster,
    redis_sentinel,
)
from tests.support import FAST_BEAT, SimModel, fleet_fixture, wait_for, wait_lane_ready
from tests.workers import Fleet, WorkerProcess
from tokenq.producer import (
    AsyncClient,
    BrokerUnavailable,
    Client,
    NotReplicated,
    ReplyTimeout,
    Result,
)
from tokenq.shared import keys
from tokenq.shared.settings import ClientSettings

DIM = 16
MAX_INPUT = 512
MODEL = SimModel(DIM, MAX_INPUT)
fleet = fleet_fixture(*MODEL.flags(*FAST_BEAT))


def spread_queue(cluster: LocalCluster, shards: int = 3) -> str:
    """A queue name whose shards' slots sit on ``shards`` different masters."""
    for attempt in range(500):
        name = f"c{attempt}x{time.monotonic_ns() % 10_000}"
        lanes = keys.shards_of(keys.QueueRef(name), shards)
        owners = {cluster.master_for_key(keys.requests(lane)) for lane in lanes}
        if len(owners) == shards:
            return name
    raise AssertionError("no queue name spreads over the masters")


def start_workers(fleet: Fleet, url: str, queue: str, count: int, shards: int,
                  check: redis.Redis, *flags: str) -> list[WorkerProcess]:
    workers = [fleet.start("--redis-url", url, "--queue", queue, "--shards", str(shards), *flags)
               for _ in range(count)]
    for worker in workers:
        wait_lane_ready(worker, check, queue, shards, timeout=60)
    return workers


def vector_ok(result: Result, text: str) -> bool:
    return MODEL.vector_ok(result.embedding, text)


def whole_again(cluster: LocalCluster, killed: int) -> None:
    """Bring back a node a test killed and wait for the cluster to be whole, for the next test."""
    if killed not in cluster.live_ports():
        cluster.restart(killed)
    cluster.wait_ok(timeout_s=60)


@pytest.mark.slow
def test_three_shards_three_workers_twenty_thousand_requests_exactly_once(
    redis_cluster: LocalCluster, fleet: Fleet,  # noqa: F811
) -> None:
    cluster = redis_cluster
    queue = spread_queue(cluster)
    admin = cluster.client()
    workers = start_workers(fleet, cluster.url, queue, count=3, shards=3, check=admin)
    texts = {}
    ids: list[str] = []
    lock = threading.Lock()

    def produce(offset: int) -> None:
        with Client(cluster.url, queue, timeout_s=120) as client:
            for call in range(50):
                batch = [f"p{offset} c{call} r{row} " + "w " * (row % 40) for row in range(100)]
                written = client.submit_many(batch)
                with lock:
                    texts.update(zip(written, batch, strict=True))
                    ids.extend(written)

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ids) == 20_000
    with Client(cluster.url, queue, timeout_s=180) as client:
        results = [r for start in range(0, len(ids), 1000)
                   for r in client.results(ids[start:start + 1000])]
    assert all(vector_ok(result, texts[rid]) for rid, result in zip(ids, results, strict=True))

    per_shard = Counter(keys.shard_in_id(rid) for rid in ids)
    assert set(per_shard) == {0, 1, 2}
    # Each client's 50 calls of 100 split 17/17/16 over the shards, in some order.
    assert all(6_400 <= n <= 6_800 for n in per_shard.values()), per_shard
    time.sleep(1.0)  # a second answer would land meanwhile, on a key results() deleted
    left = [k for lane in keys.lanes_of(keys.QueueRef(queue), 3)
            for k in admin.scan_iter(match=keys.reply_pattern(lane), target_nodes="primaries")]
    assert left == [], f"{len(left)} requests were answered twice"
    rows = [batch["rows"] for worker in workers for batch in worker.batches()]
    assert sum(rows) == 20_000, "each request ran exactly once"
    assert all(worker.batches() for worker in workers), "every worker took part"
    for lane in keys.lanes_of(keys.QueueRef(queue), 3):
        assert admin.xlen(keys.requests(lane)) == 0
    admin.close()


def cut_replication(master: redis.Redis) -> None:
    """Drop the master's replica links; the (frozen) replica cannot come back for the rest."""
    master.client_kill_filter(_type="replica")


def submit_each(client: Client, texts: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Submit one by one: (accepted id -> text, refused-as-not-replicated id -> text)."""
    accepted, unreplicated = {}, {}
    for text in texts:
        try:
            accepted[client.submit(text)] = text
        except NotReplicated as exc:
            unreplicated.update(dict.fromkeys(exc.request_ids, text))
    return accepted, unreplicated


def answered(client: Client, wanted: dict[str, str], timeout_s: float) -> dict[str, bool]:
    """Per id: answered (with the right vector) or not by the timeout."""
    outcome = client.results(list(wanted), timeout_s, return_exceptions=True)
    return {rid: not isinstance(res, ReplyTimeout) and vector_ok(res, wanted[rid])
            for rid, res in zip(wanted, outcome, strict=True)}


@pytest.mark.slow
@pytest.mark.fault
def test_cluster_failover_loses_only_unreplicated_requests_and_never_durable_ones(
    redis_cluster: LocalCluster, fleet: Fleet,  # noqa: F811
) -> None:
    cluster = redis_cluster
    queue = spread_queue(cluster)
    admin = cluster.client()
    start_workers(fleet, cluster.url, queue, count=2, shards=3, check=admin)
    shard0 = keys.requests(keys.shards_of(keys.QueueRef(queue), 3)[0])
    doomed = cluster.master_for_key(shard0)
    (replica,) = cluster.replicas_of(doomed)
    plain = Client(settings=ClientSettings(redis_url=cluster.url, queue=queue, timeout_s=10))
    durable = Client(settings=ClientSettings(
        redis_url=cluster.url, queue=queue, timeout_s=10,
        durable_replicas=1, durable_timeout_ms=300,
    ))
    try:
        before, _ = submit_each(plain, [f"before {i}" for i in range(12)])
        assert all(answered(plain, before, 20).values())

        # Cut shard 0's replication, write, and kill its master: what it alone held is gone.
        for worker in fleet.started:
            worker.process.send_signal(19)  # SIGSTOP: nothing is answered meanwhile
        cluster.freeze(replica)
        cut_replication(redis.Redis(port=doomed))
        lossy, _ = submit_each(plain, [f"plain {i}" for i in range(30)])
        kept, told = submit_each(durable, [f"durable {i}" for i in range(30)])
        cluster.kill(doomed)
        cluster.thaw(replica)
        assert cluster.wait_promoted(doomed, timeout_s=30) == replica
        for worker in fleet.started:
            worker.process.send_signal(18)  # SIGCONT

        on_dead_shard = {rid for rid in lossy if keys.shard_in_id(rid) == 0}
        assert len(on_dead_shard) == 10 and len(lossy) == 30
        survivors = {rid: text for rid, text in lossy.items() if rid not in on_dead_shard}
        assert all(answered(plain, survivors, 30).values()), fleet.logs()

        assert len(told) == 10 and all(keys.shard_in_id(rid) == 0 for rid in told)
        assert len(kept) == 20
        assert all(answered(durable, kept, 30).values()), "no durable acceptance is lost"

        # Producers and workers carry on by themselves through the new master.
        after, _ = submit_each(plain, [f"after {i}" for i in range(12)])
        assert all(answered(plain, after, 30).values())
        # Every stream is read in order, so a request the promoted replica had would have
        # been answered before the ones above: a short look finds that shard 0's are lost.
        # (Only theirs: an answer is taken once, and the survivors' were taken above.)
        dead = {rid: lossy[rid] for rid in on_dead_shard}
        assert not any(answered(plain, dead, 2).values()), fleet.logs()
    finally:
        plain.close()
        durable.close()
        for worker in fleet.started:
            worker.process.send_signal(18)
        cluster.thaw(replica)
        whole_again(cluster, doomed)
        admin.close()


def replica_pending(port: int, stream: str) -> int:
    """What a Cluster replica's copy of ``stream`` has pending (READONLY on one connection)."""
    with redis.Redis(port=port, socket_timeout=2, single_connection_client=True) as replica:
        replica.execute_command("READONLY")
        return int(replica.xpending(stream, keys.GROUP)["pending"])


@pytest.mark.slow
@pytest.mark.fault
def test_answers_the_promoted_replica_never_got_are_given_again(
    redis_cluster: LocalCluster, fleet: Fleet,  # noqa: F811
) -> None:
    """A failover can take back a worker's answers: the promoted replica had the read but
    not the publish, so its entries are pending to a worker that is alive, holds nothing
    and would never look at them again (nobody claims from a live worker, and the safety
    net is an hour away here). The worker takes back what it forgot and answers again, so
    every durable request is answered; without that each would wait for the safety net."""
    cluster = redis_cluster
    queue = spread_queue(cluster)
    admin = cluster.client()
    # One batch of all the requests, slow enough to cut replication while it runs.
    (worker,) = start_workers(fleet, cluster.url, queue, 1, 3, admin, "--sim-batch-ms", "1500",
                              "--linger-ms", "50", "--claim-idle-s", "3600")
    lanes = keys.shards_of(keys.QueueRef(queue), 3)
    streams = [keys.requests(lane) for lane in lanes]
    doomed = cluster.master_for_key(streams[0])
    (replica,) = cluster.replicas_of(doomed)
    durable = Client(settings=ClientSettings(
        redis_url=cluster.url, queue=queue, timeout_s=10,
        durable_replicas=1, durable_timeout_ms=2000,
    ))
    try:
        worker.process.send_signal(19)  # so that one read takes every request
        accepted, told = submit_each(durable, [f"answered twice {i}" for i in range(30)])
        assert len(accepted) == 30 and not told
        worker.process.send_signal(18)
        wait_for(lambda: sum(admin.xpending(s, keys.GROUP)["pending"] for s in streams) == 30,
                 10, worker.output())
        wait_for(lambda: replica_pending(replica, streams[0]) == 10, 10,
                 "the replica never had the worker's read")
        # The answer reaches the master alone: then the master dies.
        cluster.freeze(replica)
        cut_replication(redis.Redis(port=doomed))
        wait_for(lambda: admin.xpending(streams[0], keys.GROUP)["pending"] == 0, 10,
                 worker.output())
        cluster.kill(doomed)
        cluster.thaw(replica)
        assert cluster.wait_promoted(doomed, timeout_s=30) == replica
        assert replica_pending(replica, streams[0]) == 10, "the new master lacks the answers"

        got = answered(durable, accepted, 30)
        assert all(got.values()), (sum(got.values()), worker.output())
        assert "unknown to it" in worker.output()
        assert worker.process.poll() is None, "the worker carried on by itself"
    finally:
        durable.close()
        worker.process.send_signal(18)
        cluster.thaw(replica)
        whole_again(cluster, doomed)
        admin.close()


@pytest.mark.slow
@pytest.mark.fault
def test_sentinel_failover_loses_only_unreplicated_requests_and_never_durable_ones(
    redis_sentinel: LocalSentinel, fleet: Fleet,  # noqa: F811
) -> None:
    group = redis_sentinel
    queue = "sentineled"
    master = group.current_master()
    (replica,) = group.replica_ports
    check = redis.Redis(port=master)
    start_workers(fleet, group.url, queue, count=1, shards=1, check=check)
    plain = Client(settings=ClientSettings(redis_url=group.url, queue=queue, timeout_s=10))
    durable = Client(settings=ClientSettings(
        redis_url=group.url, queue=queue, timeout_s=10,
        durable_replicas=1, durable_timeout_ms=300,
    ))
    try:
        before, _ = submit_each(plain, [f"before {i}" for i in range(5)])
        assert all(answered(plain, before, 20).values())
        for worker in fleet.started:
            worker.process.send_signal(19)
        group.freeze(replica)
        cut_replication(check)
        lossy, _ = submit_each(plain, [f"plain {i}" for i in range(8)])
        kept, told = submit_each(durable, [f"durable {i}" for i in range(8)])
        group.kill_master()
        group.thaw(replica)
        assert group.wait_promoted(master, timeout_s=40) == replica
        for worker in fleet.started:
            worker.process.send_signal(18)

        assert kept == {} and len(told) == 8, "a durable enqueue was told, not lost silently"
        after, _ = submit_each(plain, [f"after {i}" for i in range(5)])
        assert all(answered(plain, after, 30).values()), "both sides found the new master"
        # The stream is read in order: had the replica received any of ``lossy``, it would
        # have been answered before ``after``. A short look is enough.
        assert len(lossy) == 8 and not any(answered(plain, lossy, 2).values()), (
            "every acknowledged request the replica never received is lost"
        )
        kept_after, told_after = submit_each(durable, [f"durable after {i}" for i in range(5)])
        assert len(kept_after) + len(told_after) == 5
        assert all(answered(durable, kept_after, 30).values())
    finally:
        plain.close()
        durable.close()
        for worker in fleet.started:
            worker.process.send_signal(18)
        group.thaw(replica)
        check.close()


@pytest.mark.slow
@pytest.mark.fault
def test_a_durable_enqueue_follows_its_slot_to_the_promoted_replica(
    redis_cluster: LocalCluster,  # noqa: F811
) -> None:
    """The durable enqueue runs on a plain client of the slot's owner, outside the cluster
    client's routing: after the owner dies, both clients find the promoted replica (which
    has no replica of its own yet, so the answer is NotReplicated, not an outage), and once
    the old node is back as its replica, durable enqueues are accepted again."""
    cluster = redis_cluster
    queue = f"follow{uuid.uuid4().hex[:6]}"
    # A replica that has just rejoined can take ~0.9 s to confirm its first WAIT.
    settings = ClientSettings(redis_url=cluster.url, queue=queue, timeout_s=10,
                              durable_replicas=1, durable_timeout_ms=3000)
    doomed = cluster.master_for_key(keys.requests(keys.QueueRef(queue)))
    sync_client = Client(settings=settings)
    loop = asyncio.new_event_loop()
    async_client = AsyncClient(settings=settings)
    try:
        assert sync_client.submit("before, sync")
        assert loop.run_until_complete(async_client.submit("before, async"))
        cluster.kill(doomed)
        cluster.wait_promoted(doomed, timeout_s=30)
        with pytest.raises(NotReplicated):
            sync_client.submit("after, sync")
        with pytest.raises(NotReplicated):
            loop.run_until_complete(async_client.submit("after, async"))
        cluster.restart(doomed)
        cluster.wait_ok(timeout_s=60)
        assert sync_client.submit("replicated again, sync")
        assert loop.run_until_complete(async_client.submit("replicated again, async"))
    finally:
        sync_client.close()
        loop.run_until_complete(async_client.aclose())
        loop.close()
        whole_again(cluster, doomed)


@dataclass
class Load:
    """What producer threads had accepted, refused or failed while a failover ran."""

    accepted: dict[str, tuple[str, float]] = field(default_factory=dict)
    """id -> (text, monotonic time the enqueue returned)."""
    told: dict[str, tuple[str, float]] = field(default_factory=dict)
    """NotReplicated ids -> (text, when): queued on the primary alone, at risk."""
    failed_calls: int = 0
    inferred: dict[str, tuple[bool, float]] = field(default_factory=dict)
    """infer_many through an AsyncClient: id -> (right vector, when it came back)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def infer_async(self, settings: ClientSettings, tag: str, stop: threading.Event) -> None:
        """Wait for answers through one AsyncClient's listeners, through the failover."""
        async def run() -> None:
            async with AsyncClient(settings=settings) as client:
                call = 0
                while not stop.is_set():
                    texts = [f"{tag} call {call} row {row}" for row in range(10)]
                    call += 1
                    try:
                        results = await client.infer_many(texts, timeout_s=5)
                    except (BrokerUnavailable, ReplyTimeout, redis.RedisError):
                        with self.lock:
                            self.failed_calls += 1
                        await asyncio.sleep(0.05)
                        continue
                    now = time.monotonic()
                    with self.lock:
                        self.inferred.update((res.id, (vector_ok(res, text), now))
                                             for res, text in zip(results, texts, strict=True))

        asyncio.run(run())

    def produce(self, settings: ClientSettings, tag: str, stop: threading.Event) -> None:
        with Client(settings=settings) as client:
            call = 0
            while not stop.is_set():
                texts = [f"{tag} call {call} row {row} " + "w " * (row % 30) for row in range(10)]
                call += 1
                try:
                    ids = client.submit_many(texts)
                except NotReplicated as exc:
                    now = time.monotonic()
                    with self.lock:
                        self.told.update((rid, (t, now))
                                         for rid, t in zip(exc.request_ids, texts, strict=True))
                    continue
                except (BrokerUnavailable, ReplyTimeout, redis.RedisError):
                    with self.lock:
                        self.failed_calls += 1
                    time.sleep(0.05)
                    continue
                now = time.monotonic()
                with self.lock:
                    self.accepted.update((rid, (t, now)) for rid, t in zip(ids, texts, strict=True))
                time.sleep(0.01)  # a steady load, not a flood to verify afterwards


def failover_under_load(url: str, queue: str, shards: int, fleet: Fleet, check: redis.Redis,
                        kill: Callable[[], None], promoted: Callable[[], None]) -> None:
    """Producers (durable and plain) and 2 workers run; a master dies mid-run; both sides
    carry on; every durable acceptance is answered, and a plain one lost only if accepted
    before the kill."""
    workers = start_workers(fleet, url, queue, 2, shards, check, "--sim-batch-ms", "5",
                            "--claim-idle-s", "3600")
    durable, plain, waiting = Load(), Load(), Load()
    base = {"redis_url": url, "queue": queue, "timeout_s": 5}
    stop = threading.Event()
    threads = [
        *(threading.Thread(target=durable.produce, args=(ClientSettings(
            **base, durable_replicas=1, durable_timeout_ms=1000), f"d{n}", stop))
          for n in range(2)),
        threading.Thread(target=plain.produce, args=(ClientSettings(**base), "p", stop)),
        threading.Thread(target=waiting.infer_async, args=(ClientSettings(**base), "a", stop)),
    ]
    for thread in threads:
        thread.start()
    every_shard: set[int | None] = {None} if shards == 1 else set(range(shards))

    def carried_on(since: float) -> dict[str, set[int | None]]:
        """The shards on which each kind of producer had an outcome after ``since``."""
        with plain.lock, durable.lock, waiting.lock:
            outcomes = {
                # a plain enqueue is accepted
                "plain": plain.accepted.items(),
                # a durable one accepted, or told NotReplicated (the new master has no replica)
                "durable": [*durable.accepted.items(), *durable.told.items()],
                # an AsyncClient's infer_many answered, through its listeners
                "async infer": waiting.inferred.items(),
            }
            return {kind: {keys.shard_in_id(rid) for rid, (_, at) in done if at > since}
                    for kind, done in outcomes.items()}

    try:
        deadline = time.monotonic() + 30
        while any(found != every_shard for found in carried_on(0).values()):
            assert time.monotonic() < deadline, ("the load never started", carried_on(0))
            time.sleep(0.1)
        killed_at = time.monotonic()
        kill()
        promoted()
        back_at = time.monotonic()
        deadline = back_at + 30
        while any(found != every_shard for found in carried_on(back_at).values()):
            assert time.monotonic() < deadline, ("not every producer carried on",
                                                 carried_on(back_at), fleet.logs())
            time.sleep(0.1)
        resumed_s = time.monotonic() - back_at
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert all(ok for ok, _ in waiting.inferred.values())
    with Client(url, queue, timeout_s=60) as client:
        got = answered(client, {rid: t for rid, (t, _) in durable.accepted.items()}, 60)
        assert all(got.values()), (
            f"{sum(not ok for ok in got.values())} of {len(got)} durable acceptances lost",
            fleet.logs())
        plain_got = answered(client, {rid: t for rid, (t, _) in plain.accepted.items()}, 30)
    lost = [rid for rid, ok in plain_got.items() if not ok]
    assert all(plain.accepted[rid][1] <= killed_at for rid in lost), "lost after the failover"
    assert all(worker.process.poll() is None for worker in workers), "workers carried on"
    print(f"failover under load: durable {len(durable.accepted)} accepted, all answered, "
          f"{len(durable.told)} told NotReplicated, {durable.failed_calls} calls failed; "
          f"plain {len(plain.accepted)} accepted, {len(lost)} lost; "
          f"{len(waiting.inferred)} answers to async infer_many, {waiting.failed_calls} failed; "
          f"{back_at - killed_at:.1f} s to the new master, every producer resumed "
          f"{resumed_s:.1f} s later")


@pytest.mark.slow
@pytest.mark.fault
def test_a_cluster_master_killed_under_load_loses_no_durable_request(
    redis_cluster: LocalCluster, fleet: Fleet,  # noqa: F811
) -> None:
    cluster = redis_cluster
    queue = spread_queue(cluster)
    admin = cluster.client()
    doomed = cluster.master_for_key(keys.requests(keys.shards_of(keys.QueueRef(queue), 3)[0]))
    try:
        failover_under_load(
            cluster.url, queue, 3, fleet, admin, lambda: cluster.kill(doomed),
            lambda: cluster.wait_promoted(doomed, timeout_s=30),
        )
    finally:
        whole_again(cluster, doomed)
        admin.close()


@pytest.mark.slow
@pytest.mark.fault
def test_a_sentinel_master_killed_under_load_loses_no_durable_request(
    redis_sentinel: LocalSentinel, fleet: Fleet,  # noqa: F811
) -> None:
    group = redis_sentinel
    master = group.current_master()
    check = redis.Redis(port=master)
    try:
        failover_under_load(group.url, "sentinel-load", 1, fleet, check, group.kill_master,
                            lambda: group.wait_promoted(master, timeout_s=40))
    finally:
        check.close()


@pytest.mark.slow
@pytest.mark.fault
def test_a_shard_whose_nodes_are_down_does_not_hold_back_the_others(
    redis_cluster: LocalCluster, fleet: Fleet,  # noqa: F811
) -> None:
    """A worker answers the shards it can reach while one shard's master and replica are down.

    With ``cluster-require-full-coverage no`` (docs/OPERATIONS.md) the
    Cluster keeps serving the other slots; the worker's answers for the lost
    shard wait in that shard's own outbox until its nodes are back.
    """
    cluster = redis_cluster
    queue = spread_queue(cluster)
    admin = cluster.client()
    for port in cluster.live_ports():
        redis.Redis(port=port).config_set("cluster-require-full-coverage", "no")
    # A batch takes 1.5 s, long enough to take a shard's nodes away before it is answered.
    (worker,) = start_workers(fleet, cluster.url, queue, 1, 3, admin, "--sim-batch-ms", "1500",
                              "--linger-ms", "50")
    worker.process.send_signal(19)  # hold it, so one batch takes all 30 requests
    lanes = keys.shards_of(keys.QueueRef(queue), 3)
    master = cluster.master_for_key(keys.requests(lanes[0]))
    (replica,) = cluster.replicas_of(master)
    client = Client(cluster.url, queue, timeout_s=15)
    try:
        ids = [client.submit(f"t {i}") for i in range(30)]
        texts = {rid: f"t {i}" for i, rid in enumerate(ids)}
        worker.process.send_signal(18)
        deadline = time.monotonic() + 10
        while sum(admin.xpending(keys.requests(lane), keys.GROUP)["pending"]
                  for lane in lanes) < 30:
            assert time.monotonic() < deadline, worker.output()
            time.sleep(0.01)
        cluster.freeze(replica)
        cluster.freeze(master)
        reachable = {rid: t for rid, t in texts.items() if keys.shard_in_id(rid) != 0}
        got = answered(client, reachable, 10)
        assert all(got.values()), (got, worker.output())
        cluster.thaw(master)
        cluster.thaw(replica)
        lost_shard = {rid: t for rid, t in texts.items() if keys.shard_in_id(rid) == 0}
        assert all(answered(client, lost_shard, 30).values()), worker.output()
    finally:
        client.close()
        cluster.thaw(master)
        cluster.thaw(replica)
        cluster.wait_ok(timeout_s=60)
        for port in cluster.live_ports():
            redis.Redis(port=port).config_set("cluster-require-full-coverage", "yes")
        admin.close()


def test_the_workers_stream_reads_cost_no_command_getkeys(
    redis_cluster: LocalCluster,  # noqa: F811
) -> None:
    """redis-py would ask a node COMMAND GETKEYS before every XREADGROUP; the worker does not."""
    import asyncio

    from tokenq.worker.redis_connect import connect
    from tokenq.worker.settings import WorkerSettings

    cluster = redis_cluster
    stream = keys.requests(keys.QueueRef("getkeys", shard=1))
    masters = [redis.Redis(port=port) for port in cluster.masters()]

    async def read() -> None:
        client = connect(WorkerSettings(redis_url=cluster.url))
        try:
            await client.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
            await client.xadd(stream, {"v": "1"})
            for node in masters:
                node.config_resetstat()
            for _ in range(5):
                await client.xreadgroup(keys.GROUP, "c", {stream: ">"}, count=10, block=10)
        finally:
            await client.aclose()

    asyncio.run(read())
    stats = [node.info("commandstats") for node in masters]
    assert sum(s.get("cmdstat_xreadgroup", {}).get("calls", 0) for s in stats) == 5
    assert not any("cmdstat_command|getkeys" in s for s in stats), stats
    for node in masters:
        node.close()
