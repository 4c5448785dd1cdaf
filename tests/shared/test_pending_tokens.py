"""The queue's pending tokens (``keys.pending``, docs/PROTOCOL.md "Pending tokens"): every script
that adds entries to a request stream or deletes them keeps the sum, and the entry's tenant's
field, in the same step, so each is the sum of ``tokens`` over its streams' own entries after
any interleaving, on the default tenant's stream and others', of enqueue (under quotas), reads,
abandoned reads (a worker killed with its entries pending), reclaims, publish (replies and dead
letters), entries taken past the limit, dlq retry, and Redis refusing writes (maxmemory).
Entries written by a plain XADD are never counted, neither added nor taken off (a dlq retry of
one's letter is written by a script: counted). Each counted entry carries its count as its first
field (``counted``); the hash holds the sum and a field for each tenant holding any."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tokenq.producer import Client
from tokenq.shared import functions, keys, queue_depth, wire
from tokenq.shared.keys import QueueRef

CONSUMERS = ("alive", "killed")
FULL = st.sampled_from([False, False, False, True])
"""Whether Redis is out of memory for the call."""
TOKENS = st.one_of(st.integers(0, 3000).map(str), st.sampled_from(
    ["", "x", "-1", "007", "16777216", "16777217", "999999999", None]))
"""A ``tokens`` field as any producer may write it (None: no field); digits up to 2^24 count."""


MARK = wire.COUNTED_FIELD.encode()
TENANTS = (keys.DEFAULT_TENANT, "a", "b")
TENANT = st.sampled_from(TENANTS)


def counted(fields: dict[bytes, bytes]) -> int:
    """What the scripts count for an entry: its ``tokens`` digits, 0 when not 1 to 8 digits
    at most 2^24 (what a worker decodes)."""
    text = fields.get(b"tokens", b"")
    if not (text.isdigit() and len(text) <= 8):
        return 0
    return int(text) if int(text) <= 1 << 24 else 0


@pytest.fixture
def over_memory(r: redis.Redis) -> Iterator[Any]:
    """A context that makes Redis refuse writes for memory (``maxmemory`` 1 byte) while held."""
    policy = r.config_get("maxmemory-policy")["maxmemory-policy"]
    r.config_set("maxmemory-policy", "noeviction")

    class Full:
        def __enter__(self) -> None:
            r.config_set("maxmemory", 1)

        def __exit__(self, *exc: object) -> None:
            r.config_set("maxmemory", 0)

    yield Full
    r.config_set("maxmemory", 0)
    r.config_set("maxmemory-policy", policy)


def test_pending_tokens_equal_each_tenant_stream_s_own_tokens_whatever_happens(
    r: redis.Redis, queue_name: str, over_memory: Any
) -> None:
    machine = _machine(r, QueueRef(queue_name), over_memory)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=40, stateful_step_count=40, deadline=None,
        suppress_health_check=list(HealthCheck)))


def _machine(r: redis.Redis, q: QueueRef, over_memory: Any) -> type[RuleBasedStateMachine]:
    streams = {tenant: keys.tenant_requests(q, tenant) for tenant in TENANTS}
    dead, reply, pending, quotas = keys.dead(q), keys.reply(q, "r"), keys.pending(q), keys.quotas(q)
    enqueue, publish = functions.Function(r, "enqueue"), functions.Function(r, "publish")
    retry, excess = functions.Function(r, "dlq_retry"), functions.Function(r, "claim_excess")

    def owned(stream: str, consumer: str) -> list[bytes]:
        return [p["message_id"] for p in r.xpending_range(stream, keys.GROUP, "-", "+", 1000,
                                                          consumername=consumer)]

    def entry(stream: str, entry_id: bytes) -> dict[bytes, bytes]:
        found = r.xrange(stream, entry_id, entry_id)
        return found[0][1] if found else {}

    def own_tokens(tenant: str) -> int:
        """The counted tokens of the tenant stream's own entries, pending or not yet read."""
        return sum(counted(fields) for entry_id, fields in r.xrange(streams[tenant])
                   if next(iter(fields)) == MARK)

    class PendingTokens(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.plain: set[tuple[str, bytes]] = set()
            """The plain XADDs' (stream, id): each stream numbers its own entries, so two
            streams written in the same millisecond give the same id."""
            r.delete(*streams.values(), dead, reply, pending, quotas)
            for stream in streams.values():
                r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)

        @rule(tenant=TENANT, tokens=st.lists(TOKENS, min_size=1, max_size=5),
              limit=st.sampled_from([0, 0, 6]), full=FULL)
        def enqueue(self, tenant: str, tokens: list[str | None], limit: int, full: bool) -> None:
            args: list[Any] = [limit, len(tokens), 0]
            for i, value in enumerate(tokens):
                fields = ["v", "1", "id", f"r{i}", "text", "t"]
                fields += [] if value is None else ["tokens", value]
                args += [len(fields) // 2, *fields]
            before, cap = own_tokens(tenant), self._cap(tenant)
            adding = sum(counted({b"tokens": (v or "").encode()}) for v in tokens)
            written = self._refusable(full, lambda: enqueue(keys=[streams[tenant]], args=args))
            if written and cap is not None and adding:
                assert before + adding <= cap  # never past the cap
            if written is None:  # refused for its quota: it was over
                assert cap is not None and before + adding > cap

        @rule(tenant=TENANT, cap=st.sampled_from([None, "0", "40", "3000", "9000", "*"]))
        def set_quota(self, tenant: str, cap: str | None) -> None:
            """The operator's caps: a tenant's own, or ``*`` for the others (``tokenq quotas``)."""
            if cap is None:
                r.hdel(quotas, tenant)
            elif cap == "*":
                r.hset(quotas, "*", "2000")
            else:
                r.hset(quotas, tenant, cap)

        def _cap(self, tenant: str) -> int | None:
            own, others = r.hmget(quotas, [tenant, "*"])
            return None if own is None and others is None else int(own or others)

        @rule(tenant=TENANT, tokens=TOKENS)
        def plain_xadd(self, tenant: str, tokens: str | None) -> None:
            """Written around tokenq's enqueue: never counted."""
            fields = {"v": "1", "id": "p", "text": "t"}
            self.plain.add((streams[tenant], r.xadd(streams[tenant], {
                **fields, **({} if tokens is None else {"tokens": tokens})})))

        @rule(tenant=TENANT, consumer=st.sampled_from(CONSUMERS), count=st.integers(1, 4))
        def read(self, tenant: str, consumer: str, count: int) -> None:
            r.xreadgroup(keys.GROUP, consumer, {streams[tenant]: ">"}, count=count)

        @rule(tenant=TENANT, to=st.sampled_from(CONSUMERS))
        def reclaim(self, tenant: str, to: str) -> None:
            """A peer takes over what a killed (or any) worker left pending."""
            r.xautoclaim(streams[tenant], keys.GROUP, to, 0, "0-0", count=10)

        @rule(tenant=TENANT, consumer=st.sampled_from(CONSUMERS), how=st.lists(st.sampled_from(
            ["reply", "none", "dead", "twice"]), min_size=1, max_size=6), full=FULL)
        def publish(self, tenant: str, consumer: str, how: list[str], full: bool) -> None:
            stream = streams[tenant]
            args: list[Any] = [keys.GROUP, consumer, 60_000, 1000, 4096, 0]
            for entry_id, kind in zip(owned(stream, consumer), how, strict=False):
                letter: list[Any] = []
                if kind == "dead":
                    own = [part for pair in entry(stream, entry_id).items() for part in pair]
                    letter = [*own, "dead_error_code", "dead_letter", "dead_error", "x"]
                # the worker's value, read at delivery (a deleted entry's: 0)
                value = wire.counted_of(entry(stream, entry_id))
                for _ in range(2 if kind == "twice" else 1):
                    args += [entry_id, 0 if kind in ("none", "dead") else 3, b"payload", value,
                             len(letter) // 2, *letter]  # 3: KEYS[3], the reply key
                    args[5] += 1
            self._refusable(full, lambda: publish(keys=[stream, dead, reply], args=args))

        @rule(tenant=TENANT, consumer=st.sampled_from(CONSUMERS), keep=st.integers(1, 4),
              killed=st.booleans())
        def take_excess(self, tenant: str, consumer: str, keep: int, killed: bool) -> None:
            """Entries past the limit taken by a worker, then answered as queue_full letters
            (unless it is killed first: they stay pending, deleted)."""
            stream = streams[tenant]
            for entry_id, _ in excess(keys=[stream], args=[keys.GROUP, consumer, keep, 3]):
                if not killed:
                    publish(keys=[stream, dead, reply], args=[
                        keys.GROUP, consumer, 60_000, 1000, 4096, 1, entry_id, 1, b"full", 0, 0])

        @rule(tenant=TENANT, most=st.integers(1, 3), limit=st.sampled_from([0, 0, 4]), full=FULL,
              drop_deadline=st.booleans())
        def dlq_retry(self, tenant: str, most: int, limit: int, full: bool,
                      drop_deadline: bool) -> None:
            """Letters back onto a stream, any tenant's (quotas do not refuse a retry)."""
            letters = [entry_id for entry_id, _ in r.xrange(dead, count=most)]
            if letters:
                self._refusable(full, lambda: retry(keys=[dead, streams[tenant]], args=[
                    limit, "1" if drop_deadline else "0", *letters]))

        def _refusable(self, full: bool, call: Any) -> bool | None:
            """The call, with Redis out of memory when ``full``: True when it went through;
            refused (OOM, QUEUEFULL: False; OVERQUOTA: None), it wrote nothing (the
            invariants below say so)."""
            try:
                if full:
                    with over_memory():
                        call()
                else:
                    call()
            except redis.exceptions.OutOfMemoryError:
                assert full
            except redis.ResponseError as exc:
                if str(exc).startswith("OVERQUOTA"):
                    return None
                assert str(exc).startswith("QUEUEFULL"), exc
            else:
                return True
            return False

        @invariant()
        def each_sum_is_its_streams_tokens(self) -> None:
            held = {name.decode(): int(value) for name, value in r.hgetall(pending).items()}
            own = {tenant: 0 for tenant in TENANTS}
            for tenant, stream in streams.items():
                for entry_id, fields in r.xrange(stream):  # a dict in the entry's field order
                    first = next(iter(fields.items()))
                    if (stream, entry_id) in self.plain:
                        assert first[0] != MARK
                        continue
                    # the tokens' own text where they count ("007" too), else 0
                    assert first == (MARK, fields[b"tokens"] if counted(fields) else b"0")
                    own[tenant] += counted(fields)
            # the sum and a field per tenant holding any, none at 0 (keys.pending_field)
            fields = {keys.pending_field(t): n for t, n in own.items()
                      if t != keys.DEFAULT_TENANT and n}
            total = held.pop(keys.PENDING_TOTAL, 0)
            assert held == fields
            assert total == sum(own.values()) >= 0
            shares = keys.tenant_pending(r.hgetall(pending))
            assert shares == {t: n for t, n in own.items() if n or t == keys.DEFAULT_TENANT}

    return PendingTokens


def test_a_counted_entry_costs_a_few_bytes(r: redis.Redis, queue_name: str) -> None:
    """docs/PROTOCOL.md: the count in each entry and the one sum cost a few bytes an entry over
    a plain XADD of the same fields (the field's name is stored once per stream node)."""
    q, plain, n = QueueRef(queue_name), QueueRef(f"{queue_name}-plain"), 2000
    enqueue = functions.Function(r, "enqueue")
    for start in range(0, n, 500):
        args: list[Any] = [0, 500, 0]
        for i in range(start, start + 500):
            fields = {"v": "1", "id": f"r{i}", "text": "a short query", "tokens": "12"}
            args += [4, *(part for pair in fields.items() for part in pair)]
            r.xadd(keys.requests(plain), fields)
        enqueue(keys=[keys.requests(q)], args=args)
    assert r.hgetall(keys.pending(q)) == {b"tokens": str(12 * n).encode()}
    counted = (r.memory_usage(keys.requests(q), samples=0)
               + r.memory_usage(keys.pending(q), samples=0))
    assert (counted - r.memory_usage(keys.requests(plain), samples=0)) / n < 5
    r.delete(keys.requests(plain))


def test_a_forged_count_skews_the_sum_by_at_most_its_own_value_never_below_zero(
    r: redis.Redis, queue_name: str
) -> None:
    """docs/PROTOCOL.md: a plain XADD that writes ``counted`` first is taken off as it is
    deleted, though never added: the sum is short by at most that value, clamped at 0."""
    q = QueueRef(queue_name)
    stream, dead, reply = keys.requests(q), keys.dead(q), keys.reply(q, "r")
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    functions.Function(r, "enqueue")(keys=[stream], args=[0, 1, 0, 2, "id", "a", "tokens", "7"])
    r.xadd(stream, {wire.COUNTED_FIELD: "5", "v": "1", "id": "f", "text": "t"})
    r.xadd(stream, {wire.COUNTED_FIELD: "900", "v": "1", "id": "g", "text": "t"})
    publish = functions.Function(r, "publish")
    for entry_id, fields in r.xreadgroup(keys.GROUP, "c", {stream: ">"})[0][1][1:]:
        publish(keys=[stream, dead, reply], args=[
            keys.GROUP, "c", 60_000, 1000, 4096, 1, entry_id, 1, b"payload",
            wire.counted_of(fields), 0])
        assert int(r.hget(keys.pending(q), keys.PENDING_TOTAL)) >= 0
    assert r.hget(keys.pending(q), keys.PENDING_TOTAL) == b"0"  # 7 - 5 = 2, then 2 - 900: 0


def test_a_worker_that_may_not_keep_the_sum_is_refused_before_it_writes(
    r: redis.Redis, redis_url: str, queue_name: str
) -> None:
    """docs/PROTOCOL.md: a worker's ACL without the hash's rights (one from before it) fails
    each publish before any reply is pushed or entry acked, never half way."""
    q = QueueRef(queue_name)
    stream, reply = keys.requests(q), keys.reply(q, "r")
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    functions.Function(r, "enqueue")(keys=[stream], args=[0, 1, 0, 2, "id", "a", "tokens", "7"])
    [(entry_id, _)] = r.xreadgroup(keys.GROUP, "c", {stream: ">"})[0][1]
    user = f"old-{queue_name}"
    r.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"],
                  commands=["+@all", "-hincrby"])
    try:
        worker = redis.Redis.from_url(redis_url, username=user, password="pw")
        with pytest.raises(redis.ResponseError):
            functions.Function(worker, "publish")(keys=[stream, keys.dead(q), reply], args=[
                keys.GROUP, "c", 60_000, 1000, 4096, 1, entry_id, 1, b"payload", 7, 0])
        worker.close()
    finally:
        r.acl_deluser(user)
    assert r.llen(reply) == 0 and r.xlen(stream) == 1
    assert r.xpending(stream, keys.GROUP)["pending"] == 1
    assert r.hget(keys.pending(q), keys.PENDING_TOTAL) == b"7"


@pytest.mark.parametrize("value", [b"x", b"-5", b"", b"1e3", b"123456789", b"16777217"])
def test_publish_counts_a_counted_argument_that_is_no_count_as_0(
    r: redis.Redis, queue_name: str, value: bytes
) -> None:
    """docs/PROTOCOL.md: publish takes off the counted values the worker passes (it reads no
    entry back); one that is not 1 to 8 digits at most 2^24 takes off nothing, and an answer
    no longer pending to its consumer (claimed by a peer, answered twice) takes off nothing."""
    q = QueueRef(queue_name)
    stream, dead, reply = keys.requests(q), keys.dead(q), keys.reply(q, "r")
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    functions.Function(r, "enqueue")(keys=[stream], args=[
        0, 3, 0, 2, "id", "a", "tokens", "7", 2, "id", "b", "tokens", "5",
        2, "id", "c", "tokens", "11"])
    (a, _), (b, _), (c, fields_c) = r.xreadgroup(keys.GROUP, "c", {stream: ">"})[0][1]
    r.xclaim(stream, keys.GROUP, "peer", 0, [b])
    publish = functions.Function(r, "publish")
    assert publish(keys=[stream, dead, reply], args=[
        keys.GROUP, "c", 60_000, 1000, 4096, 4, a, 3, b"p", value, 0, b, 3, b"p", 5, 0,
        c, 0, b"p", wire.counted_of(fields_c), 0, c, 3, b"p", 11, 0]) == [2, 0, 0]
    # 23 - 0 (a: its 7 stays) - 11 (c, once); b is the peer's, its 5 stays
    assert r.hget(keys.pending(q), keys.PENDING_TOTAL) == b"12"
    assert r.xlen(stream) == 1


def test_a_tenant_s_entries_counted_before_its_field_come_off_the_sum_exactly(
    r: redis.Redis, queue_name: str
) -> None:
    """docs/PROTOCOL.md: an entry an older enqueue.lua counted in ``tokens`` alone comes off the
    sum exactly; the tenant's field, short meanwhile, is dropped at 0 and exact again."""
    q = QueueRef(queue_name)
    stream, dead, reply = keys.tenant_requests(q, "a"), keys.dead(q), keys.reply(q, "r")
    r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    r.xadd(stream, {wire.COUNTED_FIELD: "5", "v": "1", "id": "old", "tokens": "5"})
    r.hincrby(keys.pending(q), keys.PENDING_TOTAL, 5)  # as the older script kept it
    functions.Function(r, "enqueue")(keys=[stream], args=[0, 1, 0, 2, "id", "b", "tokens", "7"])
    assert r.hgetall(keys.pending(q)) == {b"tokens": b"12", b"tokens:a": b"7"}
    publish = functions.Function(r, "publish")
    for entry_id, fields in r.xreadgroup(keys.GROUP, "c", {stream: ">"})[0][1]:
        publish(keys=[stream, dead, reply], args=[
            keys.GROUP, "c", 60_000, 1000, 4096, 1, entry_id, 1, b"p", wire.counted_of(fields), 0])
    assert r.hgetall(keys.pending(q)) == {b"tokens": b"0"}
    functions.Function(r, "enqueue")(keys=[stream], args=[0, 1, 0, 2, "id", "c", "tokens", "4"])
    assert r.hgetall(keys.pending(q)) == {b"tokens": b"4", b"tokens:a": b"4"}


@pytest.mark.parametrize("held", [
    {"tokens": "x"}, {"tokens": str(2**63 - 1)}, {"tokens": "5", "tokens:a": "1.5"},
    {"tokens": str(-2**63), "tokens:a": str(-2**63)}, None,
], ids=["garbage", "past-2^63", "tenant-garbage", "at--2^63", "not-a-hash"])
def test_a_pending_hash_holding_no_count_leaves_every_step_whole(
    r: redis.Redis, queue_name: str, held: dict[str, str] | None
) -> None:
    """docs/PROTOCOL.md: a value Redis cannot add to (written by hand, past 2^63, a key that is
    no hash) is left as it is and the step goes on uncounted: enqueue, publish and dlq retry
    each write once and answer, never failing after a first write (an entry written for a call
    that failed; a reply pushed again and again while its entry stays pending)."""
    q = QueueRef(queue_name)
    dead, reply, pending = keys.dead(q), keys.reply(q, "r"), keys.pending(q)
    if held is None:
        r.set(pending, "not a hash")
    else:
        r.hset(pending, mapping=held)
    enqueue, publish = functions.Function(r, "enqueue"), functions.Function(r, "publish")
    retry = functions.Function(r, "dlq_retry")
    for tenant in ("a", keys.DEFAULT_TENANT):
        stream = keys.tenant_requests(q, tenant)
        r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
        assert len(enqueue(keys=[stream], args=[0, 1, 0, 2, "id", "x", "tokens", "7"])) == 1
        [(entry_id, fields)] = r.xreadgroup(keys.GROUP, "c", {stream: ">"})[0][1]
        assert publish(keys=[stream, dead, reply], args=[
            keys.GROUP, "c", 60_000, 1000, 4096, 1, entry_id, 0, b"", wire.counted_of(fields),
            2, "id", "x", "dead_error", "e"]) == [1, 0, 0]
        [(letter, _)] = r.xrange(dead)
        assert len(retry(keys=[dead, stream], args=[0, "0", letter])) == 1
        [(entry_id, fields)] = r.xreadgroup(keys.GROUP, "c", {stream: ">"})[0][1]
        assert publish(keys=[stream, dead, reply], args=[
            keys.GROUP, "c", 60_000, 1000, 4096, 1, entry_id, 3, b"p", wire.counted_of(fields),
            0]) == [1, 0, 0]
        assert r.xlen(stream) == 0 and r.xpending(stream, keys.GROUP)["pending"] == 0
    assert r.llen(reply) == 2 and r.xlen(dead) == 0
    if held is None:
        assert r.get(pending) == b"not a hash"
    elif held["tokens"] == "x":
        assert r.hget(pending, "tokens") == b"x"


NO_COUNT = ["x", "", " 5", "+5", "5\n", "--5", "1.5", "1e3", "\u00b2", "\u0661\u0662", "9" * 5000,
            "1" * 20]
"""Values a hand may write into the pending hash that are no count HINCRBY keeps there (Unicode
digits that int() takes, 5,000 digits that it refuses, a sign it would drop ...)."""


@pytest.mark.unit
@pytest.mark.parametrize("value", NO_COUNT)
def test_a_pending_field_holding_no_count_is_skipped_by_every_reader(value: str) -> None:
    """docs/PROTOCOL.md: readers skip a value that is no count (``keys.pending_count``) rather
    than raise (the worker's depth gauges, ``tokenq stats``, the gateway's gauge)."""
    raw = value.encode()
    assert keys.pending_count(value) is None and keys.pending_count(raw) is None
    assert keys.tenant_pending({b"tokens": b"40", b"tokens:a": raw, b"tokens:b": b"15"}) == {
        keys.DEFAULT_TENANT: 25, "b": 15}
    assert keys.tenant_pending({b"tokens": raw, b"tokens:b": b"15"}) == {
        keys.DEFAULT_TENANT: 0, "b": 15}
    assert queue_depth.lane_depth([3, 0, 3, 1], {b"tokens": raw}).tokens == 0
    assert [keys.pending_count(v) for v in (b"-5", b"0", str(2**63 - 1))] == [-5, 0, 2**63 - 1]


def test_the_client_reads_a_hand_written_sum_as_0_and_logs_it_once(
    r: redis.Redis, redis_url: str, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    q = QueueRef(queue_name)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        r.hset(keys.pending(q), keys.PENDING_TOTAL, "12")
        assert client.pending_tokens() == 12
        for value in ("\u00b2", "-3", "x"):
            r.hset(keys.pending(q), keys.PENDING_TOTAL, value)
            assert client.pending_tokens() == 0
    assert caplog.text.count("not a count") == 1, caplog.text
