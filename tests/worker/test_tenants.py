"""Tenants: a stream per tenant in the queue's slot, read in weighted fair share by tokens.

The pure parts (names, weights, :class:`FairShare`) are unit tests; then a producer's tenant
option on a real Redis, and sim workers serving two tenants: one tenant's flood does not
starve the other, and the share of processed tokens follows the operator's weights."""

from __future__ import annotations

import time

import msgpack
import pytest
import redis

from tests.support import SIM_FLAGS, starter_fixture, wait_for
from tokenq.producer import Client, QueueFull
from tokenq.producer.ops.dlq import main as dlq_main
from tokenq.shared import dead_letter, keys, lua_scripts
from tokenq.shared.dead_letter import parse_letter
from tokenq.shared.errors import BadRequest
from tokenq.shared.settings import ClientSettings, tenant_keys
from tokenq.worker.loop.tenants import MAX_TENANT_LANES, FairShare, parse_weights

Q = keys.QueueRef("q")


# ------------------------------------------------------------------ names (unit)

@pytest.mark.unit
def test_a_tenants_stream_is_in_the_queues_slot_and_the_default_tenants_is_todays():
    assert keys.tenant_requests(Q, keys.DEFAULT_TENANT) == keys.requests(Q)
    stream = keys.tenant_requests(Q, "team-a")
    assert stream == "tokenq:{q}:requests:team-a"
    assert keys.tenant_of(Q, stream) == keys.tenant_of(Q, stream.encode()) == "team-a"
    shard = keys.QueueRef("q", shard=3)
    assert keys.tenant_requests(shard, "b").startswith(shard.tag + ":")
    # Nothing else reads as a tenant's stream; the stats' scan of request streams skips them.
    for other in (keys.requests(Q), keys.requests(Q) + ":", keys.requests(Q) + ":default",
                  keys.requests(Q) + ":a b", "tokenq:{r}:requests:a", keys.dead(Q), 7):
        assert keys.tenant_of(Q, other) is None
    assert keys.queue_of(stream) is None


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["", "a" * 65, "a b", "a:b", "a{b}", "ü", "a\n", None, 3, b"a"])
def test_a_bad_tenant_name_is_refused_clearly(bad):
    with pytest.raises(ValueError, match=r"tenant .* is invalid: use 1-64 characters"):
        keys.check_tenant(bad)
    assert keys.check_tenant("A-z_0.9") == "A-z_0.9"


@pytest.mark.unit
def test_api_keys_name_tenants_and_a_bad_part_is_named_without_its_key():
    assert tenant_keys(" a=k1, b=k=2 ,") == {"k1": "a", "k=2": "b"}
    with pytest.raises(ValueError, match="part 2 is not tenant=key") as refused:
        tenant_keys("a=k1,secret-key")
    assert "secret" not in str(refused.value)
    with pytest.raises(ValueError, match="tenant 'a b' is invalid"):
        tenant_keys("a b=k1")
    assert tenant_keys("a=k1,a=k1") == {"k1": "a"}
    with pytest.raises(ValueError, match="part 2 gives tenant 'b' the key of tenant 'a'") as two:
        tenant_keys("a=secret-key,b=secret-key")  # its caller would be b, silently
    assert "secret" not in str(two.value)


@pytest.mark.unit
def test_weights_are_read_and_bad_ones_ignored_with_the_field_named():
    weights, default, ignored = parse_weights(
        {b"a": b"3", "b": "0.5", "*": "2", "c": "0", "d": "nan", "e": "inf", "f": "x"})
    assert weights == {"a": 3.0, "b": 0.5} and default == 2.0
    assert [line.split(":")[0] for line in ignored] == ["'c'", "'d'", "'e'", "'f'"]
    assert parse_weights({}) == ({}, None, [])


# ------------------------------------------------------------ fair share (unit)

def served_share(fair: FairShare, sizes: dict[str, int], reads: int, per_read: int = 8
                 ) -> dict[str, float]:
    """Tenants that always have a backlog read in turn as ``fair`` allows (the first allowed
    one, in a rotating order); each read takes ``per_read`` entries of ``sizes[tenant]`` tokens.
    Returns each tenant's share of the tokens read."""
    served = dict.fromkeys(sizes, 0)
    order = list(sizes)
    for step in range(reads):
        now = step * 0.001
        tenant = next(t for t in order[step % len(order):] + order[:step % len(order)]
                      if fair.may_read(t, now))
        fair.arrived(tenant, full=True, now=now)
        fair.charge(tenant, per_read * sizes[tenant], per_read)
        served[tenant] += per_read * sizes[tenant]
    total = sum(served.values())
    return {tenant: tokens / total for tenant, tokens in served.items()}


@pytest.mark.unit
def test_equal_weights_share_tokens_not_entries():
    share = served_share(FairShare(quantum=8192), {"a": 2000, "b": 20}, reads=4000)
    assert 0.45 <= share["a"] <= 0.55, share


@pytest.mark.unit
def test_weights_3_to_1_share_tokens_3_to_1():
    fair = FairShare(quantum=8192)
    fair.weights = {"a": 3.0}
    share = served_share(fair, {"a": 2000, "b": 20}, reads=8000)
    assert share["a"] == pytest.approx(0.75, rel=0.1), share
    fair = FairShare(quantum=8192)
    fair.weights, fair.default_weight = {"a": 1.0}, 3.0  # '*': tenants not named
    assert served_share(fair, {"a": 20, "b": 300}, reads=8000)["b"] == pytest.approx(0.75, rel=0.1)


@pytest.mark.unit
def test_a_read_is_cut_to_a_quantum_of_the_tenants_own_entries_and_no_room_stays_none():
    fair = FairShare(quantum=8192)
    assert fair.read_count("a", 300) == 300  # nothing learned yet: the room's count
    fair.charge("a", 15000, 10)
    fair.charge("b", 200, 10)
    assert fair.read_count("a", 300) == 5 and fair.read_count("b", 300) == 300
    assert fair.read_count("a", 0) == fair.read_count("b", 0) == 0
    fair.charge("c", 50000, 1)  # longer than a quantum: still one at a time
    assert fair.read_count("c", 300) == 1


@pytest.mark.unit
def test_a_tenant_has_a_quantum_of_its_own_room_and_sharing_takes_two_active_tenants():
    fair = FairShare(quantum=8192)
    assert fair.own_room("b", 0) == 1 and fair.own_room("b", 1) == 0  # nothing learned: one
    fair.charge("b", 200, 10)  # 20 tokens each: 409 fill a quantum
    fair.charge("a", 16000, 10)  # 1,600 each: 5 do
    assert fair.own_room("b", 4) == 405 and fair.own_room("a", 5) == 0
    assert not fair.sharing(0.0)
    fair.took("a", 0.0)
    assert not fair.sharing(0.5)  # one tenant alone
    fair.took("b", 0.5)
    assert fair.sharing(1.0)
    assert not fair.sharing(1.6)  # a's last entries came more than ACTIVE_S ago
    assert fair.sharing(1.6, batch_s=0.5)  # ... but less than 4 batches of a slow device ago
    fair.arrived("a", full=True, now=1.6)  # ... but a backlog of a's keeps it active
    assert fair.own_room("a", 0) == 0  # a tenant with a backlog has no room of its own
    fair.took("b", 2.0)
    assert fair.sharing(2.5) and not fair.sharing(12.0)
    fair.arrived("b", full=True, now=2.5)  # both backlogged: each waits for its own backlog
    assert not fair.sharing(2.6)


@pytest.mark.unit
def test_a_lone_tenant_always_reads_and_an_idle_one_saves_up_no_credit():
    fair = FairShare(quantum=100)
    for step in range(50):  # a alone: never held back
        assert fair.may_read("a", step)
        fair.arrived("a", full=True, now=step)
        fair.charge("a", 1000, 1)
    # b was idle all along: its first read comes at once, but from a's level, not from 0 ...
    assert fair.may_read("b", 50)
    fair.arrived("b", full=True, now=50)
    fair.charge("b", 10, 1)
    fair.arrived("b", full=True, now=50)  # its second full read shows a backlog (not its first)
    # ... so a is held back by b's reads since, not by 50,000 tokens of credit.
    assert fair.may_read("a", 50)
    fair.arrived("a", full=True, now=50)
    fair.charge("a", 1000, 1)
    assert not fair.may_read("a", 50)
    fair.charge("b", 1000, 1)
    assert fair.may_read("a", 50)


@pytest.mark.unit
def test_a_tenant_that_drained_or_went_quiet_holds_nobody_back():
    fair = FairShare(quantum=100, stale_s=10)
    fair.charge("a", 0, 1)  # both read before: a full read shows a backlog
    fair.charge("b", 0, 1)
    fair.arrived("a", full=True, now=0)
    fair.arrived("b", full=True, now=0)
    fair.charge("a", 1000, 1)
    assert not fair.may_read("a", 1)  # b's turn
    fair.arrived("b", full=False, now=1)  # b read what there was: no backlog
    assert fair.may_read("a", 1)
    fair.arrived("b", full=True, now=2)  # back, from a's level
    fair.charge("a", 1000, 1)
    assert not fair.may_read("a", 2)
    assert fair.may_read("a", 13)  # b's lane has not read for longer than stale_s


# ------------------------------------------------- the producer's option (real Redis)

def test_a_tenant_writes_to_its_stream_and_registers_it(redis_url, r, queue_name):
    q = keys.QueueRef(queue_name)
    with Client(redis_url=redis_url, queue=queue_name, refuse_early=False) as client:
        client.submit("for a", tenant="team-a")
        client.submit_many(["one", "two"], tenant="team-a")
        client.submit("nobody's", tenant=None)
        client.submit("the default tenant's", tenant=keys.DEFAULT_TENANT)
        for bad in ("a b", "x" * 65, 5):
            with pytest.raises(BadRequest) as refused:
                client.submit("never written", tenant=bad)
            assert refused.value.param == "tenant"
    assert r.xlen(keys.tenant_requests(q, "team-a")) == 3
    assert r.xlen(keys.requests(q)) == 2
    assert r.smembers(keys.tenants(q)) == {keys.tenant_requests(q, "team-a").encode()}
    assert len(r.keys(f"{q.tag}:requests*")) == 2  # nothing written for the bad names


@pytest.mark.unit
def test_tenant_streams_past_the_lane_limit_take_turns_and_none_waits_for_ever():
    """Ten streams all with entries, three lanes: each waits at most a few turns, first in
    first read; an idle lane gives its turn up at once, a busy one after ``turn_s``."""
    from tokenq.worker.loop.lanes import Rotation

    rotation, streams = Rotation(3, turn_s=1.0), [(Q, f"t{i}") for i in range(10)]
    reading: dict = {}
    last_read = dict.fromkeys(streams, 0.0)
    for now in range(1, 40):
        opening, closing = rotation.plan(reading, 0, dict.fromkeys(streams, 5), float(now))
        for stream in closing:
            del reading[stream]
        assert len(reading) + len(opening) <= 3
        reading.update(dict.fromkeys(opening, float(now)))
        last_read.update(dict.fromkeys(reading, float(now)))
        if now > 10:
            assert max(now - at for at in last_read.values()) <= 9, last_read
    assert Rotation(3, 1.0).plan({}, 0, {(Q, "a"): 0, (Q, "b"): 2}, 0.0) == (
        [(Q, "b"), (Q, "a")], [])  # room for all: every stream, those with entries first
    busy, idle = {(Q, "a"): 0.0, (Q, "b"): 0.5}, {(Q, "c"): 0.0}
    lengths = {(Q, "a"): 1, (Q, "b"): 1, (Q, "c"): 0, (Q, "d"): 1}
    assert Rotation(3, 1.0).plan({**busy, **idle}, 0, lengths, 0.6) == ([], [(Q, "c")])
    assert Rotation(2, 1.0).plan(busy, 0, lengths, 0.6) == ([], [])  # not a turn yet
    assert Rotation(2, 1.0).plan(busy, 0, lengths, 1.2) == ([], [(Q, "a")])
    assert Rotation(2, 1.0).plan(busy, 1, lengths, 1.2) == ([], [])  # a lane frees already


# ---------------------------------------------------- sim workers serving tenants

SLOW = ("--heartbeat-s", "0.3", "--sim-token-us", "20", "--sim-batch-ms", "2",
        "--max-batch-tokens", "4096")
start_worker = starter_fixture("start_worker", *SIM_FLAGS, *SLOW)


def flood(redis_url: str, queue: str, tenant: str, words: int, count: int) -> None:
    """``count`` distinct texts of ``words`` words (identical ones would run as one row)."""
    rest = " token" * (words - 1)
    with Client(redis_url=redis_url, queue=queue, max_queue_length=0) as client:
        for start in range(0, count, 500):
            client.submit_many([f"t{i}{rest}" for i in range(start, min(start + 500, count))],
                               tenant=tenant)


def processed_share(r: redis.Redis, queue: str, tokens: dict[str, int], seconds: float
                    ) -> dict[str, float]:
    """Each tenant's share of the tokens processed over ``seconds`` (entries gone from its
    stream, answered, times ``tokens[tenant]`` per entry); both must stay backlogged."""
    q = keys.QueueRef(queue)

    def left() -> dict[str, int]:
        return {tenant: r.xlen(keys.tenant_requests(q, tenant)) for tenant in tokens}

    before = left()
    time.sleep(seconds)
    after = left()
    assert all(after.values()), after  # nobody ran dry: the share is under saturation
    done = {tenant: (before[tenant] - after[tenant]) * tokens[tenant] for tenant in tokens}
    total = sum(done.values())
    return {tenant: spent / total for tenant, spent in done.items()}


def test_one_tenants_flood_does_not_hold_up_anothers_query(start_worker, redis_url, r,
                                                           queue_name):
    start_worker()
    flood(redis_url, queue_name, "a", 500, 2000)  # about 40 s of work
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.infer("warm the tenant up", tenant="b", timeout_s=30)  # b's stream is found
        started = time.monotonic()
        for _ in range(5):
            client.infer("a short query", tenant="b", timeout_s=30)
        per_query = (time.monotonic() - started) / 5
    assert per_query < 1.0, per_query  # behind a's 40 s backlog, were it one stream
    assert r.xlen(keys.tenant_requests(keys.QueueRef(queue_name), "a")) > 1000


@pytest.mark.parametrize(("weights", "want_a"), [({}, 0.5), ({"a": "3"}, 0.75)])
def test_saturated_tenants_share_processed_tokens_by_weight(
        start_worker, redis_url, r, queue_name, weights, want_a):
    q = keys.QueueRef(queue_name)
    if weights:
        r.hset(keys.weights(q), mapping=weights)
    flood(redis_url, queue_name, "a", 500, 1500)  # 502 tokens each
    flood(redis_url, queue_name, "b", 20, 12000)  # 22 tokens each
    start_worker()
    wait_for(lambda: r.xlen(keys.tenant_requests(q, "b")) < 11000, timeout=30)
    share = processed_share(r, queue_name, {"a": 502, "b": 22}, 4.0)
    assert share["a"] == pytest.approx(want_a, abs=0.1), share


def test_a_tenant_at_its_streams_limit_is_refused_alone_and_named(redis_url, r, queue_name):
    with Client(redis_url=redis_url, queue=queue_name, max_queue_length=3,
                refuse_early=False) as client:
        client.submit_many(["x"] * 3, tenant="a")
        with pytest.raises(QueueFull, match="tenant 'a'"):
            client.submit("one too many", tenant="a")
        client.submit_many(["y"] * 3, tenant="b")  # every other tenant keeps flowing
        client.submit_many(["z"] * 3)
    q = keys.QueueRef(queue_name)
    assert [r.xlen(keys.tenant_requests(q, t)) for t in ("a", "b", keys.DEFAULT_TENANT)] == [3] * 3


def test_the_enqueue_script_registers_a_tenants_stream_after_a_shards_marker(r, queue_name):
    two = keys.QueueRef(queue_name, shard=2)
    stream, marker, tenants = keys.tenant_requests(two, "a"), keys.retired(two), keys.tenants(two)
    enqueue = r.register_script(lua_scripts.load("tokenq.producer", "enqueue.lua"))
    entry = [2, "id", "2.a", "text", "hi"]
    assert len(enqueue(keys=[stream, keys.seen(two, "2.a"), marker, tenants],
                       args=[0, 1, 60000, *entry])) == 1
    assert len(enqueue(keys=[stream, tenants], args=[0, 1, 0, *entry])) == 1  # no dedupe
    assert r.smembers(tenants) == {stream.encode()} and r.xlen(stream) == 2
    r.set(marker, "2")
    with pytest.raises(redis.ResponseError, match=r"^RETIRED"):
        enqueue(keys=[stream, keys.seen(two, "2.b"), marker, tenants],
                args=[0, 1, 60000, 2, "id", "2.b", "text", "hi"])


def test_a_sharded_queue_serves_its_tenants_on_every_shard(start_worker, redis_url, r,
                                                           queue_name):
    start_worker("--shards", "3", wait=False)
    settings = ClientSettings(redis_url=redis_url, queue=queue_name, timeout_s=30, shards=3)
    with Client(settings=settings) as client:
        for i in range(12):
            assert client.infer(f"text {i}", tenant="team-a").embedding is not None
    written = {key for shard in keys.shards_of(keys.QueueRef(queue_name), 3)
               for key in r.smembers(keys.tenants(shard))}
    assert len(written) > 1  # the calls went to several shards, each in its own slot
    assert all(keys.tenant_of(keys.queue_of(key.decode().rsplit(":", 1)[0]), key) == "team-a"
               for key in written)


def test_junk_in_the_tenants_set_is_ignored_and_a_broken_stream_fails_alone(
        start_worker, redis_url, r, queue_name):
    q = keys.QueueRef(queue_name)
    evil = keys.tenant_requests(q, "evil")
    r.set(evil, "not a stream")
    r.sadd(keys.tenants(q), evil, keys.requests(q), "tokenq:{elsewhere}:requests:x",
           keys.requests(q) + ":a b", keys.config(q))
    r.hset(keys.weights(q), mapping={"good": "nan", "*": "-1"})  # ignored, with a warning
    worker = start_worker()
    with Client(redis_url=redis_url, queue=queue_name) as client:
        assert client.infer("served", tenant="good", timeout_s=30).embedding is not None
        assert client.infer("served too", timeout_s=30).embedding is not None
    assert r.type(evil) == b"string" and not r.exists("tokenq:{elsewhere}:requests:x")
    wait_for(lambda: "ignored in" in worker.output(), what="the weights warning")
    time.sleep(1.0)  # three heartbeats more: warned once while the hash holds the same
    assert worker.output().count("ignored in") == 1, worker.output()


def test_a_dead_workers_entries_on_a_tenants_stream_are_taken_over(
        start_worker, redis_url, r, queue_name):
    q = keys.QueueRef(queue_name)
    stream = keys.tenant_requests(q, "t")
    with Client(redis_url=redis_url, queue=queue_name, refuse_early=False) as client:
        ids = client.submit_many(["held by a ghost", "and this"], tenant="t")
        r.xgroup_create(stream, keys.GROUP, id="0")
        r.xreadgroup(keys.GROUP, "ghost", {stream: ">"})  # pending to a worker that is gone
        assert r.xpending(stream, keys.GROUP)["pending"] == 2
        start_worker()
        assert all(result.embedding is not None for result in client.results(ids, 30))
    assert r.xlen(stream) == 0  # answered on the tenant's stream: acked and deleted


def test_a_tenants_dead_letter_is_retried_onto_its_tenants_stream_and_answered(
        start_worker, redis_url, r, queue_name):
    q = keys.QueueRef(queue_name)
    stream = keys.tenant_requests(q, "t")
    with Client(redis_url=redis_url, queue=queue_name, refuse_early=False) as client:
        client.submit("dies once, then runs", tenant="t")
    r.xgroup_create(stream, keys.GROUP, id="0")
    r.xreadgroup(keys.GROUP, "ghost", {stream: ">"})  # a gone worker's: delivered once
    start_worker("--max-deliveries", "1")  # the takeover is its second delivery: dead
    wait_for(lambda: r.xlen(keys.dead(q)) == 1, timeout=30, what="the dead letter")
    [(letter_id, fields)] = r.xrange(keys.dead(q))
    letter = parse_letter(letter_id, fields)
    assert letter.tenant == "t" and fields[b"dead_tenant"] == b"t"
    reply_to = letter.request["reply_to"]
    assert r.blpop([reply_to], timeout=10) is not None  # the dead letter's error reply

    assert dlq_main(["--redis-url", redis_url, "--queue", queue_name, "retry", "--all"]) == 0
    popped = r.blpop([reply_to], timeout=20)
    assert popped is not None, "the retried request was not answered"
    assert msgpack.unpackb(popped[1], raw=False)["ok"] is True
    assert r.xinfo_stream(stream)["entries-added"] == 2  # written, then retried there
    assert r.xinfo_stream(keys.requests(q))["entries-added"] == 0
    assert r.xlen(keys.dead(q)) == 0


@pytest.mark.unit
def test_a_letter_names_a_named_tenant_only_and_a_bad_name_reads_as_the_default():
    death = dead_letter.Death("dead_letter", "why", "w", 4, 1, "1-0", "acme")
    record = dict(dead_letter.encode_letter({"id": "x"}, death, max_bytes=100))
    assert record["dead_tenant"] == "acme"
    plain = dead_letter.Death("dead_letter", "why", "w", 4, 1, "1-0")
    assert "dead_tenant" not in dict(dead_letter.encode_letter({"id": "x"}, plain, max_bytes=99))
    assert parse_letter("1-0", {b"id": b"x", b"dead_tenant": b"a b"}).tenant == keys.DEFAULT_TENANT
    assert parse_letter("1-0", {b"id": b"x"}).tenant == keys.DEFAULT_TENANT


def test_a_new_tenants_first_request_is_served_at_once_not_at_the_next_heartbeat(
        start_worker, redis_url, r, queue_name):
    start_worker("--heartbeat-s", "60")  # tenants found at its beats alone: a minute's wait
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.infer("the default tenant's", timeout_s=30)  # the worker is up and idle
        time.sleep(0.5)
        took = []
        for tenant in ("new-1", "new-2"):
            started = time.monotonic()
            assert client.infer("a lone request", tenant=tenant, timeout_s=30).embedding is not None
            took.append(time.monotonic() - started)
    assert max(took) < 2.0, took  # linger (2 ms) + one batch, with room for a loaded machine
    assert r.xlen(keys.tenants_added(keys.QueueRef(queue_name))) == 2  # one entry per stream


def test_a_worker_reads_tenants_added_a_bounded_count_at_a_time(start_worker, r, queue_name):
    """A ``tenants:added`` written past enqueue.lua's MAXLEN (by hand): read 64 entries a call,
    never the whole stream into memory at once."""
    added = keys.tenants_added(keys.QueueRef(queue_name))
    with r.pipeline(transaction=False) as pipe:
        for i in range(6400):
            pipe.xadd(added, {"stream": f"junk-{i}"})
        pipe.execute()
    r.config_resetstat()
    start_worker()
    wait_for(lambda: int(r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0))
             >= 6400 // 64, 20, "the entries read 64 at a time")


def test_backlogged_tenants_past_the_lane_limit_take_turns_until_all_are_served(
        redis_url, queue_name, monkeypatch):
    """Five tenants with a backlog each, two lanes: lanes give their turn up after a
    heartbeat, once what they hold is answered, and every tenant is served."""
    import asyncio
    import threading

    from tokenq.worker.backends.sim import SimBackend
    from tokenq.worker.loop import tenants
    from tokenq.worker.loop.worker import Worker
    from tokenq.worker.settings import WorkerSettings

    monkeypatch.setattr(tenants, "MAX_TENANT_LANES", 2)
    settings = WorkerSettings(redis_url=redis_url, queue=queue_name, backend="sim",
                              heartbeat_s=0.3, block_ms=100, max_batch_tokens=256)
    worker = Worker(settings, SimBackend(batch_ms=100.0, max_input_tokens=64))
    thread = threading.Thread(target=asyncio.run, args=(worker.run(),))
    with Client(redis_url=redis_url, queue=queue_name) as client:
        ids = [request for t in range(5) for request in client.submit_many(
            [f"tenant {t} request {i} " + "word " * 20 for i in range(40)], tenant=f"t{t}")]
        thread.start()
        try:
            results = client.results(ids, timeout_s=30)
        finally:
            worker.stop()
            thread.join(30)
    assert all(result.embedding is not None for result in results)


def test_a_tenant_named_after_the_lane_cap_is_still_served(start_worker, redis_url, r,
                                                           queue_name):
    """Past MAX_TENANT_LANES tenant streams (one caller may name that many), streams with
    entries take turns at the lanes: a later tenant is read once an idle lane gives its up."""
    from tokenq.shared import functions

    q, enqueue = keys.QueueRef(queue_name), functions.Function(r, "enqueue")
    for i in range(MAX_TENANT_LANES):  # names that sort first, one tiny request each
        enqueue(keys=[keys.tenant_requests(q, f"-{i:03d}"), keys.tenants(q)],
                args=[0, 1, 0, 3, "v", "1", "id", f"h{i}", "text", "x"])
    start_worker()
    with Client(redis_url=redis_url, queue=queue_name) as client:
        wait_for(lambda: sum(r.xlen(keys.tenant_requests(q, f"-{i:03d}"))
                             for i in range(MAX_TENANT_LANES)) == 0, 30, "the first tenants served")
        assert client.infer("a later tenant", tenant="team-z", timeout_s=3).embedding is not None


# ------------------------------------------------------ idle tenant streams removed

def remove_idle(r: redis.Redis, q: keys.QueueRef, tenants: list[str], idle_ms: int = 0
                ) -> list[bytes]:
    from tokenq.shared import functions

    return functions.Function(r, "remove_idle_tenants")(
        keys=[keys.tenants(q), *(keys.tenant_requests(q, t) for t in tenants)],
        args=[keys.GROUP, idle_ms])


def test_only_an_idle_tenants_stream_with_nothing_unanswered_is_removed(
        redis_url, r, queue_name):
    """``remove_idle_tenants.lua`` removes a listed tenant stream only when empty, with none
    of it read and unanswered, and written last ``idle_ms`` ago: with its member of the set
    and its pending field; its next request registers and announces it again."""
    q = keys.QueueRef(queue_name)
    with Client(redis_url=redis_url, queue=queue_name, refuse_early=False) as client:
        for tenant in ("queued", "held", "recent", "done"):
            client.submit(f"a request of {tenant}", tenant=tenant)
    stream = {t: keys.tenant_requests(q, t) for t in ("queued", "held", "recent", "done")}
    for name in ("held", "done"):  # read by a worker; held's deleted but never answered
        r.xgroup_create(stream[name], keys.GROUP, id="0")
        [(_, [(entry_id, _)])] = r.xreadgroup(keys.GROUP, "w", {stream[name]: ">"})
        r.xdel(stream[name], entry_id)
        if name == "done":
            r.xack(stream[name], keys.GROUP, entry_id)
    r.xtrim(stream["recent"], maxlen=0)
    r.hset(keys.pending(q), mapping={"tokens:done": 5, "tokens:recent": 5})
    junk = [keys.requests(q), keys.config(q), keys.tenant_requests(q, "absent")]
    r.sadd(keys.tenants(q), *junk)
    r.hset(keys.config(q), "shards", "1")
    r.xgroup_create(keys.requests(q), keys.GROUP, id="0", mkstream=True)
    r.xadd(keys.tenant_requests(q, "unlisted"), {"v": "1"})
    r.xtrim(keys.tenant_requests(q, "unlisted"), maxlen=0)
    names = [*stream, "unlisted", "absent", "default"]
    # "recent" was written just now; a listed name with no stream is taken off the set
    assert remove_idle(r, q, names, idle_ms=60_000) == [junk[2].encode()]
    assert set(remove_idle(r, q, names)) == {stream["done"].encode(), stream["recent"].encode()}
    assert not r.exists(stream["done"], stream["recent"])
    assert r.exists(stream["queued"], stream["held"], keys.tenant_requests(q, "unlisted")) == 3
    assert r.hkeys(keys.pending(q)) and not {b"tokens:done", b"tokens:recent"} & set(
        r.hkeys(keys.pending(q)))
    assert r.smembers(keys.tenants(q)) == {
        stream["queued"].encode(), stream["held"].encode(), *(j.encode() for j in junk[:2])}
    assert r.exists(keys.requests(q), keys.config(q)) == 2  # junk in the set left alone
    added = r.xlen(keys.tenants_added(q))
    with Client(redis_url=redis_url, queue=queue_name, refuse_early=False) as client:
        client.submit("back again", tenant="done")
    assert r.sismember(keys.tenants(q), stream["done"]) and r.xlen(stream["done"]) == 1
    assert r.xlen(keys.tenants_added(q)) == added + 1  # announced again


def in_process_worker(redis_url: str, queue_name: str, **settings: object):
    """A sim worker run in a thread of this process (its state inspectable), and its thread."""
    import asyncio
    import threading

    from tokenq.worker.backends.sim import SimBackend
    from tokenq.worker.loop.worker import Worker
    from tokenq.worker.settings import WorkerSettings

    worker = Worker(WorkerSettings(redis_url=redis_url, queue=queue_name, backend="sim",
                                   heartbeat_s=0.2, block_ms=100, **settings),
                    SimBackend(batch_ms=1.0, max_input_tokens=64))
    thread = threading.Thread(target=asyncio.run, args=(worker.run(),))
    thread.start()
    return worker, thread


def test_tenants_past_the_lane_cap_named_once_are_gone_from_redis_and_the_worker_once_idle(
        redis_url, r, queue_name):
    """Every name used costs Redis a set member, a stream and a group, and a worker its lane
    and fair-share state, only until it is idle ``tenant_idle_s``; more names than a worker
    has lanes (they take turns)."""
    q = keys.QueueRef(queue_name)
    named = MAX_TENANT_LANES + 44
    with Client(redis_url=redis_url, queue=queue_name, refuse_early=False) as client:
        ids = [client.submit(f"once {i}", tenant=f"t{i:04d}") for i in range(named)]
    assert r.scard(keys.tenants(q)) == named == len(r.keys(f"{q.tag}:requests:*"))
    worker, thread = in_process_worker(redis_url, queue_name, tenant_idle_s=1.0)
    try:
        with Client(redis_url=redis_url, queue=queue_name) as client:
            assert all(result.embedding is not None
                       for result in client.results(ids, timeout_s=90))
            wait_for(lambda: r.scard(keys.tenants(q)) == 0, 30, "the idle streams removed")
            assert not r.keys(f"{q.tag}:requests:*")
            assert not [f for f in r.hkeys(keys.pending(q)) if f.startswith(b"tokens:")]
            wait_for(lambda: len(worker.lanes) == 1 and worker.lanes.fair.known() <= {
                keys.DEFAULT_TENANT}, 30, "the worker's lanes and fair-share state dropped")
            assert client.infer("still served", tenant="t0007", timeout_s=30).embedding is not None
    finally:
        worker.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_a_tenant_enqueuing_while_its_stream_is_removed_loses_nothing(
        redis_url, r, queue_name):
    """Its stream removed as soon as it is empty, over and over, while the tenant sends one
    request after another: each lands before the removal (kept) or after (registered
    again, its group made again from id 0, by a worker whose lane lost the stream)."""
    import threading

    q = keys.QueueRef(queue_name)
    worker, thread = in_process_worker(redis_url, queue_name)
    stop, removals = threading.Event(), []

    def sweep() -> None:
        with redis.Redis.from_url(redis_url) as sweeper:
            while not stop.is_set():
                removals.extend(remove_idle(sweeper, q, ["racing"]))

    sweeper = threading.Thread(target=sweep)
    try:
        with Client(redis_url=redis_url, queue=queue_name) as client:
            client.infer("the worker is up", timeout_s=30)
            sweeper.start()
            took = []
            for i in range(60):
                started = time.monotonic()
                result = client.infer(f"request {i}", tenant="racing", timeout_s=30)
                assert result.embedding is not None
                took.append(time.monotonic() - started)
    finally:
        stop.set()
        if sweeper.is_alive():
            sweeper.join(10)
        worker.stop()
        thread.join(30)
    assert len(removals) >= 10, len(removals)  # the race ran: removed between requests
    assert max(took) < 5.0, took


def test_a_tenant_with_an_unanswered_entry_is_never_removed_by_a_worker(
        start_worker, redis_url, r, queue_name):
    """A sweeping worker (``--tenant-idle-s`` short) leaves an empty stream whose entry a live
    worker read and has not answered, and removes it once that entry is answered."""
    q = keys.QueueRef(queue_name)
    stream = keys.tenant_requests(q, "t")
    with Client(redis_url=redis_url, queue=queue_name, refuse_early=False) as client:
        client.submit("held by a live worker", tenant="t")
        r.xgroup_create(stream, keys.GROUP, id="0")
        [(_, [(entry_id, _)])] = r.xreadgroup(keys.GROUP, "ghost", {stream: ">"})
        r.xdel(stream, entry_id)  # deleted, not answered: the stream is empty
        r.set(keys.worker_alive(q, "ghost"), "1", px=60_000)  # alive: nobody takes it over
        start_worker("--tenant-idle-s", "0.2", "--claim-idle-s", "3600")
        time.sleep(3.0)  # two sweeps (every 5 heartbeats of 0.3 s)
        assert r.sismember(keys.tenants(q), stream) and r.exists(stream)
        assert r.xpending(stream, keys.GROUP)["pending"] == 1
        r.xack(stream, keys.GROUP, entry_id)  # answered at last
    wait_for(lambda: not r.exists(stream) and not r.scard(keys.tenants(q)), 10,
             "the answered stream removed")
