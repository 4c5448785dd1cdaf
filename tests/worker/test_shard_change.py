"""Changing a sharded queue's shard count loses nothing (docs/OPERATIONS.md, "Changing K").

Going from 3 shards to 2, shard 2 is *retired*: the new workers read it
until it is empty and holds no dead letter, and a producer still holding
K = 3 (for up to its ``config_ttl_s``) is refused there atomically by
enqueue.lua and writes to a current shard instead, with no error and nothing
lost. Then shard 2 is removed; its marker stays, so a producer that is
stale for longer is still refused. Growing back to 3 serves shard 2 again.
``tokenq stats`` and ``dlq`` see the retired shard while it exists.

Every worker here is a real process on one redis-server: the shards are
hash-tagged keys there exactly as on a Cluster, and the enqueue script
touches only its own shard's slot (KEYS), which the Cluster tests cover.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import pytest
import redis

from tests.support import SimModel, fleet_fixture, wait_for
from tests.workers import Fleet, WorkerProcess
from tokenq.producer import AsyncClient, Client
from tokenq.producer.shards import ShardRetired
from tokenq.shared import functions, keys, lua_scripts, wire
from tokenq.shared.keys import QueueRef
from tokenq.shared.settings import ClientSettings

ENQUEUE_SCRIPT = lua_scripts.load("tokenq.producer", "enqueue.lua")

fleet = fleet_fixture(*SimModel(dim=8).flags("--heartbeat-s", "0.3"))


def start(fleet: Fleet, r: redis.Redis, queue: str, shards: int, name: str) -> WorkerProcess:
    return fleet.start("--shards", str(shards), name=name, ready=r, queue=queue)


def stale_client(redis_url: str, queue: str) -> Client:
    """A client that has learned K and keeps it for an hour unless refused."""
    client = Client(redis_url, queue, timeout_s=30, config_ttl_s=3600)
    client.config()
    return client


def lanes_in_stats(capsys: pytest.CaptureFixture[str], redis_url: str, *args: str) -> set:
    from tokenq.producer.ops.stats import main as stats_main

    capsys.readouterr()
    stats_main(["--redis-url", redis_url, "--json", *args])
    doc = json.loads(capsys.readouterr().out)
    return {(row["queue"], row["shard"]) for row in doc["queues"]}


def shards_of_ids(ids: list[str]) -> Counter:
    return Counter(keys.shard_in_id(i) for i in ids)


def test_shrinking_drains_the_retired_shard_and_stale_producers_lose_nothing(
    fleet, r, redis_url, queue_name, capsys
):
    q, two = QueueRef(queue_name), QueueRef(queue_name, shard=2)
    old = start(fleet, r, queue_name, 3, "old")
    stale = [stale_client(redis_url, queue_name) for _ in range(5)]
    assert all(client.config()["shards"] == "3" for client in stale)
    old.terminate()

    # Left behind on every shard, shard 2 included, with nobody reading.
    before = [stale[0].submit(f"before {i}") for i in range(30)]
    assert shards_of_ids(before) == {0: 10, 1: 10, 2: 10}
    r.xadd(keys.requests(two), {b"not": b"a request"})  # its dead letter must stay on shard 2

    new = start(fleet, r, queue_name, 2, "new")
    assert r.exists(keys.retired(two)) and r.get(keys.shards_served(q)) == b"3"

    # Producers holding K = 3 keep sending, from several threads at once.
    after: list[str] = []
    lock = threading.Lock()

    def send(client: Client, n: int) -> None:
        for i in range(n):  # distinct texts: identical ones in flight run as one row
            request_id = client.submit(f"after {id(client)} {i}")
            with lock:
                after.append(request_id)

    threads = [threading.Thread(target=send, args=(client, 12)) for client in stale[1:4]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(after) == 36 and 2 not in shards_of_ids(after), shards_of_ids(after)

    results = stale[0].results(before + after, timeout_s=60)
    assert all(result.embedding is not None for result in results)
    ran = sum(batch["rows"] for worker in (old, new) for batch in worker.batches())
    assert ran == len(before) + len(after), "every request ran exactly once"

    # Drained, but its dead letter keeps shard 2: stats and dlq still see it.
    wait_for(lambda: r.xlen(keys.dead(two)) == 1, 10, "the dead letter on shard 2", fleet=fleet)
    assert r.xlen(keys.requests(two)) == 0 and r.exists(keys.requests(two))
    assert (queue_name, 2) in lanes_in_stats(capsys, redis_url, "--queue", queue_name)
    assert (queue_name, 2) in lanes_in_stats(capsys, redis_url)

    from tokenq.producer.ops.dlq import main as dlq_main

    assert dlq_main(["--redis-url", redis_url, "--queue", queue_name, "list", "--json"]) == 0
    letters = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [letter["shard"] for letter in letters] == [2], letters
    assert dlq_main(["--redis-url", redis_url, "--queue", queue_name, "purge",
                     "--id", letters[0]["entry"]]) == 0

    # Nothing left on it: the workers remove it within a heartbeat or two.
    wait_for(lambda: not r.exists(keys.requests(two), keys.shards_served(q)), 10,
             "shard 2 removed, and then its record", fleet=fleet)
    assert not r.exists(keys.dead(two), keys.workers(two), keys.config(two))
    assert r.exists(keys.retired(two))
    assert (queue_name, 2) not in lanes_in_stats(capsys, redis_url, "--queue", queue_name)
    assert (queue_name, 2) not in lanes_in_stats(capsys, redis_url)

    # A producer stale for longer than the drain (it still holds K = 3: it has sent
    # nothing since) is still refused there, and answered on a current shard.
    sleeper = stale[-1]
    last = [sleeper.submit(f"last {i}") for i in range(3)]
    assert 2 not in shards_of_ids(last)
    assert all(result.embedding is not None for result in sleeper.results(last))
    assert not r.exists(keys.requests(two))
    assert "Traceback" not in new.output(), new.output()
    for client in stale:
        client.close()


def test_a_retired_shards_tenant_streams_are_read_until_drained(fleet, r, redis_url, queue_name):
    two = QueueRef(queue_name, shard=2)
    old = start(fleet, r, queue_name, 3, "old")
    stale = stale_client(redis_url, queue_name)
    old.terminate()
    ids = [stale.submit(f"a tenant's {i}", tenant="t") for i in range(9)]
    assert shards_of_ids(ids)[2] and r.xlen(keys.tenant_requests(two, "t"))
    start(fleet, r, queue_name, 2, "new")
    assert all(result.embedding is not None for result in stale.results(ids, timeout_s=30))
    wait_for(lambda: not r.exists(keys.requests(two), keys.tenant_requests(two, "t")), 10,
             "shard 2 drained and removed", fleet=fleet)
    stale.close()


def test_growing_back_serves_the_retired_shard_again(fleet, r, redis_url, queue_name):
    two = QueueRef(queue_name, shard=2)
    start(fleet, r, queue_name, 3, "three").terminate()
    start(fleet, r, queue_name, 2, "two").terminate()
    assert r.exists(keys.retired(two))
    start(fleet, r, queue_name, 3, "again")
    assert not r.exists(keys.retired(two))
    with Client(redis_url, queue_name, timeout_s=30) as client:
        ids = [client.submit(f"grown {i}") for i in range(9)]
        assert shards_of_ids(ids) == {0: 3, 1: 3, 2: 3}
        assert all(result.embedding is not None for result in client.results(ids))


def test_a_client_that_still_counts_a_retired_shard_is_told_and_writes_nothing(
    r, redis_url, queue_name
):
    """No config to learn from (none published, or an ACL), and a ``shards`` setting the
    workers left: refused by name, never written where nobody reads."""
    two = QueueRef(queue_name, shard=2)
    r.set(keys.retired(two), "2")
    settings = ClientSettings(redis_url=redis_url, queue=queue_name, timeout_s=5, shards=3)
    with Client(settings=settings) as client:
        written = []
        with pytest.raises(ShardRetired, match=r"shard 2 of queue .* is retired"):
            for i in range(3):
                written.append(client.submit(f"x {i}"))
    assert 2 not in shards_of_ids(written) and not r.exists(keys.requests(two))


def test_the_enqueue_script_refuses_new_entries_on_a_retired_shard(r, queue_name):
    two = QueueRef(queue_name, shard=2)
    stream, marker = keys.requests(two), keys.retired(two)
    seen = keys.seen(two, "2.a")
    enqueue = r.register_script(ENQUEUE_SCRIPT)
    entry = [2, "id", "2.a", "text", "hi"]
    assert len(enqueue(keys=[stream, seen, marker], args=[0, 1, 60000, *entry])) == 1
    r.set(marker, "2")
    with pytest.raises(redis.ResponseError, match=r"^RETIRED"):
        enqueue(keys=[stream, keys.seen(two, "2.b"), marker],
                args=[0, 1, 60000, 2, "id", "2.b", "text", "hi"])
    with pytest.raises(redis.ResponseError, match=r"^RETIRED"):
        enqueue(keys=[stream, marker], args=[0, 1, 0, *entry])
    # A retried call whose entries were all written before is answered, not refused.
    assert len(enqueue(keys=[stream, seen, marker], args=[0, 1, 60000, *entry])) == 1
    # Without the marker key (an unsharded queue, another language's producer): as always.
    assert len(enqueue(keys=[stream], args=[0, 1, 0, *entry])) == 1
    assert r.xlen(stream) == 2


def test_a_stale_async_client_is_answered_on_a_current_shard(fleet, r, redis_url, queue_name):
    """The listener path: replies are listened for on the shard the call was written to."""
    old = start(fleet, r, queue_name, 3, "old")

    async def go() -> None:
        async with AsyncClient(redis_url, queue_name, timeout_s=30, config_ttl_s=3600) as client:
            await client.infer("warm up")  # learns K = 3
            old.terminate()
            start(fleet, r, queue_name, 2, "new")
            results = await asyncio.gather(*(client.infer(f"async {i}") for i in range(9)))
            assert all(result.embedding is not None for result in results)
            assert 2 not in shards_of_ids([result.id for result in results])

    asyncio.run(go())


def test_shrinking_to_one_shard_drains_every_numbered_shard(fleet, r, redis_url, queue_name):
    start(fleet, r, queue_name, 3, "three").terminate()
    with stale_client(redis_url, queue_name) as client:
        left = [client.submit(f"left {i}") for i in range(6)]
        one = start(fleet, r, queue_name, 1, "one")
        after = [client.submit(f"after {i}") for i in range(4)]
        assert shards_of_ids(after) == {None: 4}  # refused on every shard: the plain {q}
        results = client.results(left + after)
    assert all(result.embedding is not None for result in results)
    numbered = [QueueRef(queue_name, shard=k) for k in range(3)]
    wait_for(lambda: not any(r.exists(keys.requests(s)) for s in numbered), 10,
             "every shard removed", fleet=fleet)
    assert all(r.exists(keys.retired(s)) for s in numbered)
    assert "Traceback" not in one.output(), one.output()


def test_a_retired_shard_stays_while_a_tenant_s_stream_holds_entries(r, queue_name):
    """remove_retired.lua judges the shard drained over every stream it has: while a tenant's
    stream holds entries, or entries read and not answered, the shard, its pending hash (that
    tenant's field and the sum) and the stream stay; once they are answered all of it goes,
    the empty tenant streams too. Members of the tenants set that name no tenant stream of
    the shard, or no stream, are left alone."""
    two = QueueRef(queue_name, shard=2)
    main, tenant, pending = keys.requests(two), keys.tenant_requests(two, "a"), keys.pending(two)
    r.xgroup_create(main, keys.GROUP, id="0", mkstream=True)
    r.hset(keys.config(two), "shards", "3")
    functions.Function(r, "enqueue")(keys=[tenant, keys.tenants(two)], args=[
        0, 2, 0, 2, "id", "2.a", "tokens", "7", 2, "id", "2.b", "tokens", "5"])
    r.xgroup_create(tenant, keys.GROUP, id="0")
    junk = [keys.tenant_requests(two, "str"), keys.tenant_requests(QueueRef(queue_name), "x")]
    r.set(junk[0], "not a stream")
    r.xadd(junk[1], {"v": "1"})  # another slot's stream, named in this shard's set
    r.sadd(keys.tenants(two), *junk, keys.config(two), main + ":default", main + ":a:b")
    r.set(keys.retired(two), "2")
    remove = functions.Function(r, "remove_retired")

    def tend() -> str:
        return remove(keys=[main, keys.dead(two), keys.retired(two), keys.workers(two),
                            keys.config(two)], args=[keys.GROUP]).decode()

    assert tend() == "draining"
    [(_, entries)] = r.xreadgroup(keys.GROUP, "w", {tenant: ">"})
    r.xdel(tenant, entries[0][0])  # read, then gone from the stream: still to be answered
    assert tend() == "draining"
    assert r.hgetall(pending) == {b"tokens": b"12", b"tokens:a": b"12"}
    publish = functions.Function(r, "publish")
    for entry_id, fields in entries:
        publish(keys=[tenant, keys.dead(two), keys.reply(two, "r")], args=[
            keys.GROUP, "w", 60_000, 1000, 4096, 1, entry_id, 3, b"p", wire.counted_of(fields),
            0])
        assert r.exists(main, tenant, pending, keys.config(two)) == 4
        assert tend() == ("removed" if r.xlen(tenant) == 0 else "draining")
    assert r.hgetall(pending) == {}  # answered to 0, then removed with the shard
    assert not r.exists(main, tenant, keys.config(two))
    assert r.exists(keys.retired(two), keys.tenants(two), *junk) == 4
    assert tend() == "gone"


def test_a_retired_shard_whose_tenant_stream_may_not_be_read_stays_draining(
    r, redis_url, queue_name
):
    """A tenant stream Redis refuses to read (an ACL without it) is not taken for a key that is
    no stream: the shard is not judged drained past it, and nothing of it is removed."""
    two = QueueRef(queue_name, shard=2)
    main, tenant, pending = keys.requests(two), keys.tenant_requests(two, "a"), keys.pending(two)
    r.xgroup_create(main, keys.GROUP, id="0", mkstream=True)
    functions.Function(r, "enqueue")(keys=[tenant, keys.tenants(two)], args=[
        0, 1, 0, 2, "id", "2.a", "tokens", "7"])
    r.set(keys.retired(two), "2")
    names = [main, keys.dead(two), keys.retired(two), keys.workers(two), keys.config(two)]
    user = f"retire-{queue_name}"[:60]
    r.acl_setuser(user, enabled=True, nopass=True, commands=[
        "+fcall", "+exists", "+xlen", "+xpending", "+smembers", "+del"],
                  keys=[*names, keys.tenants(two), pending])  # not the tenant's stream
    try:
        with redis.Redis.from_url(redis_url, username=user, password="") as limited:
            state = functions.Function(limited, "remove_retired")(keys=names, args=[keys.GROUP])
        assert state == b"draining"
        assert r.exists(main, tenant, pending) == 3
    finally:
        r.acl_deluser(user)


def test_a_retired_shard_whose_own_stream_is_gone_stays_while_a_tenant_s_holds_entries(
    r, queue_name
):
    """A shard whose own stream went first (removed by hand, or by a version that judged it
    alone) is "gone" only once its tenants' streams are drained; those are removed then."""
    two = QueueRef(queue_name, shard=2)
    main, tenant = keys.requests(two), keys.tenant_requests(two, "a")
    functions.Function(r, "enqueue")(keys=[tenant, keys.tenants(two)], args=[
        0, 1, 0, 2, "id", "2.a", "tokens", "7"])
    r.set(keys.retired(two), "2")
    remove = functions.Function(r, "remove_retired")
    names = [main, keys.dead(two), keys.retired(two), keys.workers(two), keys.config(two)]
    assert remove(keys=names, args=[keys.GROUP]) == b"draining"
    assert r.hgetall(keys.pending(two)) == {b"tokens": b"7", b"tokens:a": b"7"}
    r.xtrim(tenant, maxlen=0)
    assert remove(keys=names, args=[keys.GROUP]) == b"gone"
    assert not r.exists(tenant)
