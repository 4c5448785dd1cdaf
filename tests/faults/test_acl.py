"""The minimal ACL users of docs/SECURITY.md, and TLS, on a real redis-server.

The ACL rules are read from docs/SECURITY.md itself, so the documented rules
are the tested ones. A producer and a worker run the whole path under them
(enqueue, replies, dead letters, claiming a dead consumer's entry, removing
that consumer) and Redis's own ``ACL LOG`` must stay empty: no command tokenq
runs in normal operation is refused (the worker loads tokenq's Lua functions;
the producer only calls them). Then the refusals that keep queues apart, and
keep a producer from running Lua of its own, are checked one by one
(``tests/shared/test_functions.py`` covers the functions in depth).
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.redis_server import RedisServer, free_port
from tests.support import FAST_BEAT, SimModel, blpop_within, fleet_fixture, wait_for
from tests.workers import Fleet
from tokenq.producer import AsyncClient, Client, calls
from tokenq.producer.deadline import Deadline
from tokenq.shared import functions, keys, wire
from tokenq.shared.errors import QueueFull

REPO_ROOT = Path(__file__).resolve().parents[2]
SECURITY_MD = REPO_ROOT / "docs" / "SECURITY.md"
SIM = SimModel().flags(*FAST_BEAT, "--log-level", "DEBUG")
fleet = fleet_fixture(*SIM)
vector_ok = SimModel().vector_ok


def documented_rules(queue: str, password: str) -> dict[str, list[str]]:
    """The ``ACL SETUSER`` lines of docs/SECURITY.md, rewritten for ``queue``.

    Each selector, ``(+cmd ... ~pattern ...)``, is one word, as Redis takes it
    from a client (redis-cli splits it at the spaces; Redis joins it again).
    """
    rules: dict[str, list[str]] = {}
    for line in SECURITY_MD.read_text(encoding="utf-8").splitlines():
        if not line.startswith("ACL SETUSER "):
            continue
        words = selectors_joined(shlex.split(line.replace("{embed}", "{" + queue + "}")))
        role = words[2].removeprefix("embed-")
        words[2] = f"{queue}-{role}"
        words = [f">{password}" if w in (">PRODUCER_PASSWORD", ">WORKER_PASSWORD") else w
                 for w in words]
        rules[role] = words
    assert set(rules) == {"producer", "worker"}, f"docs/SECURITY.md lost its ACL lines: {rules}"
    return rules


def selectors_joined(words: list[str]) -> list[str]:
    """``["(+get", "~k)"]`` as ``["(+get ~k)"]``: one word per selector."""
    joined: list[str] = []
    inside = False
    for word in words:
        if inside:
            joined[-1] += " " + word
        else:
            joined.append(word)
        inside = (inside or word.startswith("(")) and not word.endswith(")")
    return joined


def create_users(admin: redis.Redis, queue: str, password: str) -> None:
    for words in documented_rules(queue, password).values():
        admin.execute_command(*words)


def user_url(server: RedisServer, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def acl_denials(admin: redis.Redis) -> list[str]:
    return [f"{e.get('username')}: {e.get('context')} {e.get('object')} ({e.get('reason')})"
            for e in admin.acl_log()]


def check_async_path(producer_url: str, queue: str, texts: list[str]) -> None:
    """Concurrent ``AsyncClient.infer`` calls each get their text's vector."""

    async def via_async() -> None:
        async with AsyncClient(redis_url=producer_url, queue=queue) as aclient:
            results = await asyncio.gather(*(aclient.infer(t, timeout_s=60) for t in texts))
            for text, result in zip(texts, results, strict=True):
                assert vector_ok(result.embedding, text)

    asyncio.run(via_async())


@pytest.fixture
def acl_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own: its users and ACL LOG are nobody else's."""
    server = RedisServer(tmp_path / "acl")
    server.start()
    yield server
    server.stop()


def test_documented_acl_users_run_the_whole_path_with_no_refusal(
    acl_server: RedisServer, fleet: Fleet, worker_env: dict[str, str],
) -> None:
    queue, other, password = "acla", "aclb", uuid.uuid4().hex
    admin = redis.Redis(port=acl_server.port, socket_timeout=10)
    create_users(admin, queue, password)
    create_users(admin, other, password)
    q = keys.QueueRef(queue)
    stream = keys.requests(q)

    # A consumer that "died" holding an entry, so the worker claims it and
    # removes the consumer (drop_consumer.lua) under its ACL too.
    admin.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    admin.xadd(stream, {"v": "1", "id": "orphan", "text": "held by a dead worker"})
    admin.xreadgroup(keys.GROUP, "ghost", {stream: ">"}, count=1)

    # The operator widened the reply namespace to "not-": the worker tries
    # such a key, so the refusal below comes from Redis's ACL itself.
    env = {**worker_env, "TOKENQ_REDIS_URL": user_url(acl_server, f"{queue}-worker", password),
           "TOKENQ_QUEUE": queue, "TOKENQ_REPLY_TO_PREFIXES": "not-"}
    worker = fleet.start(name="w", env=env, ready=admin, queue=queue)
    producer_url = user_url(acl_server, f"{queue}-producer", password)
    with Client(redis_url=producer_url, queue=queue) as client:
        texts = ["an acl-limited producer", "still gets its vectors"]
        for text, result in zip(texts, client.infer_many(texts, timeout_s=60), strict=True):
            assert vector_ok(result.embedding, text)
        request_id = client.submit("submit now, fetch later")
        assert vector_ok(client.result(request_id, timeout_s=60).embedding,
                         "submit now, fetch later")
        assert client.config()["model"] == "sim"
        assert client.queue_length() >= 0
        # A tenant's request: its stream registered, announced and read under the ACLs too.
        assert vector_ok(client.infer("a tenant's", tenant="team-a", timeout_s=60).embedding,
                         "a tenant's")
        orphan = client.result("orphan", timeout_s=60)
        assert vector_ok(orphan.embedding, "held by a dead worker")

    check_async_path(producer_url, queue, texts)

    # A malformed entry: the worker dead-letters it (XADD on dead) and answers it.
    admin.xadd(stream, {"v": "9", "id": "badversion", "text": "x"})
    raw = blpop_within(admin, keys.reply(q, "badversion"), 60)
    assert raw is not None and wire.decode_reply(raw).error.code == "bad_request"
    wait_for(lambda: [c["name"] for c in admin.xinfo_consumers(stream, keys.GROUP)] == [b"w"],
          30, "the dead consumer to be removed")
    assert admin.xlen(keys.dead(q)) == 1

    denials = acl_denials(admin)
    assert not denials, f"commands refused in normal operation: {denials}"
    assert "NOPERM" not in worker.output(), worker.output()[-3000:]

    # A reply_to outside the worker's keys: refused by Redis, dead-lettered, no wedge.
    admin.xadd(stream, {"v": "1", "id": "elsewhere", "text": "x", "reply_to": "not-tokenq"})
    admin.xadd(stream, {"v": "1", "id": "after", "text": "answered after the refusal"})
    raw = blpop_within(admin, keys.reply(q, "after"), 60)
    assert raw is not None, worker.output()[-3000:]
    assert vector_ok(wire.decode_reply(raw).embedding, "answered after the refusal")
    dead = {f[b"id"]: f for _, f in admin.xrange(keys.dead(q))}
    assert b"NOPERM" in dead[b"elsewhere"][b"dead_error"]
    assert not admin.exists("not-tokenq")
    assert worker.process.poll() is None


def test_acl_keeps_queues_apart(acl_server: RedisServer) -> None:
    queue, other, password = "sepa", "sepb", uuid.uuid4().hex
    admin = redis.Redis(port=acl_server.port, socket_timeout=10)
    create_users(admin, queue, password)
    create_users(admin, other, password)
    a, b = keys.QueueRef(queue), keys.QueueRef(other)
    admin.rpush(keys.reply(a, "secret"), b"someone else's answer")
    producer_b = redis.Redis.from_url(user_url(acl_server, f"{other}-producer", password),
                                      socket_timeout=10)
    worker_b = redis.Redis.from_url(user_url(acl_server, f"{other}-worker", password),
                                    socket_timeout=10)
    producer_a = redis.Redis.from_url(user_url(acl_server, f"{queue}-producer", password),
                                      socket_timeout=10)
    refused = {
        "B's producer waits on A's reply": lambda: producer_b.blmove(
            keys.reply(a, "secret"), keys.reply(a, "secret"), 1, "LEFT", "RIGHT"),
        "B's producer reads A's reply": lambda: producer_b.lrange(keys.reply(a, "secret"), 0, -1),
        "B's producer deletes A's reply": lambda: producer_b.delete(keys.reply(a, "secret")),
        "B's producer enqueues into A": lambda: producer_b.xadd(keys.requests(a), {"v": "1"}),
        "A's producer reads its dead letters": lambda: producer_a.xrange(keys.dead(a)),
        "A's producer writes its config": lambda: producer_a.hset(keys.config(a), "x", "1"),
        "A's producer lists keys": lambda: producer_a.keys("*"),
        "A's producer flushes": lambda: producer_a.flushall(),
        "A's producer runs its own Lua": lambda: producer_a.eval("return 1", 0),
        "A's producer loads its own Lua": lambda: producer_a.script_load("while true do end"),
        "A's producer runs a loaded script": lambda: producer_a.evalsha(
            admin.script_load("return 1"), 0),
        "A's producer loads a function": lambda: producer_a.function_load(
            "#!lua name=mine\nredis.register_function('spin', function() while true do end end)"),
        "A's producer deletes tokenq's functions": lambda: producer_a.function_flush(),
        "B's worker reads A's stream": lambda: worker_b.xreadgroup(
            keys.GROUP, "w", {keys.requests(a): ">"}),
        "B's worker pushes A's replies": lambda: worker_b.rpush(keys.reply(a, "x"), b"forged"),
    }
    # Control: the same users may do these things on their own queue.
    assert producer_b.xlen(keys.requests(b)) == 0
    assert producer_b.lrange(keys.reply(b, "mine"), 0, -1) == []
    assert producer_b.delete(keys.reply(b, "mine")) == 0
    assert producer_a.hgetall(keys.config(a)) == {}
    for what, call in refused.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
            pytest.fail(f"allowed: {what}")
    assert admin.lrange(keys.reply(a, "secret"), 0, -1) == [b"someone else's answer"]
    for client in (producer_a, producer_b, worker_b):
        client.close()


# --------------------------------------------------------------------- TLS


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost, by the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl binary to make a test certificate")
    ca_key, ca, key, csr, cert = (directory / n for n in
                                  ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
        "/CN=tokenq test CA", "-keyout", str(ca_key), "-out", str(ca))
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
        "-keyout", str(key), "-out", str(csr))
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))
    return ca, cert, key


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[RedisServer, int, Path]]:
    ca, cert, key = make_certificates(tmp_path)
    tls_port = free_port()
    server = RedisServer(tmp_path / "tls", args=(
        "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
    ))
    try:
        server.start()
    except RuntimeError as exc:  # a redis-server built without TLS refuses the options
        pytest.skip(f"this redis-server has no TLS support: {exc}")
    yield server, tls_port, ca
    server.stop()


def test_worker_and_client_over_rediss(tls_server, fleet, worker_env) -> None:
    server, tls_port, ca = tls_server
    queue = f"tls{uuid.uuid4().hex[:6]}"
    url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}"
    admin = redis.Redis(port=server.port, socket_timeout=10)
    env = {**worker_env, "TOKENQ_REDIS_URL": url, "TOKENQ_QUEUE": queue}
    fleet.start(name="w", env=env, ready=admin, queue=queue)
    with Client(redis_url=url, queue=queue) as client:
        texts = ["encrypted on the wire", "both ways"]
        for text, result in zip(texts, client.infer_many(texts, timeout_s=60), strict=True):
            assert vector_ok(result.embedding, text)
    tls_clients = [c for c in admin.client_list() if str(c.get("laddr", "")).endswith(
        f":{tls_port}")]
    assert tls_clients, "nothing connected over the TLS port"
    with pytest.raises(redis.ConnectionError):  # no CA given: the certificate is not trusted
        redis.Redis.from_url(f"rediss://127.0.0.1:{tls_port}/0", socket_timeout=5,
                             retry_on_error=[]).ping()


# ----------------------------------------------------------------- helpers



def sharded_rules(queue: str, password: str) -> dict[str, list[str]]:
    """docs/SECURITY.md's rule for a sharded queue: in each selector, each key pattern
    again with ``{q:*}``."""
    tag, shards = "{" + queue + "}", "{" + queue + ":*}"

    def doubled(selector: str) -> str:
        inner = selector.removeprefix("(").removesuffix(")").split()
        return "(" + " ".join([*inner, *(w.replace(tag, shards) for w in inner if tag in w)]) + ")"

    return {
        role: [doubled(w) if w.startswith("(") else w for w in words]
        for role, words in documented_rules(queue, password).items()
    }


def test_a_sharded_queue_runs_under_the_documented_sharded_acl(
    acl_server: RedisServer, fleet: Fleet, worker_env: dict[str, str],
) -> None:
    queue, password = "aclshards", uuid.uuid4().hex
    admin = redis.Redis(port=acl_server.port, socket_timeout=10)
    for words in sharded_rules(queue, password).values():
        admin.execute_command(*words)
    env = {**worker_env, "TOKENQ_REDIS_URL": user_url(acl_server, f"{queue}-worker", password),
           "TOKENQ_QUEUE": queue, "TOKENQ_SHARDS": "3"}
    worker = fleet.start(name="w", env=env)
    first = keys.QueueRef(queue, shard=0)
    wait_for(lambda: bool(admin.exists(keys.worker_alive(first, "w"))), 60, "the worker to join")
    producer_url = user_url(acl_server, f"{queue}-producer", password)
    texts = [f"sharded under an acl {i}" for i in range(6)]
    with Client(redis_url=producer_url, queue=queue) as client:
        ids = [client.submit(text) for text in texts]
        assert {keys.shard_in_id(i) for i in ids} == {0, 1, 2}
        for text, result in zip(texts, client.results(ids, timeout_s=60), strict=True):
            assert vector_ok(result.embedding, text)
        assert client.queue_length() == 0

    check_async_path(producer_url, queue, texts)
    denials = acl_denials(admin)
    assert not denials, f"commands refused in normal operation: {denials}"
    assert "NOPERM" not in worker.output(), worker.output()[-3000:]


def test_a_retired_shard_with_tenant_streams_is_removed_under_the_documented_acl(
    acl_server: RedisServer,
) -> None:
    """``remove_retired`` reads the shard's tenants set and its tenants' streams, and removes
    the shard's keys and the drained streams, each by a command one selector of the
    documented sharded worker rule allows whole; no refusal logged."""
    queue, password = "aclretire", uuid.uuid4().hex
    admin = redis.Redis(port=acl_server.port, socket_timeout=10)
    for words in sharded_rules(queue, password).values():
        admin.execute_command(*words)
    functions.load(admin)
    two = keys.QueueRef(queue, shard=2)
    main, tenant = keys.requests(two), keys.tenant_requests(two, "a")
    for stream in (main, tenant):
        admin.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    admin.sadd(keys.tenants(two), tenant)
    admin.xadd(tenant, {"v": "1"})
    admin.set(keys.retired(two), "2")
    worker = redis.Redis.from_url(user_url(acl_server, f"{queue}-worker", password),
                                  socket_timeout=10)
    remove = functions.Function(worker, "remove_retired")
    names = [main, keys.dead(two), keys.retired(two), keys.workers(two), keys.config(two)]
    assert remove(keys=names, args=[keys.GROUP]) == b"draining"
    admin.xtrim(tenant, maxlen=0)
    assert remove(keys=names, args=[keys.GROUP]) == b"removed"
    assert not admin.exists(main, tenant) and admin.exists(keys.retired(two))
    assert not acl_denials(admin)
    worker.close()
    admin.close()


def test_idle_tenant_streams_are_removed_under_the_documented_acl(
    acl_server: RedisServer,
) -> None:
    """``remove_idle_tenants`` unlists, deletes and uncounts an idle tenant's stream, each by a
    command one selector of the documented worker rule (plain and sharded) allows whole."""
    queue, password = "aclidle", uuid.uuid4().hex
    admin = redis.Redis(port=acl_server.port, socket_timeout=10)
    for words in sharded_rules(queue, password).values():
        admin.execute_command(*words)
    functions.load(admin)
    for q in (keys.QueueRef(queue), keys.QueueRef(queue, shard=1)):
        stream = keys.tenant_requests(q, "a")
        admin.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
        admin.sadd(keys.tenants(q), stream, keys.tenant_requests(q, "gone"))
        admin.hset(keys.pending(q), mapping={"tokens": 3, "tokens:a": 3})
        worker = redis.Redis.from_url(user_url(acl_server, f"{queue}-worker", password),
                                      socket_timeout=10)
        removed = functions.Function(worker, "remove_idle_tenants")(
            keys=[keys.tenants(q), stream, keys.tenant_requests(q, "gone")],
            args=[keys.GROUP, 0])
        assert len(removed) == 2 and not admin.exists(stream, keys.tenants(q))
        assert admin.hkeys(keys.pending(q)) == [b"tokens"]
        worker.close()
    assert not acl_denials(admin)
    admin.close()


def test_the_result_cache_empties_under_the_documented_acl(acl_server: RedisServer) -> None:
    """``cache_put`` removes the cache's hash and byte count once its last entry expires, each
    by a command one selector of the documented worker rule allows whole: the count is never
    left standing over an empty cache, and no write is refused."""
    queue, password = "aclcache", uuid.uuid4().hex
    admin = redis.Redis(port=acl_server.port, socket_timeout=10)
    create_users(admin, queue, password)
    functions.load(admin)
    worker = redis.Redis.from_url(user_url(acl_server, f"{queue}-worker", password),
                                  socket_timeout=10)
    put, names = functions.Function(worker, "cache_put"), list(keys.cache(keys.QueueRef(queue)))
    assert put(keys=names, args=[10**6, 1000, 10_000, 64, 0.9, b"digest", b"v" * 20]) > 0
    assert put(keys=names, args=[10**6, 1000, 20_000, 64, 0.9]) == 0  # expired: emptied
    assert not admin.exists(*names) and not acl_denials(admin)
    worker.close()
    admin.close()


def test_reads_the_documented_users_make_run_when_redis_refuses_writes(
    acl_server: RedisServer,
) -> None:
    """Each read-only function goes by a command the documented rules grant on its keys: at
    ``maxmemory`` a producer's retry of a batch already written is answered by the read-only
    enqueue (not "nothing was written"), and the queue's depth is read by both users."""
    queue, password = "aclro", uuid.uuid4().hex
    admin = redis.Redis(port=acl_server.port, socket_timeout=10)
    create_users(admin, queue, password)
    functions.load(admin)
    with Client(user_url(acl_server, f"{queue}-producer", password), queue,
                max_queue_length=0) as client:
        core = client._core
        batch = core.preparer.prepare_many(core.lanes.home, ["one", "two"], now_ms=0)

        def enqueue() -> list[str]:
            return client._run(calls.enqueue(core, core.lanes.home, batch, Deadline.after(5)))

        first = enqueue()
        admin.config_set("maxmemory", "1")
        try:
            assert enqueue() == first  # what a retry after a lost reply sends
            assert client.queue_length() == 2
        finally:
            admin.config_set("maxmemory", "0")
    worker = redis.Redis.from_url(user_url(acl_server, f"{queue}-worker", password),
                                  socket_timeout=10)
    depth = functions.Function(worker, "queue_depth")(
        keys=[keys.requests(keys.QueueRef(queue))], args=["depth", keys.GROUP])
    assert depth[0] == 2 and not acl_denials(admin)
    worker.close()
    admin.close()


@pytest.mark.parametrize("missing", ["(+xadd ~tokenq:{q}:tenants:added)",
                                     "(+sadd +smembers ~tokenq:{q}:tenants)"])
def test_a_producer_without_a_tenant_right_never_writes_half_a_call(
    acl_server: RedisServer, missing: str,
) -> None:
    """The documented producer rule less one tenant right (an ACL from before it): without
    announcing a new tenant's stream (``tenants:added``) the call is whole and the stream found
    at the workers' heartbeat; without registering it (``tenants``) the call is refused having
    written nothing, never an entry no worker would read for a call that failed."""
    queue, password = "acltenant", uuid.uuid4().hex
    admin = redis.Redis(port=acl_server.port, socket_timeout=10)
    rule = documented_rules(queue, password)["producer"]
    kept = [word for word in rule if word != missing.replace("{q}", "{" + queue + "}")]
    assert len(kept) == len(rule) - 1, "docs/SECURITY.md no longer grants the right"
    admin.execute_command(*kept)
    functions.load(admin)
    producer = redis.Redis.from_url(user_url(acl_server, f"{queue}-producer", password),
                                    socket_timeout=10)
    q = keys.QueueRef(queue)
    stream, enqueue = keys.tenant_requests(q, "t"), functions.Function(producer, "enqueue")
    args = [0, 1, 0, 2, "id", "a", "tokens", "7"]
    if "sadd" in missing:
        with pytest.raises(redis.ResponseError, match="can't run this command"):
            enqueue(keys=[stream, keys.tenants(q)], args=args)
        assert not admin.exists(stream, keys.tenants(q), keys.pending(q))
    else:
        assert len(enqueue(keys=[stream, keys.tenants(q)], args=args)) == 1
        assert admin.smembers(keys.tenants(q)) == {stream.encode()}
        assert admin.hgetall(keys.pending(q)) == {b"tokens": b"7", b"tokens:t": b"7"}
        assert not admin.exists(keys.tenants_added(q))
    producer.close()
    admin.close()


# ------------------------------------------------- every right, on every key

KEY_KINDS = ("requests", "dead", "config", "workers", "worker", "reply", "seen", "retired",
             "shards_served", "idem", "cache", "cache_index", "cache_bytes", "cache_claim",
             "pending", "tenants",
             "weights", "quotas", "tenant_requests", "tenants_added")
"""The queue's keys, by what :func:`key_of` names."""


def key_of(q: keys.QueueRef, kind: str) -> str:
    return {
        "requests": keys.requests(q), "dead": keys.dead(q), "config": keys.config(q),
        "workers": keys.workers(q), "worker": keys.worker_alive(q, "w"),
        "reply": keys.reply(q, "x"), "seen": keys.seen(q, "x"), "retired": keys.retired(q),
        "shards_served": keys.shards_served(q), "idem": keys.idempotent_answer(q, "x"),
        **dict(zip(("cache", "cache_index", "cache_bytes"), keys.cache(q), strict=True)),
        "cache_claim": keys.cache_claim(q, b"digest"),
        "pending": keys.pending(q), "tenants": keys.tenants(q), "weights": keys.weights(q),
        "quotas": keys.quotas(q),
        "tenant_requests": keys.tenant_requests(q, "t"), "tenants_added": keys.tenants_added(q),
    }[kind]


KEYED = {
    "fcall": ["FCALL", "f", "1", "{k}"],
    "fcall_ro": ["FCALL_RO", "f", "1", "{k}"],
    "xadd": ["XADD", "{k}", "*", "f", "v"],
    "xlen": ["XLEN", "{k}"],
    "xrange": ["XRANGE", "{k}", "-", "+"],
    "xrevrange": ["XREVRANGE", "{k}", "+", "-"],
    "xreadgroup": ["XREADGROUP", "GROUP", "workers", "c", "STREAMS", "{k}", ">"],
    "xread": ["XREAD", "STREAMS", "{k}", "0"],
    "sadd": ["SADD", "{k}", "m"],
    "xack": ["XACK", "{k}", "workers", "0-1"],
    "xdel": ["XDEL", "{k}", "0-1"],
    "xclaim": ["XCLAIM", "{k}", "workers", "c", "0", "0-1"],
    "xpending": ["XPENDING", "{k}", "workers"],
    "xtrim": ["XTRIM", "{k}", "MAXLEN", "0"],
    "xgroup|create": ["XGROUP", "CREATE", "{k}", "workers", "0", "MKSTREAM"],
    "xgroup|delconsumer": ["XGROUP", "DELCONSUMER", "{k}", "workers", "c"],
    "xgroup|destroy": ["XGROUP", "DESTROY", "{k}", "workers"],
    "xgroup|setid": ["XGROUP", "SETID", "{k}", "workers", "$"],
    "xinfo|groups": ["XINFO", "GROUPS", "{k}"],
    "xinfo|consumers": ["XINFO", "CONSUMERS", "{k}", "workers"],
    "get": ["GET", "{k}"],
    "set": ["SET", "{k}", "v"],
    "del": ["DEL", "{k}"],
    "unlink": ["UNLINK", "{k}"],
    "exists": ["EXISTS", "{k}"],
    "pexpire": ["PEXPIRE", "{k}", "1000"],
    "pttl": ["PTTL", "{k}"],
    "persist": ["PERSIST", "{k}"],
    "rename": ["RENAME", "{k}", "{k}"],
    "blmove": ["BLMOVE", "{k}", "{k}", "LEFT", "RIGHT", "1"],
    "lrange": ["LRANGE", "{k}", "0", "-1"],
    "lindex": ["LINDEX", "{k}", "0"],
    "ltrim": ["LTRIM", "{k}", "0", "-1"],
    "rpush": ["RPUSH", "{k}", "v"],
    "hgetall": ["HGETALL", "{k}"],
    "smembers": ["SMEMBERS", "{k}"],
    "sismember": ["SISMEMBER", "{k}", "m"],
    "srem": ["SREM", "{k}", "m"],
    "xinfo|stream": ["XINFO", "STREAM", "{k}"],
    "hkeys": ["HKEYS", "{k}"],
    "hget": ["HGET", "{k}", "f"],
    "hset": ["HSET", "{k}", "f", "v"],
    "hdel": ["HDEL", "{k}", "f"],
    "hmget": ["HMGET", "{k}", "f"],
    "hstrlen": ["HSTRLEN", "{k}", "f"],
    "hsetnx": ["HSETNX", "{k}", "f", "v"],
    "zadd": ["ZADD", "{k}", "1", "m"],
    "zrange": ["ZRANGE", "{k}", "0", "1"],
    "zrangebyscore": ["ZRANGEBYSCORE", "{k}", "-inf", "1"],
    "zrem": ["ZREM", "{k}", "m"],
    "zcard": ["ZCARD", "{k}"],
    "hincrby": ["HINCRBY", "{k}", "f", "1"],
    "eval": ["EVAL", "return 1", "1", "{k}"],
}
"""Commands on one key, each as ``ACL DRYRUN`` takes it (``{k}``: the key)."""

KEYLESS = {
    "multi": ["MULTI"], "exec": ["EXEC"], "client|setname": ["CLIENT", "SETNAME", "n"],
    "time": ["TIME"], "ping": ["PING"], "config|get": ["CONFIG", "GET", "maxmemory"],
    "function|load": ["FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('f', "
                      "function() return 1 end)"],
    "function|delete": ["FUNCTION", "DELETE", "x"], "function|flush": ["FUNCTION", "FLUSH"],
    "function|restore": ["FUNCTION", "RESTORE", "x"], "script|load": ["SCRIPT", "LOAD", "1"],
    "eval": ["EVAL", "return 1", "0"], "flushall": ["FLUSHALL"], "keys": ["KEYS", "*"],
    "scan": ["SCAN", "0"], "config|set": ["CONFIG", "SET", "maxmemory", "1"],
    "client|kill": ["CLIENT", "KILL", "ID", "1"], "acl|setuser": ["ACL", "SETUSER", "x"],
    "shutdown": ["SHUTDOWN"], "debug": ["DEBUG", "SLEEP", "0"], "info": ["INFO", "memory"],
}
"""Commands on no key."""

_REPLY_WAIT = ("blmove", "lrange", "lindex", "ltrim", "del", "rpush", "pexpire")
ALLOWED: dict[str, dict[str, frozenset[str]]] = {
    "producer": {
        "fcall": frozenset({"requests", "tenant_requests", "seen", "retired", "tenants"}),
        "fcall_ro": frozenset({"reply"}),
        "xadd": frozenset({"requests", "tenant_requests", "tenants_added"}),
        "xlen": frozenset({"requests", "tenant_requests"}), "sadd": frozenset({"tenants"}),
        "smembers": frozenset({"tenants"}),
        "get": frozenset({"seen", "idem"}), "set": frozenset({"seen", "idem"}),
        "exists": frozenset({"retired", "workers", "worker"}),
        **{command: frozenset({"reply"}) for command in _REPLY_WAIT},
        "del": frozenset({"reply", "idem"}),
        "hkeys": frozenset({"workers", "worker"}),
        "hincrby": frozenset({"pending"}), "hget": frozenset({"pending"}),
        "hmget": frozenset({"pending", "quotas"}),
        "hgetall": frozenset({"config", "pending"}),
    },
    "worker": {
        "fcall": frozenset({"requests", "tenant_requests", "dead", "reply", "worker", "workers",
                            "retired", "config", "tenants", "cache", "cache_index",
                            "cache_bytes", "cache_claim"}),
        **{command: frozenset({"cache"}) for command in ("hmget", "hstrlen", "hsetnx")},
        **{command: frozenset({"cache_index"}) for command in (
            "zadd", "zrange", "zrangebyscore", "zrem", "zcard")},
        **{command: frozenset({"requests", "tenant_requests"}) for command in (
            "xgroup|create", "xgroup|delconsumer", "xreadgroup", "xack", "xdel", "xclaim",
            "xpending", "xinfo|consumers", "xinfo|groups", "xinfo|stream", "xrange",
            "xrevrange")},
        "xlen": frozenset({"requests", "tenant_requests", "dead"}),
        "xadd": frozenset({"dead"}), "xread": frozenset({"tenants_added"}),
        "exists": frozenset({"requests", "tenant_requests", "worker", "retired"}),
        "del": frozenset({"requests", "tenant_requests", "dead", "worker", "workers", "config",
                          "shards_served", "retired", "cache", "cache_bytes", "cache_claim",
                          "pending"}),
        "rpush": frozenset({"reply"}),
        "pexpire": frozenset({"reply", "worker"}),
        "set": frozenset({"worker", "shards_served", "retired", "cache_bytes", "cache_claim"}),
        "get": frozenset({"shards_served", "cache_bytes", "cache_claim"}),
        "pttl": frozenset({"cache_claim"}),
        "hset": frozenset({"workers", "config"}),
        "hdel": frozenset({"workers", "config", "cache", "pending"}),
        "hkeys": frozenset({"workers"}), "hget": frozenset({"config", "pending", "cache"}),
        "hincrby": frozenset({"pending"}),
        "hgetall": frozenset({"weights", "pending"}),
        **{command: frozenset({"tenants"}) for command in ("smembers", "sismember", "srem")},
    },
}
"""Where docs/SECURITY.md's "Why each right" grants each keyed command; nowhere else."""

ALLOWED_KEYLESS = {
    "producer": frozenset({"multi", "exec", "client|setname"}),
    "worker": frozenset({"multi", "exec", "client|setname", "time", "ping", "config|get",
                         "function|load", "info"}),
}


def granted_commands(words: list[str]) -> set[str]:
    """Every ``+command`` a documented line grants, at its root or in a selector."""
    return {w[1:].lower() for word in words for w in word.strip("()").split()
            if w.startswith("+")}


def dry_run(admin: redis.Redis, user: str, argv: list[str]) -> bool:
    """Whether ``user`` may run ``argv`` (``ACL DRYRUN``: checked, never run)."""
    answer = admin.execute_command("ACL", "DRYRUN", user, *argv)
    return (answer.decode() if isinstance(answer, bytes) else answer) == "OK"


@pytest.mark.parametrize("role", ["producer", "worker"])
def test_each_documented_right_reaches_its_own_keys_and_nothing_else(
    acl_server: RedisServer, role: str,
) -> None:
    """Every command of the documented line, and many it leaves out, on every key of the
    queue, of a shard under the sharded rule, and of another queue: allowed exactly
    where the table says (``ACL DRYRUN``, so nothing runs)."""
    queue, other, password = "mx", "my", uuid.uuid4().hex
    admin = redis.Redis(port=acl_server.port, socket_timeout=10)
    plain, sharded = documented_rules(queue, password)[role], sharded_rules(queue, password)[role]
    admin.execute_command(*plain)
    admin.execute_command(*[f"{queue}-{role}-shards" if w == f"{queue}-{role}" else w
                            for w in sharded])
    assert granted_commands(plain) <= set(ALLOWED[role]) | ALLOWED_KEYLESS[role], (
        "a documented right has no expectation here: add it to ALLOWED")
    user, shard_user = f"{queue}-{role}", f"{queue}-{role}-shards"
    mismatches = []
    cases = [(user, keys.QueueRef(queue), True), (user, keys.QueueRef(queue, shard=1), False),
             (shard_user, keys.QueueRef(queue), True),
             (shard_user, keys.QueueRef(queue, shard=1), True),
             (shard_user, keys.QueueRef(other), False)]
    for who, q, own in cases:
        for command, template in KEYED.items():
            for kind in KEY_KINDS:
                argv = [part.replace("{k}", key_of(q, kind)) for part in template]
                expected = own and kind in ALLOWED[role].get(command, ())
                if dry_run(admin, who, argv) != expected:
                    mismatches.append(f"{who} {command} {key_of(q, kind)}: "
                                      f"{'refused' if expected else 'allowed'}")
    for command, argv in KEYLESS.items():
        for who in (user, shard_user):
            if dry_run(admin, who, argv) != (command in ALLOWED_KEYLESS[role]):
                mismatches.append(f"{who} {command}")
    assert not mismatches, "\n".join(mismatches)
    with pytest.raises(redis.exceptions.NoPermissionError):  # DRYRUN agrees with a real call
        redis.Redis.from_url(user_url(acl_server, user, password), socket_timeout=10).set(
            keys.requests(keys.QueueRef(queue)), "over the stream")
    admin.close()


# ------------------------------------------- what a producer can still do with XADD


def test_entries_written_around_enqueue_past_the_limit_are_refused_as_queue_full(
    acl_server: RedisServer, fleet: Fleet, worker_env: dict[str, str],
) -> None:
    """docs/SECURITY.md, "What a producer can still do with XADD": the documented producer
    XADDs past the workers' max_queue_length (3) with no enqueue; the worker runs the
    oldest 3, and refuses the newest 3 as an enqueue past the limit would be (the
    caller's reply key told ``queue_full``: the ``reply_to`` it names in the queue's
    namespace, else the request's own; the entry dead-lettered), under its own ACL."""
    queue, password = "aclcap", uuid.uuid4().hex
    admin = redis.Redis(port=acl_server.port, socket_timeout=10)
    create_users(admin, queue, password)
    q = keys.QueueRef(queue)
    stream = keys.requests(q)
    admin.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    producer_url = user_url(acl_server, f"{queue}-producer", password)
    raw = redis.Redis.from_url(producer_url, socket_timeout=10)
    texts = {f"raw{i}": f"written around enqueue {i}" for i in range(6)}
    reply_to = {"raw4": keys.reply(q, "shared"), "raw5": "elsewhere"}
    for request_id, text in texts.items():
        named = {"reply_to": reply_to[request_id]} if request_id in reply_to else {}
        raw.xadd(stream, {"v": "1", "id": request_id, "text": text, **named})
    raw.close()

    env = {**worker_env, "TOKENQ_REDIS_URL": user_url(acl_server, f"{queue}-worker", password),
           "TOKENQ_QUEUE": queue, "TOKENQ_MAX_QUEUE_LENGTH": "3"}
    worker = fleet.start(name="w", env=env, ready=admin, queue=queue)
    with Client(redis_url=producer_url, queue=queue) as client:
        for request_id in ("raw0", "raw1", "raw2"):
            assert vector_ok(client.result(request_id, timeout_s=60).embedding, texts[request_id])
        for request_id in ("raw3", "raw5"):  # raw5's reply_to is refused: told on its own
            with pytest.raises(QueueFull, match="maximum length") as refused:
                client.result(request_id, timeout_s=60)
            assert getattr(refused.value, "code", None) == "queue_full"
    told = blpop_within(admin, reply_to["raw4"], 60)
    assert told is not None and wire.decode_reply(told).error.code == "queue_full"
    assert not admin.exists("elsewhere")
    dead = {f[b"id"]: f for _, f in admin.xrange(keys.dead(q))}
    assert set(dead) == {b"raw3", b"raw4", b"raw5"}
    assert {f[b"dead_error_code"] for f in dead.values()} == {b"queue_full"}
    assert dead[b"raw4"][b"text"] == texts["raw4"].encode()  # the letter keeps the request
    assert admin.xlen(stream) == 0
    assert admin.xpending(stream, keys.GROUP)["pending"] == 0
    denials = acl_denials(admin)
    assert not denials, f"commands refused in normal operation: {denials}"
    assert worker.process.poll() is None
