"""A refused write is a failure, never a drop (docs/RELIABILITY.md, "When Redis refuses writes").

Against a real redis-server at ``maxmemory`` with ``noeviction`` (tests/redis_full.py):
Redis refuses each script's first write that grows memory with ``OOM``. Every
path that writes must read that as "Redis refuses writes right now" (fail the
whole call, keep everything, retry) and never as "this key can never take the
write" (settle without it): the publish script (replies and dead letters),
the enqueue script, the dead-letter retry script, and a worker under load.
The rule itself (:mod:`tokenq.shared.redis_refusal`) and its Lua twin are
checked against each other here too.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.faults.test_faults import SIM, Inbox, pending_of, record, scaled, texts_for, wait_for
from tests.redis_full import fill, free, full_fixture
from tests.redis_server import RedisServer, free_ports
from tests.worker.test_health import get
from tests.workers import Fleet
from tokenq.producer import BrokerOutOfMemory, BrokerUnavailable, Client, QueueFull
from tokenq.producer.ops import dlq
from tokenq.producer.ops.stats import main as stats_main
from tokenq.shared import functions, keys, lua_scripts, redis_refusal, wire
from tokenq.shared.settings import ClientSettings
from tokenq.worker.health import Health
from tokenq.worker.loop.publish import Publisher, Target, spelled_out
from tokenq.worker.pipeline.jobs import Answer

ROOT = Path(__file__).resolve().parents[2]
full = full_fixture()


# ------------------------------------------------------------------ the rule


def test_the_lua_twin_knows_the_same_key_refusals() -> None:
    source = (ROOT / "shared" / "lua" / "refusal.lua").read_text()
    table = re.search(r"local KEY_REFUSES = \{(.*?)\}", source)
    assert table is not None
    assert set(re.findall(r"(\w+) = true", table.group(1))) == redis_refusal.KEY_REFUSES


@pytest.mark.parametrize(("error", "kind", "reason"), [
    (redis.exceptions.OutOfMemoryError("command not allowed", status_code="OOM"), "now", "oom"),
    (redis.exceptions.OutOfMemoryError("command not allowed"), "now", "oom"),
    (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), "now",
     "readonly"),
    (redis.exceptions.BusyLoadingError("Redis is loading"), "now", "loading"),
    (redis.exceptions.ResponseError("BUSY Redis is busy running a script"), "now", "busy"),
    (redis.exceptions.ResponseError("MASTERDOWN Link with MASTER is down"), "now", "masterdown"),
    (redis.exceptions.ResponseError("ERR Error running script: -OOM command not allowed"), "now",
     "oom"),
    (redis.exceptions.ResponseError("ERR something nobody has seen"), "now", "other"),
    (redis.exceptions.ResponseError(  # Redis 6: a script's redis.call refused
        "Error running script (call to f_b29c): @user_script:1: @user_script: 1: -OOM command "
        "not allowed when used memory > 'maxmemory'.", status_code="ERR"), "now", "oom"),
    (redis.exceptions.ResponseError("WRONGTYPE Operation against a key"), "key", "wrongtype"),
    (redis.exceptions.NoPermissionError("this user has no permissions"), "key", "noperm"),
    (redis.exceptions.ResponseError(
        "Command # 1 (XRANGE d) of pipeline caused error: WRONGTYPE Operation"), "key",
     "wrongtype"),
    ("OOM command not allowed", "now", "oom"),
    ("-OOM command not allowed", "now", "oom"),
])
def test_which_refusals_settle_and_which_fail_the_call(error, kind, reason) -> None:
    assert redis_refusal.key_refuses(error) is (kind == "key")
    assert redis_refusal.refused_now(error) is (kind == "now")
    assert redis_refusal.reason(error) == reason


@given(st.text(max_size=60))
def test_an_unknown_error_is_never_read_as_the_key_refusing(message: str) -> None:
    """Anything not known to be a key's refusal fails the call (kept, retried), never drops."""
    first = message.lstrip("-").split(" ", 1)[0]
    if first in redis_refusal.KEY_REFUSES or any(
        f"{code} " in message for code in redis_refusal.KEY_REFUSES
    ):
        return
    assert redis_refusal.refused_now(message)
    assert redis_refusal.refused_now(redis.exceptions.ResponseError(message))


def test_readiness_says_redis_refuses_writes_until_a_publish_goes_through() -> None:
    health = Health(heartbeat_s=1.0)
    health.loaded()
    health.running(0.0)
    assert health.ready(0.5).ok
    health.publish_refused("oom: command not allowed when used memory > 'maxmemory'")
    verdict = health.ready(0.5)
    assert not verdict.ok and "redis refuses writes: oom" in verdict.text
    assert health.live(0.5).ok, "a full Redis is not a reason to restart the worker"
    health.publish_ok()
    assert health.ready(0.5).ok


# ------------------------------------------------------------------ publish


def _pending_answers(r: redis.Redis, q: keys.QueueRef, n: int, kind: str) -> list[Answer]:
    """``n`` entries read by consumer c1, and the answer of ``kind`` each one is owed."""
    stream = keys.requests(q)
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    for i in range(n):
        r.xadd(stream, {"id": f"r{i}", "text": "hello"})
    read = r.xreadgroup(keys.GROUP, "c1", {stream: ">"})[0][1]
    answers = []
    for i, (entry_id, _) in enumerate(read):
        reply_to = None if kind == "letter only" else keys.reply(q, f"r{i}")
        dead = () if kind == "reply" else (("id", f"r{i}"), ("dead_error_code", "dead_letter"))
        answers.append(Answer(entry_id, reply_to, f"reply {i}".encode(), ok=kind == "reply",
                              dead_fields=dead))
    return answers


def _publisher(client: aioredis.Redis, q: keys.QueueRef, reply_ttl_ms: int = 60_000,
               refused: list[str] | None = None) -> Publisher:
    return Publisher(
        client, Target(keys.requests(q), keys.dead(q), keys.GROUP, "c1"),
        reply_ttl_ms=reply_ttl_ms, dead_max_len=1000, dead_max_letter_bytes=4096,
        hooks=Refusals(refused if refused is not None else []),
    )


class Refusals:
    """Publish hooks that keep the reason of each refusal."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons

    def refused(self, reason: str, error: str) -> None:
        self.reasons.append(reason)

    def published(self) -> None:
        pass


@pytest.mark.fault
@pytest.mark.parametrize("kind", ["reply", "letter and reply", "letter only"])
def test_publish_into_a_full_redis_keeps_every_answer_until_memory_frees(full, kind) -> None:
    """OOM on the first RPUSH or dead-letter XADD: nothing settled, nothing dropped; after
    memory frees every answer lands exactly once (a reply each, a letter each)."""
    url, r = full
    q = keys.QueueRef("oom")
    n = 20
    answers = _pending_answers(r, q, n, kind)
    refused: list[str] = []

    async def scenario() -> int:
        client = aioredis.Redis.from_url(url)
        try:
            publisher = _publisher(client, q, refused=refused)
            fill(r)
            task = asyncio.create_task(publisher.publish(answers, max_backoff_s=0.2))
            await asyncio.sleep(1.0)
            assert not task.done(), "publish gave up on a full Redis"
            assert pending_of(r, q, "c1") == n, "entries were settled while Redis refused"
            assert r.xlen(keys.dead(q)) == 0
            assert not list(r.scan_iter(match=keys.reply_pattern(q)))
            free(r)
            return await asyncio.wait_for(task, 20)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == n
    assert refused and set(refused) == {"oom"}
    assert pending_of(r, q) == 0 and r.xlen(keys.requests(q)) == 0
    letters_written = r.xlen(keys.dead(q))
    assert letters_written == (0 if kind == "reply" else n)
    if kind != "letter only":
        for i in range(n):
            key = keys.reply(q, f"r{i}")
            assert r.lrange(key, 0, -1) == [f"reply {i}".encode()]
            assert r.pttl(key) > 0
    record(f"Redis full: publish ({kind})", requests=n, refused_tries=len(refused),
           letters_owed=letters_written, lost=0, duplicates=0)


@pytest.mark.parametrize("kind", ["reply", "letter and reply", "letter only"])
def test_the_publish_script_by_eval_answers_oom_before_settling_anything(full, kind) -> None:
    """The script as EVAL runs it (Redis 6, the EVALSHA fallback, other languages): Redis
    refuses its first write that grows memory, and the script must hand that refusal
    back at once instead of reading it as "reply_to cannot take it" and acking."""
    url, r = full
    q = keys.QueueRef("oomeval")
    n = 5
    answers = _pending_answers(r, q, n, kind)
    names, packed = _publisher(aioredis.Redis.from_url(url), q).arguments(answers)
    args = spelled_out(packed)
    source = lua_scripts.load("tokenq.worker", "publish.lua")
    fill(r)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        r.eval(source, len(names), *names, *args)
    assert pending_of(r, q, "c1") == n and r.xlen(keys.dead(q)) == 0
    assert not list(r.scan_iter(match=keys.reply_pattern(q)))
    free(r)
    assert r.eval(source, len(names), *names, *args) == [n, 0, 0]
    assert pending_of(r, q) == 0 and r.xlen(keys.dead(q)) == (0 if kind == "reply" else n)


def test_publish_with_a_ttl_redis_would_refuse_writes_nothing(redis_url, r, queue_name) -> None:
    """A TTL PEXPIRE would refuse is caught before the first write: no reply without a
    TTL, no duplicate on the retry, no entry dead-lettered; the call fails."""
    q = keys.QueueRef(queue_name)
    answers = _pending_answers(r, q, 3, "reply")

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            with pytest.raises(redis.ResponseError, match="reply_ttl_ms"):
                await _publisher(client, q, reply_ttl_ms=10**16).publish_once(answers)
        finally:
            await client.aclose()

    asyncio.run(scenario())
    assert not list(r.scan_iter(match=keys.reply_pattern(q)))
    assert pending_of(r, q, "c1") == 3 and r.xlen(keys.dead(q)) == 0


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(ttl_ms=st.one_of(st.integers(60_000, 10**15 - 1), st.sampled_from([10**14, 10**15 - 1])))
def test_every_ttl_the_script_takes_reaches_the_reply(redis_url, r, ttl_ms: int) -> None:
    """Any TTL of up to 15 digits is set as given (a Lua number would reach Redis as 1e+14)."""
    q = keys.QueueRef(f"ttl{time.monotonic_ns()}")
    answers = _pending_answers(r, q, 1, "reply")

    async def scenario() -> int:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await _publisher(client, q, reply_ttl_ms=ttl_ms).publish_once(answers)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == 1
    key = keys.reply(q, "r0")
    assert r.llen(key) == 1 and 0 < r.pttl(key) <= ttl_ms
    r.delete(key, keys.requests(q))


# ------------------------------------------------------------------ enqueue and retry


@pytest.mark.fault
def test_enqueue_into_a_full_redis_names_out_of_memory_and_writes_nothing(full) -> None:
    url, r = full
    q = keys.QueueRef("oomq")
    settings_ = ClientSettings(redis_url=url, queue=q.name, dedupe_ttl_s=60.0, timeout_s=5)
    with Client(settings=settings_) as client:
        client.submit("warm up")
        before = r.xlen(keys.requests(q))
        seen_before = len(list(r.scan_iter(match=keys.seen(q, "*"))))
        fill(r)
        with pytest.raises(BrokerOutOfMemory, match="out of memory") as refused:
            client.submit_many([f"text {i}" for i in range(50)])
        assert isinstance(refused.value, QueueFull)
        assert r.xlen(keys.requests(q)) == before, "half a batch was written"
        assert len(list(r.scan_iter(match=keys.seen(q, "*")))) == seen_before
        free(r)
        assert len(client.submit_many([f"text {i}" for i in range(50)])) == 50
    assert r.xlen(keys.requests(q)) == before + 50
    record("Redis full: enqueue", requests=50, refused_while_full=50, lost=0, duplicates=0)


@pytest.mark.parametrize("ttl", ["100000000000000", "1.5", "1e3", "9999999999999999"])
def test_enqueue_takes_a_dedupe_ttl_whole_or_refuses_it_before_writing(r, queue_name, ttl):
    """The seen key's SET PX comes after the XADD: a TTL Redis would refuse there must be
    refused before it (or, of up to 15 digits, passed as given), never half-write."""
    q = keys.QueueRef(queue_name)
    script = r.register_script(lua_scripts.load("tokenq.producer", "enqueue.lua"))
    stream, seen = keys.requests(q), keys.seen(q, "x1")
    whole = len(ttl) <= 15 and ttl.isdigit()
    try:
        script(keys=[stream, seen], args=[0, 1, ttl, 1, "id", "x1"])
    except redis.ResponseError as exc:
        assert not whole, exc
        assert r.xlen(stream) == 0 and not r.exists(seen)
        return
    assert whole
    assert r.xlen(stream) == 1 and 0 < r.pttl(seen) <= int(ttl)


@pytest.mark.fault
def test_dead_letter_retry_into_a_full_redis_moves_nothing(full) -> None:
    _, r = full
    q = keys.QueueRef("oomd")
    letter = r.xadd(keys.dead(q), {"id": "d1", "text": "hi", "dead_error_code": "dead_letter"})
    fill(r)
    with pytest.raises(redis.ResponseError) as refused:  # Redis 6 wraps it: "Error running…"
        dlq.retry(r, q, [letter.decode()], max_queue_length=0)
    assert redis_refusal.is_out_of_memory(refused.value), refused.value
    assert r.xlen(keys.dead(q)) == 1 and r.xlen(keys.requests(q)) == 0
    free(r)
    assert dlq.retry(r, q, [letter.decode()], max_queue_length=0).moved == [letter.decode()]
    assert r.xlen(keys.dead(q)) == 0 and r.xlen(keys.requests(q)) == 1
    record("Redis full: dead-letter retry", requests=1, refused_while_full=1, lost=0,
           duplicates=0)


# ------------------------------------------------------------------ a worker under load


@pytest.mark.fault
def test_worker_under_load_answers_every_accepted_request_once_after_memory_frees(
    full, worker_env, tmp_path, queue_name
) -> None:
    """Redis fills while a worker computes: answers wait (no reply, no letter, entries
    pending), enqueues are refused with an out-of-memory error; once memory frees every
    accepted request is answered exactly once and none is dead-lettered."""
    url, r = full
    q = keys.QueueRef(queue_name)
    fleet = Fleet({**worker_env, "TOKENQ_REDIS_URL": url}, tmp_path, SIM, ready_timeout=60)
    try:
        inbox = Inbox(r, keys.reply(q, "oom"))
        texts = texts_for(22, scaled(400))
        with r.pipeline(transaction=False) as pipe:
            for index, text in enumerate(texts):
                pipe.xadd(keys.requests(q), wire.encode_request(wire.Request(
                    id=f"t{index}", text=text, tokens=len(text.split()) + 2,
                    reply_to=inbox.key)))
            pipe.execute()
        port = free_ports(1)
        worker = fleet.start("--sim-batch-ms", "20", "--max-batch-size", "8",
                             "--max-batch-tokens", "1024", "--metrics-port", str(port),
                             "--metrics-host", "127.0.0.1", ready=r, queue=queue_name)
        wait_for(lambda: r.llen(inbox.key) > 0, 60, "the first replies")
        fill(r)
        refused = 0
        settings_ = ClientSettings(redis_url=url, queue=queue_name, timeout_s=2)
        with Client(settings=settings_) as client:
            for _ in range(5):
                with pytest.raises(BrokerOutOfMemory):
                    client.submit("refused while full")
                refused += 1
        inbox.drain(lambda: False, timeout=3.0)  # 6 heartbeats: nothing may settle meanwhile
        answered_while_full = sum(inbox.counts.values())
        held = pending_of(r, q)
        assert r.xlen(keys.requests(q)) == len(texts) - len(inbox.counts), (
            "entries were settled without their reply while Redis was full")
        assert held > 0, "the worker finished before Redis filled: the test proved nothing"
        inbox.settle(1.0)
        assert sum(inbox.counts.values()) == answered_while_full, (
            "answers landed while Redis refused them")
        assert r.xlen(keys.dead(q)) == 0, (
            "an answer was dead-lettered because Redis was full", r.xrange(keys.dead(q), count=2),
            worker.output()[-3000:])
        assert worker.process.poll() is None, worker.output()
        assert r.exists(keys.worker_alive(q, worker.name)), "its liveness lapsed while full"
        status, body = get(port, "/readyz")
        assert status == 503 and "redis refuses writes: oom" in body, body
        refusals = f'tokenq_redis_refusals_total{{queue="{queue_name}",reason="oom"}}'
        assert refusals in get(port, "/metrics")[1]
        free(r)
        inbox.drain(lambda: len(inbox.counts) == len(texts), 60)
        inbox.settle(1.0)
        assert len(inbox.counts) == len(texts), fleet.logs()
        assert inbox.duplicates() == 0
        assert all(reply.ok for reply in inbox.replies.values())
        assert r.xlen(keys.dead(q)) == 0 and pending_of(r, q) == 0
        assert r.xlen(keys.requests(q)) == 0
        wait_for(lambda: get(port, "/readyz")[0] == 200, 10, "/readyz to turn 200 again")
        log = worker.output()
        assert log.count("out of memory (maxmemory) and refuses writes") == 1, log[-3000:]
        record("Redis full (maxmemory, noeviction)", requests=len(texts),
               held_while_full=held, refused_while_full=refused, dead_lettered=0,
               lost=0, duplicates=0)
    finally:
        fleet.close()


# ------------------------------------------------------------------ a write sent to a replica


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[tuple[str, redis.Redis]]:
    """A private redis-server made a replica of a port nobody listens on: it answers every
    write ``READONLY``, as a master demoted by a failover does behind a DNS name."""
    server = RedisServer(tmp_path / "replica")
    server.start()
    client = redis.Redis.from_url(server.url)
    try:
        client.replicaof("127.0.0.1", str(free_ports()))
        yield server.url, client
    finally:
        client.close()
        server.stop(kill=True)


def test_a_write_refused_read_only_fails_the_call_by_name_and_infer_retries_it(replica):
    """READONLY means the command did not run: ``submit`` (which returns at once) fails
    naming it; ``infer`` (which was given time for an answer) retries until promoted."""
    url, r = replica
    stream = keys.requests(keys.QueueRef("ro"))
    with (Client(redis_url=url, queue="ro", timeout_s=1.0) as client,
          pytest.raises(BrokerUnavailable, match="read-only replica")):
        client.submit("refused while read-only")
    assert r.xlen(stream) == 0

    promote = threading.Timer(0.5, lambda: r.replicaof("NO", "ONE"))
    promote.start()
    try:
        with (Client(redis_url=url, queue="ro", timeout_s=2.0) as patient,
              pytest.raises(TimeoutError)):  # no worker: written, then nobody answers
            patient.infer("taken once the replica is promoted")
    finally:
        promote.join()
    assert r.xlen(stream) == 1


# ------------------------------------------------------- reads while Redis refuses writes


def refuse_writes(r: redis.Redis, how: str, directory: Path) -> None:
    """Make ``r`` refuse every write as a stale primary (``READONLY``), a primary short of
    replicas (``NOREPLICAS``) or one whose last save failed (``MISCONF``: its ``directory``
    removed) does, keeping its data."""
    if how == "readonly":
        r.replicaof("127.0.0.1", str(free_ports()))
    elif how == "noreplicas":
        r.config_set("min-replicas-to-write", "1")
    else:
        shutil.rmtree(directory)
        r.config_set("save", "3600 1")  # writes are refused only where saves are configured
        r.config_set("stop-writes-on-bgsave-error", "yes")
        r.bgsave()
        wait_for(lambda: r.info("persistence")["rdb_last_bgsave_status"] == "err",
                 what="a failed save")


@pytest.mark.parametrize("library", ["loaded", "missing"])
@pytest.mark.parametrize("how", ["readonly", "noreplicas", "misconf"])
def test_reads_go_on_while_redis_refuses_writes(
    tmp_path: Path, capsys, how: str, library: str,
) -> None:
    """When Redis refuses writes an operator most needs the queue's depth: ``queue_length``,
    ``tokenq stats``, the worker's gauges and every read-only function still run (``FCALL`` of
    a ``no-writes`` function is a read to Redis), and the writes are still refused. Such a Redis
    refuses ``FUNCTION LOAD`` too: where it lacks this version's library (an upgrade, a flush),
    each read runs as a script (``SCRIPT LOAD`` is no write)."""
    server = RedisServer(tmp_path / "ro")
    server.start()
    r = redis.Redis.from_url(server.url, socket_timeout=10)

    async def depth() -> list[int]:  # the worker's gauges: the asyncio twin
        client = aioredis.Redis.from_url(server.url, socket_timeout=10)
        try:
            return await functions.AsyncFunction(client, "queue_depth")(
                keys=[keys.requests(keys.QueueRef("ro"))], args=["depth", keys.GROUP])
        finally:
            await client.aclose()

    try:
        functions.load(r)
        with Client(redis_url=server.url, queue="ro", max_queue_length=0, timeout_s=2) as client:
            client.submit_many(["a short text", "another one", "a third"])
            if library == "missing":
                r.function_flush()
            refuse_writes(r, how, server.directory)
            assert client.queue_length() == 3
            with pytest.raises(BrokerUnavailable):
                client.submit("refused")
        assert stats_main(["--redis-url", server.url, "--json", "--queue", "ro"]) == 0
        [row] = json.loads(capsys.readouterr().out)["queues"]
        assert (row["length"], row["lag"]) == (3, 3)
        assert asyncio.run(depth())[:3] == [3, 0, 3]
        read_only = [short for short, script in lua_scripts.SCRIPTS.items()
                     if "no-writes" in script.flags]
        assert {"queue_depth", "peek_replies", "enqueue_seen"} <= set(read_only)
        for short in read_only:  # run, whatever they answer to these arguments
            try:
                functions.Function(r, short)(keys=[keys.requests(keys.QueueRef("ro"))])
            except redis.exceptions.ResponseError as exc:
                assert redis_refusal.error_code(exc) not in redis_refusal.WRITES_REFUSED, (
                    f"{short}: {exc}")
        assert bool(r.function_list()) == (library == "loaded")  # nothing loaded
    finally:
        r.close()
        server.stop(kill=True)
