"""Fault injection: real worker processes, a real redis-server, real failures.

What docs/RELIABILITY.md promises, proven by breaking things on purpose:
kill -9 of workers mid-run, Redis restarted (AOF on) and stopped for longer
than callers wait, malformed entries mixed into valid load, entries whose
holders keep dying, SIGTERM under load, keys left behind, a worker presumed
dead that comes back, reply keys that refuse the reply, and the race between
removing a dead consumer and it waking up.

Every test is marked ``fault``. Sizes are modest by default so that CI runs
the whole file in a few minutes on a busy machine; ``TOKENQ_FAULT_SCALE=5``
runs the issue's full numbers (20,000 requests through repeated kills).
With ``TOKENQ_FAULT_REPORT=<file>`` each test appends one JSON line of what it
did (requests, kills, restarts, lost, duplicates) for ``scripts/fault_report.py``.

The assertions are about behaviour, never speed: timeouts are generous and
every wait polls for a condition.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.lossy_proxy import LossyProxy
from tests.redis_server import RedisServer
from tests.support import SimModel, blpop_within, fleet_fixture, pending_tokens, wait_for
from tokenq.producer import AsyncClient, Client
from tokenq.shared import keys, wire
from tokenq.shared.errors import BrokerUnavailable, RemoteError
from tokenq.shared.settings import ClientSettings
from tokenq.worker.loop.recovery import Reclaimer
from tokenq.worker.settings import WorkerSettings

pytestmark = pytest.mark.fault

SCALE = float(os.environ.get("TOKENQ_FAULT_SCALE", "1"))
REPORT = os.environ.get("TOKENQ_FAULT_REPORT")

DIM = 32
MAX_INPUT = 512
HEARTBEAT_S = 0.5
"""A worker silent for 3 heartbeats (1.5 s) is presumed dead."""
MODEL = SimModel(DIM, MAX_INPUT)
SIM = MODEL.flags("--heartbeat-s", str(HEARTBEAT_S), "--log-level", "INFO")
vector_ok = MODEL.vector_ok
fleet = fleet_fixture(*SIM)
DEAD_LETTER_BYTES = WorkerSettings.model_fields["dead_max_letter_bytes"].default
SLACK_S = 3.0
"""How late a caller's error may come after its timeout (a loaded 2-core CI box)."""
VOCABULARY = ["alpha", "beta", "gamma", "delta", "queue", "token", "batch", "redis", "model"]


def scaled(n: int) -> int:
    """``n`` times TOKENQ_FAULT_SCALE, at least 1."""
    return max(1, round(n * SCALE))


def record(test: str, **numbers: Any) -> None:
    """Append what a test did to TOKENQ_FAULT_REPORT (read by scripts/fault_report.py)."""
    if REPORT:
        with open(REPORT, "a", encoding="utf-8") as out:
            out.write(json.dumps({"test": test, "scale": SCALE, **numbers}) + "\n")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(n))


def texts_for(seed: int, n: int, longest: int = 120) -> list[str]:
    rng = random.Random(seed)
    return [words(rng, rng.randint(3, longest)) for _ in range(n)]


def pending_of(r: redis.Redis, q: keys.QueueRef, consumer: str | None = None,
               tenants: tuple[str, ...] = (keys.DEFAULT_TENANT,)) -> int:
    """Entries delivered and not acked, on the ``tenants``' streams (to ``consumer``)."""
    held = 0
    for stream in (keys.tenant_requests(q, tenant) for tenant in tenants):
        if consumer is None:
            held += int(r.xpending(stream, keys.GROUP)["pending"]) if r.exists(stream) else 0
        else:
            held += len(r.xpending_range(stream, keys.GROUP, "-", "+", 100_000,
                                         consumername=consumer)) if r.exists(stream) else 0
    return held


class Inbox:
    """Every reply pushed on one shared reply key, counted by request id.

    Pops survive Redis being restarted (errors are retried), so a test can
    keep collecting across a restart.
    """

    def __init__(self, r: redis.Redis, key: str) -> None:
        self.r = r
        self.key = key
        self.counts: Counter[str] = Counter()
        self.replies: dict[str, wire.Reply] = {}

    def drain(self, until: Callable[[], bool], timeout: float,
              on_progress: Callable[[], None] | None = None) -> None:
        """Pop replies until ``until()`` holds or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            self.pop_some(0.5)
            if on_progress is not None:
                on_progress()

    def pop_some(self, block_s: float) -> int:
        try:
            popped = self.r.blpop([self.key], timeout=block_s)
            if popped is None:
                return 0
            raws = [popped[1], *(self.r.lpop(self.key, 1000) or [])]
        except (redis.ConnectionError, redis.TimeoutError):
            time.sleep(0.2)
            return 0
        for raw in raws:
            reply = wire.decode_reply(raw)
            self.counts[reply.id] += 1
            self.replies.setdefault(reply.id, reply)
        return len(raws)

    def settle(self, quiet_s: float) -> None:
        """Keep popping for ``quiet_s``: a late duplicate would show up here."""
        deadline = time.monotonic() + quiet_s
        while time.monotonic() < deadline:
            self.pop_some(0.25)

    def duplicates(self) -> int:
        return sum(count - 1 for count in self.counts.values() if count > 1)


def env_for(worker_env: dict[str, str], url: str) -> dict[str, str]:
    return {**worker_env, "TOKENQ_REDIS_URL": url}


# ------------------------------------------------------------------ 1. kill -9


BOTH = (keys.DEFAULT_TENANT, "a")


@pytest.mark.slow
def test_kill_9_workers_repeatedly_every_request_answered_once(fleet, r, redis_url, queue_name):
    """kill -9 a worker again and again under load; replacements start; nothing lost or doubled;
    the pending tokens, the sum and tenant ``a``'s part, match the streams at each kill."""
    n = scaled(4000)
    kills = scaled(4)
    q = keys.QueueRef(queue_name)
    flags = ("--max-batch-tokens", "2048", "--max-batch-size", "32", "--sim-batch-ms", "15",
             "--max-deliveries", "1000",  # so that no request is dead-lettered by bad luck
             "--claim-idle-s", "3600")  # only the heartbeat path may rescue within the test
    live = fleet.start_many(3, *flags, ready=r, queue=queue_name)
    texts = texts_for(1, n)
    inbox = Inbox(r, keys.reply(q, "kill9"))
    by_id: dict[str, str] = {}
    with Client(redis_url=redis_url, queue=queue_name) as client:
        for start in range(0, n, 500):
            chunk = texts[start:start + 500]
            tenant = "a" if start % 1000 else None  # half on a tenant's stream
            ids = client.submit_many(chunk, reply_to=inbox.key, tenant=tenant)
            by_id.update(zip(ids, chunk, strict=True))

    rng = random.Random(2)
    thresholds = [int(n * 0.85 * (i + 1) / (kills + 1)) for i in range(kills)]
    orphaned: list[int] = []

    def maybe_kill() -> None:
        while thresholds and len(inbox.counts) >= thresholds[0]:
            thresholds.pop(0)
            victim = rng.choice(live)
            held = pending_of(r, q, victim.name, BOTH)
            victim.kill()
            orphaned.append(held)
            counted, in_stream = pending_tokens(r, q, BOTH)  # its batch left mid-way, unacked
            assert counted == in_stream > 0
            live.remove(victim)
            live.append(fleet.start(*flags))

    inbox.drain(lambda: len(inbox.counts) >= n, timeout=120 + n / 20, on_progress=maybe_kill)
    inbox.settle(4 * HEARTBEAT_S * 3)

    lost = [i for i in by_id if i not in inbox.counts]
    duplicates = inbox.duplicates()
    record("kill -9 workers", requests=n, kills=len(orphaned), orphaned=sum(orphaned),
           lost=len(lost), duplicates=duplicates)
    assert len(orphaned) == kills, f"only {len(orphaned)} of {kills} kills happened"
    assert sum(orphaned) > 0, "no killed worker held entries: the test proved nothing"
    assert not lost, f"{len(lost)} requests never answered:\n{fleet.logs()}"
    assert duplicates == 0, {i: c for i, c in inbox.counts.items() if c > 1}
    assert set(inbox.counts) == set(by_id)
    for request_id, text in by_id.items():
        reply = inbox.replies[request_id]
        assert reply.ok and vector_ok(reply.embedding, text), reply
    wait_for(lambda: pending_of(r, q, tenants=BOTH) == 0, 30, "pending 0")
    assert r.xlen(keys.requests(q)) == r.xlen(keys.tenant_requests(q, "a")) == 0
    assert r.xlen(keys.dead(q)) == 0
    assert r.hgetall(keys.pending(q)) == {b"tokens": b"0"}  # every entry's field, a's, gone too


# ------------------------------------------------------- 2. Redis restart, AOF on


def test_redis_restart_with_aof_answers_every_enqueued_request(fleet, worker_env, tmp_path):
    """Restart Redis (graceful, AOF on) under load: whatever was enqueued gets its answer."""
    server = RedisServer(tmp_path / "aof", appendonly=True)
    server.start()
    queue = f"aof{uuid.uuid4().hex[:8]}"
    q = keys.QueueRef(queue)
    restarts = 1 if SCALE <= 1 else 3
    try:
        env = {**env_for(worker_env, server.url), "TOKENQ_QUEUE": queue}
        admin = redis.Redis.from_url(server.url, socket_timeout=5)
        slow = ("--sim-batch-ms", "40", "--max-batch-size", "16", "--max-batch-tokens", "2048")
        workers = fleet.start_many(2, *slow, env=env, ready=admin, queue=queue)
        outcome = _run_producers_across_restarts(server, queue, restarts, admin, q)
        checked, refused, backlog = outcome
        admin = redis.Redis.from_url(server.url, socket_timeout=5)
        wait_for(lambda: pending_of(admin, q) == 0 and admin.xlen(keys.requests(q)) == 0,
                 60, "the stream to drain")
        record("Redis restarted (AOF on)", requests=checked, restarts=restarts,
               backlog_at_restart=backlog, refused_while_down=refused, lost=0, duplicates=0)
        assert all(w.process.poll() is None for w in workers), fleet.logs()
        assert backlog > 0, "Redis was restarted with nothing queued: the test proved nothing"
        admin.close()
    finally:
        server.stop()


def _run_producers_across_restarts(
    server: RedisServer, queue: str, restarts: int, admin: redis.Redis, q: keys.QueueRef
) -> tuple[int, int, int]:
    """Two producers (infer_many; submit + results) run while Redis restarts.

    Returns (requests checked, enqueue calls refused while Redis was down,
    entries queued at the restarts). An enqueue that raised wrote nothing we
    count on; every enqueue that returned must be answered, correctly.
    """
    rounds = scaled(12)
    errors: list[BaseException] = []
    refused = Counter[str]()
    checked = Counter[str]()
    progress = threading.Semaphore(0)

    def infer_many_producer() -> None:
        with Client(redis_url=server.url, queue=queue, timeout_s=120) as client:
            for index in range(rounds):
                texts = texts_for(100 + index, 40)
                try:
                    results = client.infer_many(texts, timeout_s=120)
                except BrokerUnavailable:
                    refused["infer_many"] += 1
                    time.sleep(0.2)
                    continue
                for text, result in zip(texts, results, strict=True):
                    if not vector_ok(bytes(result.embedding), text):
                        raise AssertionError(f"wrong vector for {text!r}")
                checked["infer_many"] += len(texts)
                progress.release()

    def submit_producer() -> None:
        submitted: list[tuple[list[str], list[str]]] = []
        with Client(redis_url=server.url, queue=queue, timeout_s=120) as client:
            for index in range(rounds):
                texts = texts_for(500 + index, 60)
                try:
                    submitted.append((client.submit_many(texts), texts))
                except BrokerUnavailable:
                    refused["submit"] += 1
                    time.sleep(0.2)
                    continue
                progress.release()
                time.sleep(0.3)
            for ids, texts in submitted:
                results = client.results(ids, timeout_s=120)
                for text, result in zip(texts, results, strict=True):
                    if not vector_ok(bytes(result.embedding), text):
                        raise AssertionError(f"wrong vector for {text!r}")
                checked["submit"] += len(texts)

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(f), daemon=True)
               for f in (infer_many_producer, submit_producer)]
    for thread in threads:
        thread.start()
    backlog = 0
    for _ in range(restarts):
        for _ in range(3):  # let some work through first
            progress.acquire(timeout=60)
        backlog += admin.xlen(keys.requests(q))
        admin.close()
        server.stop()  # SIGTERM: Redis writes the AOF out and exits
        time.sleep(1.5)
        server.start()
        admin = redis.Redis.from_url(server.url, socket_timeout=5)
    for thread in threads:
        thread.join(timeout=400)
    assert not any(t.is_alive() for t in threads), "a producer hung"
    assert not errors, errors
    assert checked["infer_many"] > 0 and checked["submit"] > 0, checked
    return sum(checked.values()), sum(refused.values()), backlog


# -------------------------------------------------- 3. Redis down past timeouts


def test_redis_down_longer_than_timeouts_gives_clear_errors_then_recovers(
    fleet, worker_env, tmp_path
):
    """Callers get BrokerUnavailable/ReplyTimeout by their timeout; workers come back."""
    server = RedisServer(tmp_path / "down")  # no AOF: it comes back empty (NOGROUP)
    server.start()
    queue = f"down{uuid.uuid4().hex[:8]}"
    timeout = 2.0
    try:
        env = {**env_for(worker_env, server.url), "TOKENQ_QUEUE": queue}
        admin = redis.Redis.from_url(server.url, socket_timeout=5)
        worker = fleet.start(env=env, ready=admin, queue=queue)
        admin.close()
        with Client(redis_url=server.url, queue=queue) as client:
            assert vector_ok(bytes(client.infer("before", timeout_s=30).embedding), "before")
            server.stop()
            down_since = time.monotonic()
            calls: dict[str, Callable[[], Any]] = {
                "infer": lambda: client.infer("during", timeout_s=timeout),
                "infer_many": lambda: client.infer_many(["a", "b"], timeout_s=timeout),
                "result": lambda: client.result(uuid.uuid4().hex, timeout_s=timeout),
                "submit": lambda: client.submit("during"),
                "async infer": lambda: asyncio.run(_async_infer(server.url, queue, timeout)),
            }
            elapsed: dict[str, float] = {}
            for name, call in calls.items():
                started = time.monotonic()
                with pytest.raises((BrokerUnavailable, TimeoutError, ConnectionError)) as caught:
                    call()
                elapsed[name] = time.monotonic() - started
                assert isinstance(caught.value, (TimeoutError, ConnectionError)), caught.value
                assert elapsed[name] <= timeout + SLACK_S, (name, elapsed[name], caught.value)
            downtime = max(2 * timeout + 1, 6.0)
            time.sleep(max(0.0, downtime - (time.monotonic() - down_since)))
            server.start()
            result = client.infer("after the outage", timeout_s=90)
            assert vector_ok(bytes(result.embedding), "after the outage")
            assert worker.process.poll() is None
        record("Redis down past timeouts", requests=2, downtime_s=round(downtime, 1),
               calls=len(calls), slowest_error_s=round(max(elapsed.values()), 2),
               timeout_s=timeout, lost=0, duplicates=0)
    finally:
        server.stop()


async def _async_infer(url: str, queue: str, timeout: float) -> Any:
    async with AsyncClient(redis_url=url, queue=queue) as client:
        return await client.infer("async during", timeout_s=timeout)


# ------------------------------------------------------- 4. malformed entries


@dataclass(frozen=True)
class Malformed:
    """One broken entry: its fields, and what its caller is owed."""

    fields: dict[str, bytes]
    id_intact: bool
    """Its ``id`` is valid, so the worker can name it in the reply."""
    reply_to_intact: bool
    """It names a valid ``reply_to`` (the test's inbox)."""
    broke: tuple[str, ...]


_ASCII_WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=12)
_BAD_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80",
                             b"\xe2\x82", b"\x80abc"])
_BAD_INT = st.one_of(
    _ASCII_WORDS.map(str.encode),
    st.integers(max_value=-1).map(lambda i: str(i).encode()),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda f: f"{f!r}x".encode()),
    _BAD_UTF8,
    st.just(b""),
)
_PACKABLE_INT = st.integers(-(2**63), 2**64 - 1)
_NOT_A_MAP = st.one_of(
    _PACKABLE_INT.map(lambda i: msgpack.packb(i)),
    st.lists(_PACKABLE_INT, max_size=4).map(lambda v: msgpack.packb(v)),
    _ASCII_WORDS.map(lambda s: msgpack.packb(s)),
    st.dictionaries(_PACKABLE_INT, _PACKABLE_INT, min_size=1, max_size=3).map(
        lambda d: msgpack.packb(d)),  # non-string keys
    st.binary(max_size=20).map(lambda b: b"\xc1" + b),  # 0xc1 is never valid msgpack
    st.dictionaries(_ASCII_WORDS, _PACKABLE_INT, min_size=1, max_size=3).map(
        lambda d: msgpack.packb(d)[:-1]),  # truncated map
    st.just(msgpack.packb({"big": "x" * 70_000})),  # over the 64 KiB opts limit
)


_BREAKS = [
    "no v", "bad v", "no id", "bad id", "no text", "empty text", "utf8 text", "oversize text",
    "bad tokens", "bad deadline", "bad opts", "bad text_pair", "bad reply_to",
]


@st.composite
def malformed_entries(draw: st.DrawFn, primary: str, max_request_bytes: int) -> Malformed:
    """A valid entry that breaks rule ``primary`` of docs/PROTOCOL.md, and maybe more."""
    text = " ".join(draw(st.lists(_ASCII_WORDS, min_size=1, max_size=8)))
    fields: dict[str, bytes] = {
        "v": b"1", "id": b"filled-in-later", "text": text.encode(), "tokens": b"7",
    }
    id_intact = reply_to_intact = True
    extra = draw(st.lists(st.sampled_from(_BREAKS), max_size=2, unique=True))
    breaks = [primary, *(what for what in extra if what != primary)]
    for what in breaks:
        if what == "no v":
            del fields["v"]
        elif what == "bad v":
            fields["v"] = draw(st.one_of(
                st.integers().filter(lambda i: i != 1).map(lambda i: str(i).encode()),
                _ASCII_WORDS.map(str.encode), _BAD_UTF8, st.just(b"")))
        elif what == "no id":
            del fields["id"]
            id_intact = False
        elif what == "bad id":
            fields["id"] = draw(st.one_of(
                st.just(b""), st.just(b"x" * 129), _BAD_UTF8,
                _ASCII_WORDS.map(lambda s: f"{s} {s}".encode()),
                _ASCII_WORDS.map(lambda s: f"{s}\x01".encode())))
            id_intact = False
        elif what == "no text":
            del fields["text"]
        elif what == "empty text":
            fields["text"] = draw(st.sampled_from([b"", b" ", b"\t\n", "\u3000 ".encode()]))
        elif what == "utf8 text":
            fields["text"] = fields.get("text", b"x") + draw(_BAD_UTF8)
        elif what == "oversize text":
            size = draw(st.integers(max_request_bytes + 1, max_request_bytes + 2000))
            fields["text"] = b"a " * (size // 2) + b"a"
        elif what == "bad tokens":
            fields["tokens"] = draw(_BAD_INT)
        elif what == "bad deadline":
            fields["deadline_ms"] = draw(_BAD_INT.filter(bool))  # empty means "none"
        elif what == "bad opts":
            fields["opts"] = draw(_NOT_A_MAP)
        elif what == "bad text_pair":
            fields["text_pair"] = draw(st.one_of(st.sampled_from([b"", b"  "]), _BAD_UTF8))
        elif what == "bad reply_to":
            fields["reply_to"] = draw(st.one_of(st.just(b""), st.just(b"k" * 513), _BAD_UTF8))
            reply_to_intact = False
    return Malformed(fields, id_intact, reply_to_intact, tuple(breaks))


def generate_malformed(count: int, max_request_bytes: int) -> list[Malformed]:
    """``count`` entries drawn by hypothesis (derandomized), every rule broken about equally.

    One hypothesis run per rule, so that a fault the decoder checks first (a
    missing ``v``) cannot crowd out the others.
    """
    drawn: list[Malformed] = []
    per_rule = -(-count // len(_BREAKS))
    for primary in _BREAKS:

        @settings(max_examples=per_rule, derandomize=True, database=None,
                  phases=[Phase.generate], deadline=None, suppress_health_check=list(HealthCheck))
        @given(malformed_entries(primary, max_request_bytes))
        def draw(entry: Malformed) -> None:
            drawn.append(entry)

        draw()
    assert len(drawn) >= count, f"hypothesis drew only {len(drawn)} entries"
    return drawn[:count]


def test_malformed_entries_are_dead_lettered_and_valid_load_is_answered(fleet, r, queue_name):
    """1,000 hypothesis-made broken entries among valid ones: each broken one is a dead
    letter with an error reply where it named a caller; every valid one is answered right."""
    max_bytes = 4096
    bad = generate_malformed(scaled(1000), max_bytes)
    good = texts_for(4, scaled(2000), longest=60)
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    inbox = Inbox(r, keys.reply(q, "mixed"))
    worker = fleet.start("--max-request-bytes", str(max_bytes), ready=r, queue=queue_name)

    # Interleave, then XADD exactly what a producer in another language might write.
    order = [("good", i) for i in range(len(good))] + [("bad", i) for i in range(len(bad))]
    random.Random(5).shuffle(order)
    good_ids: dict[str, str] = {}
    expected_reply: dict[str, str] = {}  # reply id -> the key it must land on
    stream_ids: dict[bytes, Malformed] = {}
    with r.pipeline(transaction=False) as pipe:
        for kind, index in order:
            if kind == "good":
                request_id = f"good-{index}"
                good_ids[request_id] = good[index]
                pipe.xadd(stream, wire.encode_request(wire.Request(
                    id=request_id, text=good[index], tokens=5, reply_to=inbox.key)))
                continue
            entry = bad[index]
            fields = dict(entry.fields)
            if entry.id_intact:
                fields["id"] = f"bad-{index}".encode()  # unique, valid
            if entry.reply_to_intact:
                fields["reply_to"] = inbox.key.encode()
            pipe.xadd(stream, fields)
        added = pipe.execute()
    for (kind, index), stream_id in zip(order, added, strict=True):
        if kind == "bad":
            entry = bad[index]
            stream_ids[stream_id] = entry
            reply_id = f"bad-{index}" if entry.id_intact else stream_id.decode()
            if entry.reply_to_intact:
                expected_reply[reply_id] = inbox.key
            elif entry.id_intact:
                expected_reply[reply_id] = keys.reply(q, reply_id)

    inbox.drain(lambda: len(inbox.counts) >= len(good_ids) + sum(
        1 for key in expected_reply.values() if key == inbox.key), timeout=180)
    wait_for(lambda: r.xlen(stream) == 0, 60, "the stream to drain")
    inbox.settle(1.0)

    for request_id, text in good_ids.items():
        reply = inbox.replies.get(request_id)
        assert reply is not None, f"valid request {request_id} got no reply"
        assert reply.ok and vector_ok(reply.embedding, text), reply
    for reply_id, key in expected_reply.items():
        if key == inbox.key:
            reply = inbox.replies.get(reply_id)
        else:
            raw = r.lpop(key)
            reply = wire.decode_reply(raw) if raw else None
        assert reply is not None, f"malformed entry {reply_id} got no error reply on {key}"
        assert not reply.ok and reply.error is not None and reply.error.code == "bad_request"
    assert inbox.duplicates() == 0

    dead = r.xrange(keys.dead(q))
    by_source = {fields[b"dead_source_id"]: fields for _, fields in dead}
    assert set(by_source) == set(stream_ids), "exactly the malformed entries are dead letters"
    for stream_id, fields in by_source.items():
        assert fields[b"dead_error_code"] == b"bad_request"
        assert fields[b"dead_error"]
        sent = {k.encode(): v for k, v in stream_ids[stream_id].fields.items()}
        original = {k: v for k, v in fields.items() if not k.startswith(b"dead_")}
        # A letter keeps at most dead_max_letter_bytes of the entry's fields;
        # what it cut it names, and what it kept of a cut field is its start.
        assert sum(len(k) + len(v) for k, v in original.items()) <= DEAD_LETTER_BYTES
        cut = set(fields.get(b"dead_truncated", b"").split(b",")) - {b""}
        for name in sent.keys() - {b"id", b"reply_to"}:  # those two were filled in above
            if name in cut:
                assert sent[name].startswith(original.get(name, b"")), (name, original, sent)
            else:
                assert original[name] == sent[name], (name, original, sent)
    assert worker.process.poll() is None, "the worker exited"
    output = worker.output()
    assert "Traceback" not in output and "unexpected error" not in output, output[-3000:]
    assert pending_of(r, q) == 0
    record("malformed entries", requests=len(good_ids), malformed=len(stream_ids),
           dead_lettered=len(by_source), error_replies=len(expected_reply),
           lost=len(good_ids) - sum(1 for i in good_ids if i in inbox.replies), duplicates=0)


# ---------------------------------------------- 5. dead letters by delivery count


def test_entry_whose_holders_keep_dying_becomes_a_dead_letter(fleet, r, redis_url, queue_name):
    """Delivered max_deliveries times to a consumer that is gone: dead letter, error reply."""
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        doomed = client.submit("a poison pill that kills every worker")
        survivor = client.submit("delivered one time fewer")
        entries = r.xreadgroup(keys.GROUP, "ghost", {stream: ">"}, count=10)[0][1]
        doomed_entry, survivor_entry = (entry_id for entry_id, _ in entries)
        # Two more holders "died" holding the doomed entry, one more the survivor:
        # each XCLAIM (not JUSTID) is one more delivery, as a claim by a worker is.
        for _ in range(2):
            r.xclaim(stream, keys.GROUP, "ghost", 0, [doomed_entry])
        r.xclaim(stream, keys.GROUP, "ghost", 0, [survivor_entry])
        counts = {p["message_id"]: p["times_delivered"]
                  for p in r.xpending_range(stream, keys.GROUP, "-", "+", 10)}
        assert counts == {doomed_entry: 3, survivor_entry: 2}
        original = dict(entries[0][1])

        worker = fleet.start("--max-deliveries", "3", ready=r, queue=queue_name)
        with pytest.raises(RemoteError) as caught:
            client.result(doomed, timeout_s=60)
        assert caught.value.code == "dead_letter"
        result = client.result(survivor, timeout_s=60)
        assert vector_ok(bytes(result.embedding), "delivered one time fewer")

    dead = r.xrange(keys.dead(q))
    assert len(dead) == 1
    fields = dead[0][1]
    assert {k: v for k, v in fields.items() if not k.startswith(b"dead_")} == original
    assert fields[b"dead_error_code"] == b"dead_letter"
    assert fields[b"dead_deliveries"] == b"4"
    assert fields[b"dead_worker"] == worker.name.encode()
    assert fields[b"dead_source_id"] == doomed_entry
    assert int(fields[b"dead_at_ms"]) > 0 and fields[b"dead_error"]
    assert r.xlen(stream) == 0 and pending_of(r, q) == 0
    assert pending_tokens(r, q) == (0, 0)
    record("dead letter by delivery count", requests=2, dead_lettered=1, lost=0, duplicates=0)


# ------------------------------------------------------------- 6. SIGTERM


def test_sigterm_with_slow_device_answers_buffered_and_in_flight(fleet, r, queue_name):
    """SIGTERM while requests are buffered and a batch runs: all answered before exit."""
    q = keys.QueueRef(queue_name)
    texts = texts_for(6, scaled(1500), longest=200)
    inbox = Inbox(r, keys.reply(q, "term"))
    with r.pipeline(transaction=False) as pipe:
        for index, text in enumerate(texts):
            pipe.xadd(keys.requests(q), wire.encode_request(wire.Request(
                id=f"t{index}", text=text, tokens=len(text.split()) + 2, reply_to=inbox.key)))
        pipe.execute()
    worker = fleet.start("--sim-batch-ms", "150", "--max-batch-size", "16",
                         "--max-batch-tokens", "2048", ready=r, queue=queue_name)

    def buffered() -> int:
        raw = r.hget(keys.workers(q), worker.name)
        return int(msgpack.unpackb(raw)["buffered"]) if raw else 0

    wait_for(lambda: buffered() > 0 and r.llen(inbox.key) > 0, 60, "a busy worker")
    held = pending_of(r, q, worker.name)
    assert worker.terminate(timeout=120) == 0, worker.output()
    inbox.drain(lambda: False, timeout=0.5)
    assert held > 0 and len(inbox.counts) > 0
    assert pending_of(r, q, worker.name) == 0, "the stopped worker left entries pending"
    assert pending_of(r, q) == 0
    consumers = [c["name"] for c in r.xinfo_consumers(keys.requests(q), keys.GROUP)]
    assert worker.name.encode() not in consumers, "it did not deregister"
    assert len(inbox.counts) == len(texts) - r.xlen(keys.requests(q)), (
        "every entry removed from the stream was answered, and only those"
    )
    assert inbox.duplicates() == 0
    for request_id, reply in inbox.replies.items():
        assert reply.ok and vector_ok(reply.embedding, texts[int(request_id[1:])])
    assert "stopping: finishing" in worker.output()
    record("SIGTERM under load", requests=len(inbox.counts), held_at_sigterm=held,
           lost=0, duplicates=0)


# ----------------------------------------------------- 7. nothing left behind


def test_drained_run_leaves_no_keys_behind(fleet, r, redis_url, queue_name):
    """After a drained run: empty stream, no pending, unread replies and seen keys expire."""
    q = keys.QueueRef(queue_name)
    fleet.start("--reply-ttl-s", "1", ready=r, queue=queue_name)
    n = scaled(300)
    settings_ = ClientSettings(redis_url=redis_url, queue=queue_name, dedupe_ttl_s=1.0)
    with Client(settings=settings_) as client:
        ids = client.submit_many(texts_for(7, n))  # nobody reads the replies
    wait_for(lambda: r.xlen(keys.requests(q)) == 0, 60, "the stream to drain")
    assert pending_of(r, q) == 0
    replies = list(r.scan_iter(match=keys.reply_pattern(q), count=1000))
    seen = list(r.scan_iter(match=keys.seen(q, "*"), count=1000))
    assert replies and seen, "the run left nothing to expire: the test proved nothing"
    assert all(0 < r.pttl(key) <= 1000 for key in replies[:50])

    def nothing_left() -> bool:
        return not any(r.scan_iter(match=keys.reply_pattern(q), count=1000)) and not any(
            r.scan_iter(match=keys.seen(q, "*"), count=1000))

    wait_for(nothing_left, 30, "reply and seen keys to expire")
    assert r.xlen(keys.requests(q)) == 0 and pending_of(r, q) == 0
    record("keys after a drained run", requests=len(ids), reply_keys_left=0, seen_keys_left=0,
           lost=0, duplicates=0)


# ------------------------------------------ 8. presumed dead, then comes back


def test_worker_presumed_dead_that_comes_back_cannot_answer_twice(fleet, r, queue_name):
    """SIGSTOP a worker past 3 heartbeats; another claims and answers; SIGCONT: no duplicates."""
    q = keys.QueueRef(queue_name)
    texts = texts_for(8, scaled(600), longest=80)
    inbox = Inbox(r, keys.reply(q, "zombie"))
    stale = fleet.start("--sim-batch-ms", "200", "--max-batch-size", "16",
                        "--max-batch-tokens", "2048", ready=r, queue=queue_name)
    with r.pipeline(transaction=False) as pipe:
        for index, text in enumerate(texts):
            pipe.xadd(keys.requests(q), wire.encode_request(wire.Request(
                id=f"z{index}", text=text, tokens=len(text.split()) + 2, reply_to=inbox.key)))
        pipe.execute()
    wait_for(lambda: pending_of(r, q, stale.name) > 16, 60, "the worker to hold a buffer")
    os.kill(stale.process.pid, signal.SIGSTOP)
    held = pending_of(r, q, stale.name)
    rescuer = fleet.start(ready=r, queue=queue_name)
    inbox.drain(lambda: len(inbox.counts) >= len(texts), timeout=120)
    assert len(inbox.counts) == len(texts), fleet.logs()
    os.kill(stale.process.pid, signal.SIGCONT)
    # The stale worker finishes the batch it was running and the ones it buffered,
    # and tries to publish them: the script must drop every one.
    def stale_published() -> bool:
        inbox.pop_some(0.25)
        return inbox.duplicates() > 0 or "no longer ours" in stale.output()

    wait_for(stale_published, 60, "the stale worker to publish", poll=0)
    inbox.settle(3.0)
    assert inbox.duplicates() == 0, {i: c for i, c in inbox.counts.items() if c > 1}
    assert "no longer ours" in stale.output()
    for request_id, reply in inbox.replies.items():
        assert reply.ok and vector_ok(reply.embedding, texts[int(request_id[1:])])
    assert stale.process.poll() is None and rescuer.process.poll() is None
    assert r.xlen(keys.requests(q)) == 0 and pending_of(r, q) == 0
    record("worker presumed dead comes back", requests=len(texts), held_while_stopped=held,
           lost=0, duplicates=inbox.duplicates())


# ---------------------------------------- reply keys that refuse the reply


def test_reply_to_of_the_wrong_type_is_dead_lettered_not_a_wedge(fleet, r, queue_name):
    """A reply key that is not a list must not stop the worker publishing.

    Reply keys in the queue's namespace that someone made a string or a hash
    refuse the RPUSH (WRONGTYPE, caught in publish.lua); tokenq's own keys
    (the stream, the config hash) are refused before anything is written, by
    the reply namespace rule. Either way the entry is dead-lettered, its
    caller told on the default reply key, and the worker goes on.
    """
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    fleet.start(ready=r, queue=queue_name)
    r.set(keys.reply(q, "a-string"), "x")
    r.hset(keys.reply(q, "a-hash"), "f", "x")
    wrong_type = [keys.reply(q, "a-string"), keys.reply(q, "a-hash")]
    own_keys = [stream, keys.config(q)]
    wrong = wrong_type + own_keys
    for index, target in enumerate(wrong):
        r.xadd(stream, {"v": "1", "id": f"wrong{index}", "text": "hello", "reply_to": target})
    r.xadd(stream, {"v": "1", "id": "right", "text": "still answering"})
    raw = blpop_within(r, keys.reply(q, "right"), 60)
    assert raw is not None, "the worker stopped answering after a bad reply_to"
    assert vector_ok(wire.decode_reply(raw).embedding, "still answering")
    wait_for(lambda: r.xlen(keys.dead(q)) == len(wrong), 30, "dead letters")
    dead = {fields[b"id"]: fields for _, fields in r.xrange(keys.dead(q))}
    for index, target in enumerate(wrong):
        fields = dead[f"wrong{index}".encode()]
        assert fields[b"reply_to"] == target.encode() and fields[b"text"] == b"hello"
        assert fields[b"dead_error_code"] == b"bad_request"
        expected = b"WRONGTYPE" if target in wrong_type else b"tokenq's own keys"
        assert expected in fields[b"dead_error"], fields[b"dead_error"]
    for index in range(len(wrong_type), len(wrong)):
        told = blpop_within(r, keys.reply(q, f"wrong{index}"), 10)
        assert told is not None and wire.decode_reply(told).error.code == "bad_request"
    assert r.type(keys.reply(q, "a-string")) == b"string" and r.get(keys.reply(q, "a-string"))
    assert r.type(keys.config(q)) == b"hash"
    assert r.pttl(stream) == -1, "the stream must never get a TTL"
    assert r.xlen(stream) == 0 and pending_of(r, q) == 0


# ---------------------------- a dead consumer's removal racing its return


def test_removing_a_dead_consumer_never_discards_entries_it_just_read(r, redis_url, queue_name):
    """XGROUP DELCONSUMER drops a consumer's pending entries; a stalled worker that wakes up
    and reads between another worker's look (XINFO) and the removal must keep them."""
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    r.xadd(stream, {"v": "1", "id": "old", "text": "x"})
    first = r.xreadgroup(keys.GROUP, "stalled", {stream: ">"}, count=1)[0][1][0][0]
    r.xclaim(stream, keys.GROUP, "rescuer", 0, [first])  # it holds nothing now
    time.sleep(0.3)  # and has been idle past dead_after_ms

    async def scan() -> None:
        client = aioredis.Redis.from_url(redis_url)
        look = client.xinfo_consumers

        async def look_then_wake(*args: Any, **kwargs: Any) -> Any:
            seen = await look(*args, **kwargs)
            # The stalled worker wakes up right now and reads a new entry.
            r.xadd(stream, {"v": "1", "id": "new", "text": "y"})
            r.xreadgroup(keys.GROUP, "stalled", {stream: ">"}, count=1)
            return seen

        client.xinfo_consumers = look_then_wake  # type: ignore[method-assign]
        reclaimer = Reclaimer(client, q, "rescuer", dead_after_ms=200, claim_idle_ms=60_000)
        await reclaimer.scan(10, held=())
        await client.aclose()

    asyncio.run(scan())
    assert pending_of(r, q, "stalled") == 1, (
        "the entry the woken worker read is no longer pending: nobody would ever answer it"
    )


# ------------------------------------------------ a read whose reply was lost


def test_entries_read_on_a_lost_reply_are_recovered_even_with_one_worker(fleet, r, queue_name):
    """XREADGROUP ran but its reply never reached the worker (a dropped connection, a
    timed-out read that redis-py retried): the entries are pending to a live worker that
    does not know it has them. Nobody else claims from a live worker, and the safety net
    is an hour away here: the worker itself takes back what it forgot."""
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    worker = fleet.start("--claim-idle-s", "3600", name="solo", ready=r, queue=queue_name)
    # Answered once first, so the worker is past the history read it makes at start (which
    # would take the orphan as its own, legitimately, and prove nothing of the rule).
    r.xadd(stream, {"v": "1", "id": "first", "text": "the worker is reading"})
    assert blpop_within(r, keys.reply(q, "first"), 30) is not None, worker.output()
    with r.pipeline(transaction=True) as pipe:  # one MULTI: the worker's own blocked read
        pipe.xadd(stream, {"v": "1", "id": "orphan", "text": "read but never seen"})
        pipe.xreadgroup(keys.GROUP, worker.name, {stream: ">"}, count=1)  # cannot get it
        _, lost_read = pipe.execute()
    assert lost_read and pending_of(r, q, worker.name) == 1
    raw = blpop_within(r, keys.reply(q, "orphan"), 30)
    assert raw is not None, "an entry pending to a live worker that lost the read"
    assert vector_ok(wire.decode_reply(raw).embedding, "read but never seen")
    assert r.xlen(stream) == 0 and pending_of(r, q) == 0
    assert "unknown to it" in worker.output()


def test_a_read_lost_on_its_way_to_the_worker_is_taken_again(fleet, worker_env, r, redis_server,
                                                           queue_name):
    """The same through a real connection: a proxy between the worker and Redis lets Redis
    deliver a read and then loses that reply, with the connection, on its way to the worker."""
    q = keys.QueueRef(queue_name)
    proxy = LossyProxy(redis_server.port)
    try:
        worker = fleet.start("--claim-idle-s", "3600", env=env_for(worker_env, proxy.url),
                             ready=r, queue=queue_name)
        text = "a read whose reply the network ate"
        proxy.lose_reply_with(text.encode())
        r.xadd(keys.requests(q), {"v": "1", "id": "eaten", "text": text})
        raw = blpop_within(r, keys.reply(q, "eaten"), 30)
        assert proxy.lost == 1, "the proxy never saw the read it was to lose"
        assert raw is not None, worker.output()
        assert vector_ok(wire.decode_reply(raw).embedding, text)
        assert r.xlen(keys.requests(q)) == 0 and pending_of(r, q) == 0
    finally:
        proxy.close()


def test_the_safety_net_claims_what_a_live_worker_sits_on(fleet, r, queue_name):
    """An entry pending past claim_idle_s to a worker that beats but never answers it (a
    bug, an older version without the rule above) is claimed by any other worker."""
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    r.xadd(stream, {"v": "1", "id": "sat-on", "text": "held by a worker that never answers"})
    r.xreadgroup(keys.GROUP, "stuck", {stream: ">"}, count=1)
    r.set(keys.worker_alive(q, "stuck"), b"1", px=60_000)  # alive, as far as anyone can tell
    fleet.start("--claim-idle-s", "2", ready=r, queue=queue_name)
    raw = blpop_within(r, keys.reply(q, "sat-on"), 30)
    assert raw is not None, "an entry a live worker sits on must be claimed by the safety net"
    assert vector_ok(wire.decode_reply(raw).embedding, "held by a worker that never answers")
    assert pending_of(r, q) == 0


# ---------------------------------------------------- a frozen (hung) Redis


def test_frozen_redis_errors_within_the_socket_bound_and_everyone_recovers(
    fleet, worker_env, tmp_path
):
    """Redis alive but not answering (SIGSTOP): a hung socket is only noticed by the
    socket timeout, so a caller's error comes within its timeout or
    (retries + 1) x socket_timeout_s, whichever is longer; after the thaw every
    request enqueued before the freeze is answered, reads lost on abandoned
    connections included."""
    server = RedisServer(tmp_path / "frozen")
    server.start()
    queue = f"frz{uuid.uuid4().hex[:8]}"
    q = keys.QueueRef(queue)
    timeout, socket_timeout, retries = 2.0, 1.0, 1
    bound = max(timeout, (retries + 1) * socket_timeout) + SLACK_S
    try:
        env = {**env_for(worker_env, server.url), "TOKENQ_QUEUE": queue}
        admin = redis.Redis.from_url(server.url, socket_timeout=5)
        worker = fleet.start("--sim-batch-ms", "60", "--max-batch-size", "16",
                             "--max-batch-tokens", "2048", "--claim-idle-s", "3",
                             "--socket-timeout-s", "2", env=env, ready=admin, queue=queue)
        client_settings = ClientSettings(redis_url=server.url, queue=queue,
                                         socket_timeout_s=socket_timeout, retries=retries)
        texts = texts_for(9, scaled(400), longest=100)
        with Client(settings=client_settings) as client:
            ids = client.submit_many(texts)
            assert admin.xlen(keys.requests(q)) > 0, "the freeze would find nothing queued"
            os.kill(server.process.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                calls: dict[str, Callable[[], Any]] = {
                    "infer": lambda: client.infer("frozen", timeout_s=timeout),
                    "result": lambda: client.result(uuid.uuid4().hex, timeout_s=timeout),
                    "submit": lambda: client.submit("frozen"),
                }
                slowest = 0.0
                for name, call in calls.items():
                    started = time.monotonic()
                    with pytest.raises((BrokerUnavailable, TimeoutError)):
                        call()
                    took = time.monotonic() - started
                    slowest = max(slowest, took)
                    assert took <= bound, (name, took, bound)
                time.sleep(max(0.0, 6.0 - (time.monotonic() - frozen_at)))
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            results = client.results(ids, timeout_s=120)
            for text, result in zip(texts, results, strict=True):
                assert vector_ok(bytes(result.embedding), text)
            assert vector_ok(bytes(client.infer("thawed", timeout_s=60).embedding), "thawed")
        wait_for(lambda: admin.xlen(keys.requests(q)) == 0 and pending_of(admin, q) == 0,
                 60, "the stream to drain")
        assert worker.process.poll() is None
        admin.close()
        record("Redis frozen (SIGSTOP)", requests=len(texts), frozen_s=6,
               slowest_error_s=round(slowest, 2), bound_s=round(bound - SLACK_S, 1),
               lost=0, duplicates=0)
    finally:
        if server.process is not None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
