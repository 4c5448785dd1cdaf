"""The hardening promises, tried by an adversary where the other tests do not
reach.

Each test here attacks one promise of docs/RELIABILITY.md or docs/SECURITY.md
with a fault injected into a real redis-server (frozen by SIGSTOP, filled to
``maxmemory``, running a long script) or a hostile caller, where no other
test tries it:

* a Redis frozen for longer than the Redis stages' deadline must not make a
  worker "hung" (RELIABILITY: Redis being away is not a liveness failure);
* a publish refused with ``BUSY`` (someone's long script) keeps its answers;
* a ``reply_to`` Redis refuses (another type, outside the worker's ACL)
  while Redis is also full is neither dead-lettered nor dropped until memory
  frees, then settled exactly once;
* a retired lane's removal refused for lack of memory loses nothing and is
  done once memory frees;
* a producer under the documented ACL calling the worker's functions with keys
  of its choosing gains nothing it could not do itself;
* a time setting Redis takes in whole milliseconds is refused below 1 ms (it
  was taken as 0 ms: a fix), and its floor works;
* a retired lane whose removal Redis refuses for good does not keep the worker
  unready (a fix); a hostile ``shards_served`` record is bounded at join;
* a sharded enqueue at ``maxmemory`` writes nothing on any shard;
* ``tokenq functions load`` against a Cluster loads every primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pydantic
import pytest
import redis
import redis.asyncio as aioredis

from tests.cli_support import FAST_BEAT
from tests.faults.test_acl import create_users, user_url
from tests.faults.test_faults import SIM, pending_of
from tests.faults.test_redis_refuses import _pending_answers, _publisher
from tests.redis_cluster import LocalCluster, redis_cluster  # noqa: F401
from tests.redis_full import fill, free, full_server
from tests.redis_server import RedisServer, free_ports, freezable_server
from tests.worker.test_health import LOCAL, get
from tests.workers import Fleet
from tokenq.producer import BrokerOutOfMemory, Client
from tokenq.producer.ops import functions as functions_cli
from tokenq.shared import functions, keys
from tokenq.shared.settings import ClientSettings
from tokenq.worker.loop.lanes import Lane, Retirement
from tokenq.worker.settings import WorkerSettings

# ---------------------------------------------- a frozen Redis is not a hung worker


@pytest.fixture
def private_fleet(
    worker_env: dict[str, str], tmp_path: Path
) -> Iterator[tuple[Fleet, RedisServer]]:
    """Workers on a redis-server of this test's own, which it may freeze (SIGSTOP)."""
    with freezable_server(tmp_path / "freezable") as server:
        group = Fleet({**worker_env, "TOKENQ_REDIS_URL": server.url}, tmp_path, SIM)
        try:
            yield group, server
        finally:
            group.close()


@pytest.mark.parametrize("shards", ["1", "3"])
def test_redis_frozen_past_the_redis_stage_deadline_does_not_make_the_worker_hung(
    private_fleet, worker_env, shards
) -> None:
    """RELIABILITY, "Stage deadlines": the read and publish deadline is twice what
    redis-py can take for one call, "so this never fires for Redis being away".
    With ``--socket-timeout-s 0.5 --retries 0 --block-ms 100`` that deadline is
    2.2 s; Redis is frozen for 4 s with the worker idle on a blocking read and
    again with a request being answered. The worker must stay alive (``/livez``
    200, no exit 3) and answer once Redis thaws; with three shards, three reads (and
    their reclaim scans) wait on the frozen Redis at once."""
    fleet, server = private_fleet
    queue = worker_env["TOKENQ_QUEUE"]
    port = free_ports()
    client = redis.Redis(port=server.port, socket_timeout=10)
    worker = fleet.start("--socket-timeout-s", "0.5", "--retries", "0", "--block-ms", "100",
                         "--shards", shards, *FAST_BEAT, "--metrics-port", str(port), *LOCAL,
                         ready=client, queue=queue)
    try:
        with Client(redis_url=server.url, queue=queue, timeout_s=30) as producer:
            for answering in (False, True):
                request_id = producer.submit("frozen while answered") if answering else None
                os.kill(server.process.pid, signal.SIGSTOP)
                try:
                    deadline = time.monotonic() + 4.0
                    while time.monotonic() < deadline:
                        status, body = get(port, "/livez")
                        assert status == 200, (body, worker.output()[-3000:])
                        assert worker.process.poll() is None, worker.output()[-3000:]
                        time.sleep(0.5)
                finally:
                    os.kill(server.process.pid, signal.SIGCONT)
                if request_id is not None:
                    assert producer.result(request_id).embedding is not None
                assert producer.infer("thawed") is not None
        assert worker.process.poll() is None
        assert "hung" not in worker.output()
    finally:
        client.close()


# ------------------------------------------------------- publishing while Redis refuses


@pytest.fixture
def full(tmp_path: Path) -> Iterator[tuple[RedisServer, redis.Redis]]:
    """A private redis-server with a small maxmemory and noeviction; (server, admin)."""
    with full_server(tmp_path / "full") as server:
        admin = redis.Redis(port=server.port, socket_timeout=10)
        yield server, admin
        admin.close()


def _settled_once(r: redis.Redis, q: keys.QueueRef, replied: list[int]) -> None:
    """Nothing pending or left in the stream; one reply (with a TTL) for each of ``replied``."""
    assert pending_of(r, q) == 0 and r.xlen(keys.requests(q)) == 0
    for i in replied:
        key = keys.reply(q, f"r{i}")
        assert r.lrange(key, 0, -1) == [f"reply {i}".encode()]
        assert r.pttl(key) > 0


def test_a_publish_refused_busy_keeps_its_answers_until_the_script_ends(full) -> None:
    """Someone's long script makes Redis answer ``BUSY`` to everything else. The publish
    must fail as a whole (nothing acked, nothing dead-lettered), be retried, report
    ``busy``, and land exactly once after ``SCRIPT KILL``."""
    server, r = full
    q = keys.QueueRef("busy")
    n = 8
    answers = _pending_answers(r, q, n, "reply")
    r.config_set("busy-reply-threshold", 50)
    refused: list[str] = []
    spinner_done = threading.Event()

    def spin() -> None:
        spinner = redis.Redis(port=server.port, socket_timeout=30)
        try:
            with contextlib.suppress(redis.exceptions.ResponseError):
                spinner.eval("while true do end", 0)
        finally:
            spinner.close()
            spinner_done.set()

    async def scenario() -> int:
        client = aioredis.Redis(port=server.port, socket_timeout=10)
        try:
            publisher = _publisher(client, q, refused=refused)
            threading.Thread(target=spin, daemon=True).start()
            await asyncio.sleep(0.3)
            task = asyncio.create_task(publisher.publish(answers, max_backoff_s=0.2))
            await asyncio.sleep(1.0)
            assert not task.done(), "publish gave up while Redis was busy"
            r.script_kill()
            assert spinner_done.wait(10)
            return await asyncio.wait_for(task, 20)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == n
    assert refused and set(refused) == {"busy"}
    assert r.xlen(keys.dead(q)) == 0
    _settled_once(r, q, list(range(n)))


def test_reply_to_keys_that_refuse_are_not_settled_while_redis_is_full(full) -> None:
    """A batch with a ``reply_to`` of another type (WRONGTYPE) and one outside the worker's
    documented ACL (NOPERM, which Redis checks before memory) while Redis is also full.
    RELIABILITY: a refusal of the second kind fails the whole call, so nothing may be
    dead-lettered or acked until memory frees; then the two refusing keys are
    dead-lettered once each (``bad_request``) and every other answer replied once."""
    server, admin = full
    queue, password = "oomacl", "pw-oomacl"
    create_users(admin, queue, password)
    q = keys.QueueRef(queue)
    n = 6
    answers = _pending_answers(admin, q, n, "reply")
    wrong_type, foreign = keys.reply(q, "a-string"), "elsewhere:not-tokenq"
    admin.set(wrong_type, b"not a list")
    answers[1] = dataclasses.replace(answers[1], reply_to=wrong_type)
    answers[4] = dataclasses.replace(answers[4], reply_to=foreign)
    refused: list[str] = []

    async def scenario() -> int:
        client = aioredis.Redis.from_url(user_url(server, f"{queue}-worker", password),
                                         socket_timeout=10)
        try:
            await functions.async_load(client)
            publisher = _publisher(client, q, refused=refused)
            fill(admin)
            task = asyncio.create_task(publisher.publish(answers, max_backoff_s=0.2))
            await asyncio.sleep(1.0)
            assert not task.done(), "publish gave up on a full Redis"
            assert pending_of(admin, q, "c1") == n, "entries were settled while Redis refused"
            assert admin.xlen(keys.dead(q)) == 0
            free(admin)
            return await asyncio.wait_for(task, 20)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == n
    assert "oom" in refused
    letters = admin.xrange(keys.dead(q))
    assert sorted(fields[b"id"] for _, fields in letters) == [b"r1", b"r4"]
    assert {fields[b"dead_error_code"] for _, fields in letters} == {b"bad_request"}
    assert admin.get(wrong_type) == b"not a list" and not admin.exists(foreign)
    _settled_once(admin, q, [0, 2, 3, 5])


# ----------------------------------------------------------- retired lanes at maxmemory


def test_a_retired_lane_removal_refused_for_memory_loses_nothing_and_happens_later(full) -> None:
    """``remove_retired.lua`` only deletes, yet Redis 7 refuses a function that may write
    before it runs when memory is full. A drained retired lane must then stay (its
    stream, its marker, the record of the count served) and be removed at a later beat
    once memory frees, never half-removed."""
    _, r = full
    q = keys.QueueRef("shrunk")
    retirement = Retirement(q, 2)
    r.set(keys.shards_served(q), "3")
    gone = keys.QueueRef(q.name, q.prefix, 2)
    r.xgroup_create(keys.requests(gone), keys.GROUP, id="0", mkstream=True)
    r.hset(keys.config(gone), "shards", "3")

    async def scenario() -> None:
        client = aioredis.Redis(port=r.connection_pool.connection_kwargs["port"],
                                socket_timeout=10)
        try:
            assert await retirement.join(client) == [gone]
            lane = Lane(0, gone, None, None, None, retired=True)  # type: ignore[arg-type]
            fill(r)
            with contextlib.suppress(redis.exceptions.RedisError):  # the beat logs it
                assert await retirement.tend(client, [lane], "c1") == []
            assert r.exists(keys.requests(gone), keys.retired(gone), keys.config(gone)) == 3
            assert r.get(keys.shards_served(q)) == b"3"
            free(r)
            assert await retirement.tend(client, [lane], "c1") == [lane]
        finally:
            await client.aclose()

    asyncio.run(scenario())
    assert not r.exists(keys.requests(gone), keys.config(gone), keys.shards_served(q))
    assert r.get(keys.retired(gone)) == b"2"


# ----------------------------------------------- a producer calling the worker's functions


def test_a_producer_calling_the_workers_functions_with_its_own_keys_gains_nothing(
    tmp_path: Path,
) -> None:
    """SECURITY: tokenq's functions run under the caller's ACL, "so calling a worker's
    function gets a producer nothing it could not do itself". ``remove_retired``
    deletes four of its keys once the marker is present and XPENDING (which a
    producer may not run; the script ``pcall``s it) says nothing; a producer passing
    the worker's hashes in place of its own keys must be refused, whatever it passes,
    and the worker's keys must survive. The existing test calls ``publish`` and
    ``drop_consumer`` with the worker's keys (refused on the keys); here they get keys
    the producer may pass to FCALL, and must still stop at a command it may not run
    there (``XPENDING``, ``EXISTS`` on a seen key), settling nothing."""
    server = RedisServer(tmp_path / "acl")
    server.start()
    try:
        admin = redis.Redis(port=server.port, socket_timeout=10)
        queue, password = "fcalls", "pw-fcalls"
        create_users(admin, queue, password)
        functions.load(admin)
        q = keys.QueueRef(queue)
        admin.hset(keys.config(q), "shards", "1")
        admin.hset(keys.workers(q), "w", b"row")
        admin.xgroup_create(keys.requests(q), keys.GROUP, id="0", mkstream=True)
        admin.xadd(keys.dead(q), {"id": "letter"})
        producer = redis.Redis.from_url(user_url(server, f"{queue}-producer", password),
                                        socket_timeout=10)
        name = functions.lua_scripts.library().functions["remove_retired"]
        admin.set(keys.retired(q), "1")  # a producer may only read the marker
        worker_keys = [keys.dead(q), keys.workers(q), keys.config(q)]
        for swapped in range(3):
            names = [keys.requests(q), keys.seen(q, "x"), keys.retired(q),
                     keys.seen(q, "y"), keys.seen(q, "z")]
            names[[1, 3, 4][swapped]] = worker_keys[swapped]
            with pytest.raises(redis.exceptions.NoPermissionError):
                producer.fcall(name, 5, *names, keys.GROUP)
        # The worker's other functions with the producer's own keys in place of the
        # worker's: each stops at a command the producer may not run.
        entry = admin.xadd(keys.requests(q), {"id": "mine"})
        admin.xreadgroup(keys.GROUP, "w", {keys.requests(q): ">"})
        swapped_calls = {
            "publish": (2, keys.requests(q), keys.seen(q, "x"), keys.GROUP, "w", 1000, 10,
                        100, 1, entry, 0, b"", 0),
            "drop_consumer": (3, keys.requests(q), keys.seen(q, "a"), keys.seen(q, "b"),
                              keys.GROUP, "w"),
        }
        for short, call in swapped_calls.items():
            with pytest.raises(redis.exceptions.ResponseError,
                               match=r"(?i)can.t (run this command|access at least one)"):
                producer.fcall(functions.lua_scripts.library().functions[short], *call)
        assert admin.xpending(keys.requests(q), keys.GROUP)["pending"] == 1
        assert admin.exists(keys.requests(q), keys.dead(q), keys.workers(q),
                            keys.config(q)) == 4
        assert admin.xinfo_groups(keys.requests(q))
        producer.close()
        admin.close()
    finally:
        server.stop()


# ------------------------------------------------------ settings at their lowest bound


@pytest.mark.parametrize(("settings_cls", "name"), [
    (WorkerSettings, "reply_ttl_s"),
    (WorkerSettings, "claim_idle_s"),
    (WorkerSettings, "heartbeat_s"),
    (ClientSettings, "dedupe_ttl_s"),
])
def test_a_time_redis_would_get_as_zero_milliseconds_is_refused_where_it_enters(
    settings_cls, name
) -> None:
    """Every setting is bounded where it enters. These three reach Redis as
    whole milliseconds (``int(s * 1000)``), and ``gt=0`` would let 0.0004 through as 0 ms:
    a ``reply_ttl_s`` of 0 ms makes ``publish.lua`` refuse every call, which the worker
    reads as "Redis refuses writes now" and retries for ever (no answer is ever
    published); a ``claim_idle_s`` of 0 ms claims every peer's pending entry at each
    scan (work computed twice); a ``dedupe_ttl_s`` of 0 ms turns dedupe off without a
    word; a ``heartbeat_s`` of 0.0003 gives the liveness key ``SET PX 0``, refused at
    every beat, so peers take all of the worker's work. Each must be refused with one
    line naming the setting, and its smallest whole millisecond taken."""
    with pytest.raises(pydantic.ValidationError, match=name):
        settings_cls(**{name: 0.0003})
    assert getattr(settings_cls(**{name: 0.001}), name) == 0.001


def test_the_smallest_reply_ttl_reaches_the_reply(redis_url, r, queue_name) -> None:
    """``reply_ttl_s`` at its floor (1 ms) is published, not refused and retried."""
    q = keys.QueueRef(queue_name)
    answers = _pending_answers(r, q, 2, "reply")
    ttl_ms = int(WorkerSettings(reply_ttl_s=0.001).reply_ttl_s * 1000)

    async def scenario() -> int:
        client = aioredis.Redis.from_url(redis_url)
        try:
            publisher = _publisher(client, q, reply_ttl_ms=ttl_ms)
            return await asyncio.wait_for(publisher.publish(answers, max_backoff_s=0.1), 5)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == 2
    assert pending_of(r, q) == 0


def test_a_publish_refused_read_only_keeps_its_answers_until_promotion(tmp_path: Path) -> None:
    """A failover demotes the primary a worker publishes to: every publish is refused
    ``READONLY``. The answers and their pending entries must be kept (not dead-lettered
    as "reply_to refused"), the refusal reported as ``readonly``, and each answer land
    exactly once when the server is promoted again."""
    server = RedisServer(tmp_path / "demoted")
    server.start()
    r = redis.Redis(port=server.port, socket_timeout=10)
    q = keys.QueueRef("demoted")
    n = 5
    refused: list[str] = []
    try:
        answers = _pending_answers(r, q, n, "letter and reply")
        functions.load(r)
        r.replicaof("127.0.0.1", str(free_ports()))  # keeps its data, refuses writes

        async def scenario() -> int:
            client = aioredis.Redis(port=server.port, socket_timeout=10)
            try:
                publisher = _publisher(client, q, refused=refused)
                task = asyncio.create_task(publisher.publish(answers, max_backoff_s=0.2))
                await asyncio.sleep(1.0)
                assert not task.done(), "publish gave up on a read-only replica"
                assert pending_of(r, q, "c1") == n and r.xlen(keys.dead(q)) == 0
                r.replicaof("NO", "ONE")
                return await asyncio.wait_for(task, 20)
            finally:
                await client.aclose()

        assert asyncio.run(scenario()) == n
        assert refused and set(refused) == {"readonly"}
        assert r.xlen(keys.dead(q)) == n
        _settled_once(r, q, list(range(n)))
    finally:
        r.close()
        server.stop(kill=True)


def test_a_sharded_enqueue_into_a_full_redis_writes_nothing_on_any_shard(full) -> None:
    """The all-or-nothing enqueue at ``maxmemory``, on a queue of three shards (a shard
    per call, the retired-shard key among the script's keys): ``BrokerOutOfMemory``,
    no entry and no seen key on any lane; once memory frees the same batches go."""
    server, r = full
    q = keys.QueueRef("oomshards")
    settings_ = ClientSettings(redis_url=server.url, queue=q.name, shards=3, timeout_s=5)
    lanes = keys.lanes_of(q, 3)
    with Client(settings=settings_) as client:
        fill(r)
        for _ in range(3):  # round robin: each shard in turn
            with pytest.raises(BrokerOutOfMemory, match="out of memory"):
                client.submit_many([f"text {i}" for i in range(20)])
        assert sum(r.xlen(keys.requests(lane)) for lane in lanes) == 0
        assert not [key for lane in lanes for key in r.scan_iter(match=keys.seen(lane, "*"))]
        free(r)
        for _ in range(3):
            assert len(client.submit_many([f"text {i}" for i in range(20)])) == 20
    assert sum(r.xlen(keys.requests(lane)) for lane in lanes) == 60


# --------------------------------------------------- readiness and a retired lane's tidy-up


def test_a_retired_lane_that_cannot_be_removed_does_not_make_the_worker_unready(
    private_fleet, worker_env
) -> None:
    """``/readyz`` means "this worker is taking work". A retired shard whose removal Redis
    refuses for good (its dead key is not a stream: WRONGTYPE in ``remove_retired``'s
    ``XLEN``) must not keep every beat "failed" and the worker unready for ever while
    it takes and answers work on its own shards."""
    fleet, server = private_fleet
    queue = worker_env["TOKENQ_QUEUE"]
    q = keys.QueueRef(queue)
    r = redis.Redis(port=server.port, socket_timeout=10)
    retired = keys.QueueRef(q.name, q.prefix, 2)
    r.set(keys.shards_served(q), "3")
    r.xgroup_create(keys.requests(retired), keys.GROUP, id="0", mkstream=True)
    r.set(keys.dead(retired), b"not a stream")
    port = free_ports()
    try:
        worker = fleet.start("--shards", "2", *FAST_BEAT, "--metrics-port", str(port), *LOCAL,
                             ready=r, queue=queue)
        with Client(redis_url=server.url, queue=queue, timeout_s=20) as producer:
            assert producer.infer("taken on a current shard") is not None
        time.sleep(2.0)  # four beats, each tending the retired lane
        status, body = get(port, "/readyz")
        assert status == 200, body
        assert worker.output().count("cannot remove the drained retired shard") == 1
        assert r.exists(keys.requests(retired))
    finally:
        r.close()


@pytest.mark.parametrize("recorded", ["9" * 40, "255", "\u0661\u0662", "-3", "1e9"])
def test_a_hostile_shards_served_record_is_bounded_at_join(r, redis_url, queue_name,
                                                           recorded) -> None:
    """``shards_served`` (and the config hash's ``shards``) are read at every join: a
    record of 10**40 lanes, Unicode digits or a negative count must neither make a
    worker read or mark lanes past ``MAX_SHARDS`` nor take long; the only lanes it
    reads are retired shards that have a stream."""
    q = keys.QueueRef(queue_name)
    r.set(keys.shards_served(q), recorded)
    r.hset(keys.config(q), "shards", recorded)
    stranded = keys.QueueRef(q.name, q.prefix, 7)
    r.xgroup_create(keys.requests(stranded), keys.GROUP, id="0", mkstream=True)

    async def join() -> list[keys.QueueRef]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await Retirement(q, 2).join(client)
        finally:
            await client.aclose()

    started = time.monotonic()
    found = asyncio.run(join())
    assert time.monotonic() - started < 5
    numeric = recorded.isascii() and recorded.isdigit()
    assert found == ([stranded] if numeric else [])
    markers = list(r.scan_iter(match=keys.retired(keys.QueueRef(q.name, q.prefix, 0))
                               .replace(":0}", ":*}"), count=1000))
    assert len(markers) <= keys.MAX_SHARDS - 2


# ------------------------------------------------------ `tokenq functions load`, a Cluster


def test_tokenq_functions_load_against_a_cluster_loads_every_primary(
    redis_cluster: LocalCluster, capsys: pytest.CaptureFixture[str],  # noqa: F811
) -> None:
    """SECURITY: an admin runs ``tokenq functions load`` for producers that start before
    any worker. Against a ``redis+cluster://`` URL the command (not only the worker's
    client) must load the library on every primary, or producers whose queue hashes to
    a slot of another primary find nothing to FCALL."""
    admin = redis_cluster.client()
    try:
        admin.function_flush()  # every primary
        assert functions_cli.main(["load", "--redis-url", redis_cluster.url]) == 0
        assert functions.lua_scripts.library().name in capsys.readouterr().out
        for port in redis_cluster.masters():
            node = redis.Redis(port=port, socket_timeout=10)
            try:
                names = [dict(zip(lib[::2], lib[1::2], strict=True))[b"library_name"]
                         for lib in node.function_list()]
            finally:
                node.close()
            assert functions.lua_scripts.library().name.encode() in names, port
    finally:
        admin.close()
