"""tokenq's Redis clients against a real Redis Cluster and a real Sentinel group.

Each of the producer's clients (sync, async command and listener), the
worker's ``connect()`` and the operator commands' client is built from a
``redis+cluster://`` and a ``redis+sentinel://`` URL and driven through what
tokenq sends: SET/GET, a registered script (EVALSHA) on keys of one slot,
XADD/XREADGROUP (blocking too), MULTI pipelines. The fault tests kill or
freeze the node a key lives on and check that a caller's deadline still
bounds the call, and that redis-py finds the new master afterwards.

What redis-py's cluster pipeline does with a script and with WAIT is pinned
here too: tokenq's durable enqueue (script, then WAIT, on one connection)
must be written for it (see the two ``pipeline_*`` tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.backoff
import redis.retry

from tests.redis_cluster import redis_cluster, redis_sentinel  # noqa: F401
from tokenq.producer import redis_deadlines as connection
from tokenq.producer.ops import snapshot
from tokenq.producer.redis_deadlines import (
    REDIS_DOWN,
    DeadlineTimeouts,
    LazyCluster,
    async_redis,
    for_caller,
    sync_client_for,
    sync_redis,
)
from tokenq.shared import keys
from tokenq.shared.failures import CommandFailed
from tokenq.shared.flags import UsageError
from tokenq.shared.packing import takes_packed
from tokenq.shared.settings import ClientSettings
from tokenq.worker.redis_connect import HiredisPacking
from tokenq.worker.redis_connect import connect as worker_connect
from tokenq.worker.settings import WorkerSettings

INCR_BOTH = """
local a = redis.call('INCRBY', KEYS[1], ARGV[1])
local b = redis.call('INCRBY', KEYS[2], ARGV[1])
return {a, b}
"""
"""A script touching two keys, which a cluster allows only when they share a slot."""

CLIENT_ID = "0123456789abcdef0123"
DEADLINE_S = 1.0
BOUND_S = 3.0
"""A call with a 1 s deadline must be over by then, node dead or frozen. Unbounded, the
same call waits out 50 retries of a 5 s socket timeout; the slack over the deadline is
for a loaded CI machine (2.13 s was seen at load 11 on 2 cores)."""


@dataclass
class Target:
    kind: str  # "cluster" or "sentinel"
    url: str
    group: Any  # LocalCluster or LocalSentinel


@pytest.fixture(params=["cluster", "sentinel"])
def target(request: pytest.FixtureRequest) -> Target:
    group = request.getfixturevalue(f"redis_{request.param}")
    return Target(request.param, group.url, group)


def client_settings(url: str, **fields: Any) -> ClientSettings:
    """Settings with a cluster or Sentinel URL; ``model_copy`` because the settings'
    URL check does not accept those schemes yet (the clients are built from the field)."""
    return ClientSettings(**fields).model_copy(update={"redis_url": url})


def worker_settings(url: str) -> WorkerSettings:
    return WorkerSettings(queue="q", backend="sim").model_copy(update={"redis_url": url})


def slot_keys(*names: str) -> list[str]:
    """Fresh keys that share the ``{q:1}`` hash tag (one slot)."""
    run = uuid.uuid4().hex[:8]
    return [f"{{q:1}}:{name}:{run}" for name in names]


def durable(client: Any, key: str) -> Any:
    """WAIT for a replica on the connection that wrote ``key`` (see the WAIT test)."""
    if isinstance(client, LazyCluster | redis.RedisCluster):
        return client.execute_command("WAIT", 1, 2000, target_nodes=client.get_node_from_key(key))
    return client.execute_command("WAIT", 1, 2000)


def process_id(port: int) -> int:
    with redis.Redis(port=port, socket_timeout=2) as r:
        return int(r.info("server")["process_id"])


@contextlib.contextmanager
def frozen(port: int) -> Iterator[None]:
    """SIGSTOP the server on ``port``: it accepts connections and never answers."""
    pid = process_id(port)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def timed_call(call: Any) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        call()
    except Exception as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


async def timed_await(make: Any) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        await make()
    except Exception as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


def assert_bounded(took: float, error: BaseException | None, what: str) -> None:
    assert took < BOUND_S, f"{what} took {took:.2f} s with a {DEADLINE_S} s deadline ({error!r})"
    if error is not None:
        assert isinstance(error, REDIS_DOWN), f"{what}: {error!r}"


# ------------------------------------------------------------- sync client


def test_the_sync_client_runs_what_tokenq_sends(target: Target) -> None:
    r = sync_redis(client_settings(target.url), CLIENT_ID, None)
    try:
        one, two, stream = slot_keys("a", "b", "requests")
        expected = LazyCluster if target.kind == "cluster" else redis.Redis
        assert isinstance(r, expected)
        assert r.set(one, "1") and r.get(one) == b"1"
        script = r.register_script(INCR_BOTH)
        assert script(keys=[one, two], args=[2]) == [3, 2]
        with r.pipeline(transaction=True) as pipe:
            pipe.incr(one)
            pipe.incr(two)
            assert pipe.execute() == [4, 3]
        entry = r.xadd(stream, {"x": "1"})
        r.xgroup_create(stream, keys.GROUP, id="0")
        assert r.xreadgroup(keys.GROUP, "c", {stream: ">"}, count=10) == [
            [stream.encode(), [(entry, {b"x": b"1"})]]]
        started = time.monotonic()
        assert not r.xreadgroup(keys.GROUP, "c", {stream: ">"}, count=1, block=300)
        assert time.monotonic() - started >= 0.25
        later = threading.Timer(0.2, lambda: r.xadd(stream, {"x": "2"}))
        later.start()
        try:
            got = r.xreadgroup(keys.GROUP, "c", {stream: ">"}, count=1, block=5000)
        finally:
            later.join()
        assert got[0][1][0][1] == {b"x": b"2"}
        assert r.client_getname() == f"tokenq-producer-{CLIENT_ID[:12]}"
        assert durable(r, one) == 1
    finally:
        r.close()


def test_the_sync_cluster_pools_are_bounded_and_capped_per_node(redis_cluster) -> None:  # noqa: F811
    r = sync_redis(client_settings(redis_cluster.url), CLIENT_ID, 3)
    try:
        r.ping(target_nodes=redis.RedisCluster.ALL_NODES)
        for node in r.get_nodes():
            pool = node.redis_connection.connection_pool
            assert isinstance(pool, redis.BlockingConnectionPool) and pool.max_connections == 3
            assert issubclass(pool.connection_class, DeadlineTimeouts)
    finally:
        r.close()


def test_the_sync_sentinel_pool_is_bounded_and_capped(redis_sentinel) -> None:  # noqa: F811
    r = sync_redis(client_settings(redis_sentinel.url), CLIENT_ID, 3)
    try:
        assert r.ping()
        pool = r.connection_pool
        assert isinstance(pool, redis.BlockingConnectionPool) and pool.max_connections == 3
        assert issubclass(pool.connection_class, redis.sentinel.SentinelManagedConnection)
        assert issubclass(pool.connection_class, DeadlineTimeouts)
        for sentinel in pool.sentinel_manager.sentinels:
            assert issubclass(sentinel.connection_pool.connection_class, DeadlineTimeouts)
    finally:
        r.close()


# ------------------------------------------------------------ async client


def test_the_async_clients_run_what_tokenq_sends(target: Target) -> None:
    async def main() -> None:
        command, listener = async_redis(client_settings(target.url), CLIENT_ID, 4)
        try:
            one, two, stream, replies = slot_keys("a", "b", "requests", "reply")
            assert await command.set(one, "1") and await listener.get(one) == b"1"
            script = command.register_script(INCR_BOTH)
            assert await script(keys=[one, two], args=[2]) == [3, 2]
            async with command.pipeline(transaction=True) as pipe:
                pipe.incr(one)
                pipe.incr(two)
                assert await pipe.execute() == [4, 3]
            await command.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)

            async def add_later() -> None:
                await asyncio.sleep(0.2)
                await command.xadd(stream, {"x": "2"})

            async def push_later() -> None:
                await asyncio.sleep(0.2)
                await command.rpush(replies, b"r")

            adding = asyncio.create_task(add_later())
            got = await command.xreadgroup(keys.GROUP, "c", {stream: ">"}, count=1, block=5000)
            await adding
            assert got[0][1][0][1] == {b"x": b"2"}
            # The listener's wait: BLMOVE on the reply key, woken by a push.
            pushing = asyncio.create_task(push_later())
            assert await listener.blmove(replies, replies, 5, "LEFT", "RIGHT") == b"r"
            await pushing
            assert await command.client_getname() == f"tokenq-producer-{CLIENT_ID[:12]}"
            assert await adurable(command, one) == 1
        finally:
            await listener.aclose()
            await command.aclose()

    asyncio.run(main())


async def adurable(client: Any, key: str) -> Any:
    if isinstance(client, redis.asyncio.RedisCluster):
        node = client.get_node_from_key(key)
        return await client.execute_command("WAIT", 1, 2000, target_nodes=node)
    return await client.execute_command("WAIT", 1, 2000)


def test_the_async_cluster_nodes_are_bounded_and_capped(redis_cluster) -> None:  # noqa: F811
    async def main() -> None:
        command, listener = async_redis(client_settings(redis_cluster.url), CLIENT_ID, 3)
        try:
            for client, cap in ((command, 3), (listener, 1)):
                await client.ping(target_nodes=redis.asyncio.RedisCluster.ALL_NODES)
                for node in client.get_nodes():
                    assert node.max_connections == cap
                    assert issubclass(node.connection_class, DeadlineTimeouts)
        finally:
            await listener.aclose()
            await command.aclose()

    asyncio.run(main())


# ------------------------------------------------------------------ worker


def test_the_workers_client_runs_what_the_worker_sends(target: Target) -> None:
    async def main() -> None:
        client = worker_connect(worker_settings(target.url))
        try:
            one, two, stream = slot_keys("a", "b", "requests")
            script = client.register_script(INCR_BOTH)
            assert await script(keys=[one, two], args=[5]) == [5, 5]
            async with client.pipeline(transaction=True) as pipe:
                pipe.incr(one)
                pipe.expire(two, 60)
                assert (await pipe.execute())[0] == 6
            await client.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
            started = time.monotonic()
            assert not await client.xreadgroup(keys.GROUP, "w", {stream: ">"}, count=8,
                                               block=300)
            assert time.monotonic() - started >= 0.25
            await client.xadd(stream, {"x": "1"})
            got = await client.xreadgroup(keys.GROUP, "w", {stream: ">"}, count=8, block=300)
            assert got[0][1][0][1] == {b"x": b"1"}
            if isinstance(client, redis.asyncio.RedisCluster):
                classes = [node.connection_class for node in client.get_nodes()]
            else:
                classes = [client.connection_pool.connection_class]
            assert classes and all(issubclass(c, HiredisPacking) for c in classes)
            assert takes_packed(client)  # so its publish calls go packed (worker/loop/publish.py)
            assert await client.client_getname() == "tokenq-worker"
        finally:
            await client.aclose()

    asyncio.run(main())


# --------------------------------------------------------------------- ops


def test_the_operator_commands_client_reads_a_snapshot(target: Target) -> None:
    q = keys.QueueRef(f"ops{uuid.uuid4().hex[:6]}")
    r = snapshot.connect(target.url, 2.0)
    try:
        r.xadd(keys.requests(q), {"x": "1"})
        r.xgroup_create(keys.requests(q), keys.GROUP, id="0")
        assert q in snapshot.discover_queues(r, keys.DEFAULT_PREFIX)
        [stats] = snapshot.snapshot(r, [q], redis_url=target.url)["queues"]
        assert stats["length"] == 1 and stats["lag"] == 1
    finally:
        r.close()


def test_an_unreachable_cluster_is_the_operators_one_line() -> None:
    with pytest.raises(CommandFailed, match=r"cannot reach Redis at redis\+cluster") as raised:
        snapshot.connect("redis+cluster://u:pw-hidden@127.0.0.1:1", 0.5)
    assert "pw-hidden" not in str(raised.value)


def test_a_bad_url_is_a_usage_error_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="names no service"):
        sync_client_for("redis+sentinel://u:pw-hidden@h:1")
    with pytest.raises(UsageError, match=r"--redis-url.*names no service") as raised:
        snapshot.connect("redis+sentinel://u:pw-hidden@h:1")
    assert "pw-hidden" not in str(raised.value)


def test_a_bad_url_is_a_value_error_for_every_client() -> None:
    settings = client_settings("redis+cluster://h:1/4")
    with pytest.raises(ValueError, match="database 4"):
        sync_redis(settings, CLIENT_ID, None)
    with pytest.raises(ValueError, match="database 4"):
        async_redis(settings, CLIENT_ID, 4)
    with pytest.raises(ValueError, match="database 4"):
        worker_connect(worker_settings("redis+cluster://h:1/4"))


def test_tls_urls_build_tls_connections_with_their_options() -> None:
    """Built, not connected (no TLS server here): the classes and options the nodes will use."""
    query = "?ssl_cert_reqs=none&ssl_ca_path=/etc/ca&ssl_check_hostname=false"
    cluster = client_settings("rediss+cluster://u:pw@127.0.0.1:1,127.0.0.1:2" + query)
    sentinel = client_settings("rediss+sentinel://127.0.0.1:1/svc/3" + query)
    wanted = {"ssl_cert_reqs": "none", "ssl_ca_path": "/etc/ca", "ssl_check_hostname": False}

    async def main() -> None:
        for client in (*async_redis(cluster, CLIENT_ID, 4),
                       worker_connect(worker_settings(cluster.redis_url))):
            for node in client.startup_nodes:
                assert issubclass(node.connection_class, redis.asyncio.SSLConnection)
                assert wanted.items() <= node.connection_kwargs.items()
                assert node.connection_kwargs["username"] == "u"
            assert wanted.items() <= client.connection_kwargs.items()
            await client.aclose()
        for client in (*async_redis(sentinel, CLIENT_ID, 4),
                       worker_connect(worker_settings(sentinel.redis_url))):
            pool = client.connection_pool
            managed = redis.asyncio.sentinel.SentinelManagedSSLConnection
            assert issubclass(pool.connection_class, managed)
            assert wanted.items() <= pool.connection_kwargs.items()
            assert pool.connection_kwargs["db"] == 3
            await client.aclose()

    asyncio.run(main())
    r = sync_redis(sentinel, CLIENT_ID, None)
    assert issubclass(r.connection_pool.connection_class,
                      redis.sentinel.SentinelManagedSSLConnection)
    assert issubclass(r.connection_pool.connection_class, DeadlineTimeouts)
    assert wanted.items() <= r.connection_pool.connection_kwargs.items()
    r.close()


# ------------------------------------------- what redis-py's cluster pipelines do


def test_pipeline_a_cluster_pipeline_sends_evalsha_without_loading_the_script(
        redis_cluster) -> None:  # noqa: F811
    r = sync_redis(client_settings(redis_cluster.url), CLIENT_ID, None)
    try:
        one, two = slot_keys("a", "b")
        source = f"{INCR_BOTH}-- {uuid.uuid4().hex}"  # not loaded by an earlier test
        script = r.register_script(source)
        with r.pipeline(transaction=False) as pipe:
            try:
                script(keys=[one, two], args=[1], client=pipe)
            except redis.RedisClusterException as refused:  # redis-py before 8.2
                assert "evalsha is blocked" in str(refused)
        with r.pipeline(transaction=False) as pipe:
            pipe.execute_command("EVALSHA", script.sha, 2, one, two, 1)
            with pytest.raises(redis.exceptions.NoScriptError):
                pipe.execute()  # a cluster pipeline does not load scripts first
        r.script_load(source)  # to every primary
        with r.pipeline(transaction=False) as pipe:
            pipe.execute_command("EVALSHA", script.sha, 2, one, two, 1)
            assert pipe.execute() == [[1, 1]]
    finally:
        r.close()


def test_pipeline_wait_in_a_cluster_pipeline_goes_where_it_is_sent(
        redis_cluster) -> None:  # noqa: F811
    """Untargeted, redis-py sends WAIT to its default node, which may not hold the key;
    ``target_nodes=`` the key's node puts it beside the write (one connection per node)."""

    def waits() -> dict[int, int]:
        counts = {}
        for port in redis_cluster.masters():
            with redis.Redis(port=port) as node:
                counts[port] = node.info("commandstats").get("cmdstat_wait", {}).get("calls", 0)
        return counts

    r = sync_redis(client_settings(redis_cluster.url), CLIENT_ID, None)
    try:
        key = next(k for k in (f"{{w:{i}}}:{uuid.uuid4().hex}" for i in range(50))
                   if redis_cluster.master_for_key(k) != r.get_default_node().port)
        owner = redis_cluster.master_for_key(key)
        for targeted, expected in ((False, r.get_default_node().port), (True, owner)):
            before = waits()
            with r.pipeline(transaction=False) as pipe:
                pipe.set(key, "v")
                extra = {"target_nodes": r.get_node_from_key(key)} if targeted else {}
                pipe.execute_command("WAIT", 1, 2000, **extra)
                assert pipe.execute() == [True, 1]
            after = waits()
            assert [p for p in after if after[p] > before[p]] == [expected], targeted
    finally:
        r.close()


def test_retry_counts_read_as_spent_after_the_deadline() -> None:
    retry = connection.DeadlineRetry(connection.DeadlineBackoff(), 5)
    left = retry.get_retries()
    assert left > 0 and left == 5
    with for_caller(time.monotonic() - 0.1):
        assert not left > 0
        assert retry.get_retries() == 0
        left -= 1
        assert not left > 0
    assert left > 0 and left == 4 and isinstance(left, int)


# ------------------------------------------------------------------ faults


def _seed(r: Any, key: str) -> None:
    r.set(key, "kept")
    assert durable(r, key) == 1  # on the replica that will be promoted


@pytest.mark.fault
def test_a_deadline_bounds_calls_to_a_killed_cluster_master(redis_cluster) -> None:  # noqa: F811
    settings = client_settings(redis_cluster.url, retries=50)
    [key] = slot_keys("kept")
    r = sync_redis(settings, CLIENT_ID, None)
    loop = asyncio.new_event_loop()
    command, listener = async_redis(settings, CLIENT_ID, 4)
    worker = worker_connect(worker_settings(redis_cluster.url))
    try:
        _seed(r, key)
        assert loop.run_until_complete(command.get(key)) == b"kept"
        assert loop.run_until_complete(worker.get(key)) == b"kept"
        old = redis_cluster.master_for_key(key)
        redis_cluster.kill(old)

        with for_caller(time.monotonic() + DEADLINE_S):
            took, error = timed_call(lambda: r.get(key))
        assert_bounded(took, error, "sync GET")

        async def bounded_get() -> tuple[float, BaseException | None]:
            with for_caller(time.monotonic() + DEADLINE_S):
                return await timed_await(lambda: command.get(key))

        assert_bounded(*loop.run_until_complete(bounded_get()), "async GET")

        redis_cluster.wait_promoted(old)
        assert r.get(key) == b"kept"  # redis-py re-read the slots and found the new master
        assert loop.run_until_complete(command.get(key)) == b"kept"
        assert loop.run_until_complete(worker.get(key)) == b"kept"
        redis_cluster.restart(old)
        redis_cluster.wait_ok()
    finally:
        r.close()
        for client in (command, listener, worker):
            loop.run_until_complete(client.aclose())
        loop.close()


@pytest.mark.fault
def test_a_deadline_bounds_calls_to_a_frozen_cluster_master(redis_cluster) -> None:  # noqa: F811
    """A frozen node accepts connections and never answers: only the deadline ends the wait
    (socket timeout 5 s, 50 retries). Warm connections, so the pooled socket's timeout is
    re-armed before the command."""
    settings = client_settings(redis_cluster.url, retries=50)
    [key] = slot_keys("frozen")
    r = sync_redis(settings, CLIENT_ID, None)
    loop = asyncio.new_event_loop()
    command, listener = async_redis(settings, CLIENT_ID, 4)
    try:
        r.set(key, "v")
        assert loop.run_until_complete(command.get(key)) == b"v"
        with frozen(redis_cluster.master_for_key(key)):
            with for_caller(time.monotonic() + DEADLINE_S):
                took, error = timed_call(lambda: r.get(key))
            assert_bounded(took, error, "sync GET")
            assert error is not None

            async def bounded_get() -> tuple[float, BaseException | None]:
                with for_caller(time.monotonic() + DEADLINE_S):
                    return await timed_await(lambda: command.get(key))

            took, error = loop.run_until_complete(bounded_get())
            assert_bounded(took, error, "async GET")
            assert error is not None
        redis_cluster.wait_ok()
    finally:
        r.close()
        for client in (command, listener):
            loop.run_until_complete(client.aclose())
        loop.close()


@pytest.mark.fault
def test_sentinel_clients_follow_a_failover_within_their_deadlines(
        redis_sentinel) -> None:  # noqa: F811
    settings = client_settings(redis_sentinel.url, retries=50)
    [key] = slot_keys("kept")
    r = sync_redis(settings, CLIENT_ID, None)
    loop = asyncio.new_event_loop()
    command, listener = async_redis(settings, CLIENT_ID, 4)
    worker = worker_connect(worker_settings(redis_sentinel.url))
    try:
        _seed(r, key)
        assert loop.run_until_complete(worker.get(key)) == b"kept"
        assert loop.run_until_complete(listener.get(key)) == b"kept"
        old = redis_sentinel.kill_master()

        with for_caller(time.monotonic() + DEADLINE_S):
            took, error = timed_call(lambda: r.get(key))
        assert_bounded(took, error, "sync GET")

        async def bounded_get() -> tuple[float, BaseException | None]:
            with for_caller(time.monotonic() + DEADLINE_S):
                return await timed_await(lambda: command.get(key))

        assert_bounded(*loop.run_until_complete(bounded_get()), "async GET")

        new = redis_sentinel.wait_promoted(old)
        assert new != old
        assert r.get(key) == b"kept"
        assert r.set(key, "written on the new master")
        for client in (command, listener, worker):
            assert loop.run_until_complete(client.get(key)) == b"written on the new master"
    finally:
        r.close()
        for client in (command, listener, worker):
            loop.run_until_complete(client.aclose())
        loop.close()


@pytest.mark.fault
def test_a_command_begun_during_a_sentinel_failover_ends_on_the_new_master(
        redis_sentinel) -> None:  # noqa: F811
    """A command in flight when the master dies is retried on the promoted replica.

    Each client blocks in a BLPOP (as the worker's XREADGROUP and the
    listener's BLMOVE block) when the master is killed; its connection dies
    under it, and the command's retry must ask the sentinels again. redis-py
    reconnected such a connection to the address it had (redis-py #3874), so
    every retry went to the dead master: the command failed at its deadline,
    or after the worker's ten retries (~13 s, while every caller waited). After
    the promotion a value is pushed for each; each blocked command returns it.
    """
    settings = client_settings(redis_sentinel.url, retries=50, socket_timeout_s=10)
    block_s = 8
    r = sync_redis(settings, CLIENT_ID, None)
    ops = sync_client_for(redis_sentinel.url, socket_timeout=10,
                          retry=redis.retry.Retry(redis.backoff.ExponentialBackoff(2, 0.05), 20),
                          retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    loop = asyncio.new_event_loop()
    command, listener = async_redis(settings, CLIENT_ID, 4)
    worker = worker_connect(worker_settings(redis_sentinel.url))
    sync_clients = {"producer, sync": r, "operator commands": ops}
    async_clients = {"producer, async": command, "listener": listener, "worker": worker}
    lists = {name: slot_keys(name.replace(" ", "-").replace(",", ""))[0]
             for name in (*sync_clients, *async_clients)}
    got: dict[str, Any] = {}

    def pop(name: str, client: Any) -> None:
        with for_caller(time.monotonic() + 30):
            try:
                got[name] = client.blpop([lists[name]], timeout=block_s)
            except Exception as exc:
                got[name] = exc

    async def apop(name: str, client: Any) -> None:
        with for_caller(time.monotonic() + 30):
            try:
                got[name] = await client.blpop([lists[name]], timeout=block_s)
            except Exception as exc:
                got[name] = exc

    async def blocked_through_the_failover() -> None:
        popping = [asyncio.ensure_future(apop(name, client))
                   for name, client in async_clients.items()]
        await asyncio.sleep(0.5)  # every BLPOP is blocked now
        old = await asyncio.to_thread(redis_sentinel.kill_master)
        assert await asyncio.to_thread(redis_sentinel.wait_promoted, old) != old
        with redis.Redis(port=redis_sentinel.current_master()) as new_master:
            for name, key in lists.items():
                new_master.rpush(key, name)
        await asyncio.gather(*popping)

    try:
        for client in (r, ops):
            assert client.ping()
        for client in async_clients.values():
            assert loop.run_until_complete(client.ping())
        threads = [threading.Thread(target=pop, args=item) for item in sync_clients.items()]
        for thread in threads:
            thread.start()
        loop.run_until_complete(blocked_through_the_failover())
        for thread in threads:
            thread.join(timeout=40)
        popped = {name: tuple(value) if isinstance(value, (list, tuple)) else value
                  for name, value in got.items()}
        assert popped == {name: (key.encode(), name.encode()) for name, key in lists.items()}
    finally:
        r.close()
        ops.close()
        for client in async_clients.values():
            loop.run_until_complete(client.aclose())
        loop.close()


@pytest.mark.fault
def test_a_deadline_bounds_calls_to_a_frozen_sentinel_master(
        redis_sentinel) -> None:  # noqa: F811
    settings = client_settings(redis_sentinel.url, retries=50)
    [key] = slot_keys("frozen")
    r = sync_redis(settings, CLIENT_ID, None)
    loop = asyncio.new_event_loop()
    command, listener = async_redis(settings, CLIENT_ID, 4)
    try:
        r.set(key, "v")
        assert loop.run_until_complete(command.get(key)) == b"v"
        with frozen(redis_sentinel.current_master()):
            with for_caller(time.monotonic() + DEADLINE_S):
                took, error = timed_call(lambda: r.get(key))
            assert_bounded(took, error, "sync GET")
            assert error is not None

            async def bounded_get() -> tuple[float, BaseException | None]:
                with for_caller(time.monotonic() + DEADLINE_S):
                    return await timed_await(lambda: command.get(key))

            took, error = loop.run_until_complete(bounded_get())
            assert_bounded(took, error, "async GET")
            assert error is not None
    finally:
        r.close()
        for client in (command, listener):
            loop.run_until_complete(client.aclose())
        loop.close()
