"""The sync Client against a real redis-server and the fake worker."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from tests.producer.test_producer_fakes import FakeWorker
from tests.redis_server import RedisServer, free_port
from tokenq.producer import (
    BadRequest,
    BrokerUnavailable,
    Client,
    DeadlineExceeded,
    QueueFull,
    RemoteError,
    ReplyTimeout,
    Result,
    calls,
    estimate_tokens,
)
from tokenq.producer.deadline import Deadline
from tokenq.producer.prepare import Prepared
from tokenq.shared import keys, lua_scripts, wire
from tokenq.shared.settings import ClientSettings

ENQUEUE_SCRIPT = lua_scripts.load("tokenq.producer", "enqueue.lua")

REPO_ROOT = Path(__file__).resolve().parents[2]


def prepare_many(client: Client, texts: list[str], **options: Any) -> list[Prepared]:
    """Requests prepared as the client's unsharded calls prepare them."""
    return client._core.preparer.prepare_many(client._core.lanes.home, texts, **options)


def enqueue(client: Client, batch: list[Prepared]) -> None:
    """Write prepared requests as an unsharded ``submit_many`` would (a retry replays them)."""
    deadline = Deadline.after(client.settings.timeout_s)
    client._run(calls.enqueue(client._core, client._core.lanes.home, batch, deadline))


@pytest.fixture
def client(redis_url: str, queue_name: str) -> Iterator[Client]:
    with Client(redis_url, queue_name, timeout_s=5) as c:
        yield c


@pytest.fixture
def worker(redis_url: str, queue_name: str) -> Iterator[FakeWorker]:
    fake = FakeWorker(redis_url, queue_name).start()
    yield fake
    fake.stop()


def stream(queue_name: str) -> str:
    return keys.requests(keys.QueueRef(queue_name))


def entries(r: redis.Redis, queue_name: str) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in r.xrange(stream(queue_name))]


# ------------------------------------------------------------------ happy paths


def test_submit_then_result_from_another_client(
    redis_url: str, queue_name: str, client: Client, worker: FakeWorker
) -> None:
    request_id = client.submit("hello world")
    with Client(redis_url, queue_name) as other:
        result = other.result(request_id, timeout_s=5)
    assert isinstance(result, Result)
    assert result.id == request_id
    assert result.dim == 3
    assert list(result.embedding or []) == [11.0, float(estimate_tokens("hello world")), 0.0]


def test_infer_returns_result(client: Client, worker: FakeWorker) -> None:
    result = client.infer("héllo")
    assert result.embedding is not None and result.embedding.typecode == "f"
    assert result.embedding[0] == 5.0
    assert result.tokens == estimate_tokens("héllo")


def test_infer_scores(client: Client, worker: FakeWorker) -> None:
    result = client.infer("SCORE this")
    assert result.scores == (0.25, 0.75) and result.embedding is None


def test_infer_many_keeps_input_order(client: Client, worker: FakeWorker) -> None:
    texts = ["x" * n for n in range(1, 301)]
    results = client.infer_many(texts)
    assert [r.embedding[0] for r in results] == [float(n) for n in range(1, 301)]
    assert len({r.id for r in results}) == 300


def test_infer_many_uses_one_reply_key(
    client: Client, worker: FakeWorker, queue_name: str
) -> None:
    client.infer_many(["a", "b", "c"])
    reply_tos = {request.reply_to for request in worker.seen}
    assert len(reply_tos) == 1
    assert reply_tos.pop().startswith(keys.reply(keys.QueueRef(queue_name), ""))


def test_infer_many_pairs(client: Client, worker: FakeWorker) -> None:
    results = client.infer_many([("query", "a passage"), "alone"])
    assert [r.embedding[2] for r in results] == [9.0, 0.0]
    assert worker.seen[0].tokens == estimate_tokens("query", "a passage")


def test_submit_many_and_results(client: Client, worker: FakeWorker) -> None:
    ids = client.submit_many(["one", "three", "five5"])
    results = client.results(list(reversed(ids)))
    assert [r.id for r in results] == list(reversed(ids))
    assert [r.embedding[0] for r in results] == [5.0, 5.0, 3.0]


def test_empty_batches_write_nothing(client: Client, r: redis.Redis, queue_name: str) -> None:
    assert client.submit_many([]) == []
    assert client.infer_many([]) == []
    assert client.results([]) == []
    assert r.exists(stream(queue_name)) == 0


def test_text_pair_and_opts_reach_the_stream(
    client: Client, r: redis.Redis, queue_name: str
) -> None:
    client.submit("q", text_pair="p", opts={"normalize": False})
    (fields,) = entries(r, queue_name)
    request = wire.decode_request(fields)
    assert request.text_pair == "p" and request.opts == {"normalize": False}
    assert request.tokens == estimate_tokens("q", "p")


def test_request_options_travel_in_opts_and_the_prompt_counts_in_the_estimate(
    client: Client, r: redis.Redis, queue_name: str
) -> None:
    client.submit("hello world", prompt="query: ", dimensions=8, normalize=False)
    client.submit_many(["a", "b"], truncate=True, prompt_name="query")
    first, *many = [wire.decode_request(fields) for fields in entries(r, queue_name)]
    assert first.opts == {"prompt": "query: ", "dimensions": 8, "normalize": False}
    assert first.tokens == estimate_tokens("query: hello world")
    assert [request.opts for request in many] == [{"truncate": True, "prompt_name": "query"}] * 2
    with pytest.raises(BadRequest, match="dimensions is given both"):
        client.submit("x", dimensions=4, opts={"dimensions": 4})
    with pytest.raises(BadRequest, match="dimensions must be an integer"):
        client.submit("x", dimensions="8")  # type: ignore[arg-type]


def test_the_config_lets_the_producer_refuse_options_and_count_named_prompts(
    client: Client, r: redis.Redis, queue_name: str
) -> None:
    """With the config hash's facts the producer refuses what the worker would, and
    estimates a named (or default) prompt's tokens; nothing is written for a refusal."""
    from tokenq.shared.queue_config import QueueConfig, encode_config

    q = keys.QueueRef(queue_name)
    r.hset(keys.config(q), mapping=encode_config(QueueConfig(
        task="embed", dim=16, normalized=True, max_input_tokens=6, policy="reject",
        prompts={"query": "search query: ", "doc": ""}, default_prompt_name="query",
    )))
    with Client(client.settings.redis_url, queue_name, timeout_s=5) as fresh:
        with pytest.raises(BadRequest, match="dimensions 17 is more than the model's 16"):
            fresh.submit("x", dimensions=17)
        with pytest.raises(BadRequest, match=r"'passage' is not one of .*\['doc', 'query'\]"):
            fresh.submit("x", prompt_name="passage")
        assert r.exists(stream(queue_name)) == 0
        fresh.submit("hello")  # the default prompt
        fresh.submit("hello", prompt_name="doc")
        # "a b c d e f" is estimated at 8 tokens, within the heuristic's margin over 6;
        # with the default prompt it is 11, refused unless the request asks to be truncated.
        with pytest.raises(BadRequest, match="11 tokens"):
            fresh.submit("a b c d e f")
        fresh.submit("a b c d e f", truncate=True)
    default, named, truncated = [wire.decode_request(f) for f in entries(r, queue_name)]
    assert default.tokens == estimate_tokens("search query: hello")
    assert named.tokens == estimate_tokens("hello")
    assert truncated.opts == {"truncate": True}


def test_deadlines_travel_as_timeout_ms(client: Client, r: redis.Redis, queue_name: str) -> None:
    """Relative timeout_ms on Redis's clock; an absolute deadline_ms is converted here."""
    before = int(time.time() * 1000)
    client.submit("a", deadline_s=10)
    client.submit("b", deadline_ms=before + 60_000)
    client.submit("c", deadline_s=0.0001)  # rounded up: 0 would mean no time at all
    after = int(time.time() * 1000)
    first, second, third = (wire.decode_request(f) for f in entries(r, queue_name))
    assert first.timeout_ms == 10_000 and first.deadline_ms is None
    assert before + 60_000 - after <= second.timeout_ms <= 60_000
    assert second.deadline_ms is None
    assert third.timeout_ms == 1
    assert all(b"deadline_ms" not in fields for fields in
               (f for _, f in r.xrange(stream(queue_name))))


def test_infer_sends_the_rest_of_its_timeout_as_timeout_ms(
    client: Client, r: redis.Redis, queue_name: str
) -> None:
    with pytest.raises(ReplyTimeout):
        client.infer("nobody answers", timeout_s=1.0)
    with pytest.raises(ReplyTimeout):
        client.infer("nor this", timeout_s=0.3, deadline_s=45)
    default, own = (wire.decode_request(f) for f in entries(r, queue_name))
    # the rest: less than the timeout by the time the call took to enqueue (loaded: ~0.1 s)
    assert default.timeout_ms is not None and 500 < default.timeout_ms <= 1000
    assert own.timeout_ms == 45_000
    assert default.deadline_ms is None and own.deadline_ms is None


def test_submit_has_no_deadline_unless_asked(
    client: Client, r: redis.Redis, queue_name: str
) -> None:
    client.submit("a")
    (fields,) = entries(r, queue_name)
    assert b"deadline_ms" not in fields and b"timeout_ms" not in fields
    assert fields[b"reply_to"].decode() == keys.reply(
        keys.QueueRef(queue_name), fields[b"id"].decode()
    )


# ------------------------------------------------------------------ error replies


def test_error_reply_raises_remote_error(client: Client, worker: FakeWorker) -> None:
    with pytest.raises(RemoteError) as caught:
        client.infer("ERR:inference_failed")
    assert caught.value.code == "inference_failed"
    assert caught.value.request_id is not None
    assert not isinstance(caught.value, DeadlineExceeded)


def test_deadline_reply_raises_deadline_exceeded(client: Client, worker: FakeWorker) -> None:
    with pytest.raises(DeadlineExceeded) as caught:
        client.infer("ERR:deadline_exceeded")
    assert caught.value.code == "deadline_exceeded"
    assert isinstance(caught.value, TimeoutError)


def test_infer_many_return_exceptions(client: Client, worker: FakeWorker) -> None:
    outcomes = client.infer_many(["ok", "ERR:too_long", "fine"], return_exceptions=True)
    assert isinstance(outcomes[0], Result) and isinstance(outcomes[2], Result)
    assert isinstance(outcomes[1], RemoteError) and outcomes[1].code == "too_long"


def test_infer_many_raises_first_error_in_input_order(
    client: Client, worker: FakeWorker
) -> None:
    with pytest.raises(RemoteError) as caught:
        client.infer_many(["ok", "ERR:too_long", "ERR:inference_failed"])
    assert caught.value.code == "too_long"


def test_malformed_reply_on_own_key(client: Client, r: redis.Redis, queue_name: str) -> None:
    request_id = client.submit("a")
    r.rpush(keys.reply(keys.QueueRef(queue_name), request_id), b"\xc1 not msgpack")
    with pytest.raises(RemoteError) as caught:
        client.result(request_id, timeout_s=2)
    assert caught.value.code == "bad_reply"


def test_infer_many_ignores_strangers_on_its_key(
    redis_url: str, queue_name: str, client: Client
) -> None:
    """Replies for other ids, duplicates and garbage on the shared key are skipped."""

    def answer(request: wire.Request) -> wire.Reply:
        return wire.scores_reply(request.id, [1.0])

    def noisy(request: wire.Request) -> wire.Reply:
        fake.redis.rpush(request.reply_to, b"garbage", wire.encode_reply(answer(request)))
        fake.redis.rpush(request.reply_to, wire.encode_reply(answer(
            wire.Request(id="stranger", text="x", tokens=1, reply_to="k"))))
        return answer(request)

    fake = FakeWorker(redis_url, queue_name, answer=noisy).start()
    try:
        results = client.infer_many(["a", "b", "c"], timeout_s=5)
    finally:
        fake.stop()
    assert [r.scores for r in results] == [(1.0,)] * 3


# ------------------------------------------------------------------ backpressure


def test_queue_full_writes_nothing(redis_url: str, queue_name: str, r: redis.Redis) -> None:
    with Client(redis_url, queue_name, max_queue_length=3) as client:
        client.submit_many(["a", "b"])
        with pytest.raises(QueueFull, match="nothing was written"):
            client.submit_many(["c", "d"])  # 2 + 2 > 3: the whole batch is refused
        assert r.xlen(stream(queue_name)) == 2
        client.submit("c")
        with pytest.raises(QueueFull):
            client.submit("d")
        with pytest.raises(QueueFull):
            client.infer("d", timeout_s=1)
        assert r.xlen(stream(queue_name)) == 3
        assert client.queue_length() == 3
    assert [f[b"text"] for f in entries(r, queue_name)] == [b"a", b"b", b"c"]


def test_no_limit_and_no_trimming(redis_url: str, queue_name: str, r: redis.Redis) -> None:
    with Client(redis_url, queue_name, max_queue_length=0) as client:
        client.submit_many([f"t{i}" for i in range(500)])
        client.submit_many([f"u{i}" for i in range(500)])
    assert r.xlen(stream(queue_name)) == 1000


def test_out_of_memory_is_queue_full(tmp_path: Path, queue_name: str) -> None:
    server = RedisServer(tmp_path / "oom", args=("--maxmemory", "3mb"))
    server.start()
    try:
        with Client(server.url, queue_name, max_queue_length=0) as client:
            with pytest.raises(QueueFull, match="out of memory"):
                for _ in range(100):
                    client.submit_many(["x" * 100_000] * 5)
            assert client.queue_length() % 5 == 0  # never half a batch
    finally:
        server.stop()


def test_enqueue_script_checks_its_arguments(r: redis.Redis, queue_name: str) -> None:
    script = r.register_script(ENQUEUE_SCRIPT)
    with pytest.raises(redis.ResponseError, match="malformed"):
        script(keys=[stream(queue_name)], args=[0, 1, 0, 2, "v", "1"])
    with pytest.raises(redis.ResponseError, match="stray"):
        script(keys=[stream(queue_name)], args=[0, 1, 0, 1, "v", "1", "extra"])
    with pytest.raises(redis.ResponseError, match="seen key"):
        script(keys=[stream(queue_name)], args=[0, 1, 1000, 1, "v", "1"])
    assert r.exists(stream(queue_name)) == 0
    ids = script(keys=[stream(queue_name)], args=[5, 2, 0, 1, "v", "1", 2, "v", "1", "id", "x"])
    assert len(ids) == 2 and r.xlen(stream(queue_name)) == 2


def test_a_retried_enqueue_does_not_add_a_request_twice(
    r: redis.Redis, queue_name: str
) -> None:
    """The script remembers request ids, so a retry after a lost reply is a no-op."""
    q = keys.QueueRef(queue_name)
    script = r.register_script(ENQUEUE_SCRIPT)
    seen = [keys.seen(q, "a"), keys.seen(q, "b")]
    entries = [3, "v", "1", "id", "a", "text", "x", 3, "v", "1", "id", "b", "text", "y"]
    first = script(keys=[stream(queue_name), *seen], args=[0, 2, 60_000, *entries])
    again = script(keys=[stream(queue_name), *seen], args=[0, 2, 60_000, *entries])
    assert again == first and r.xlen(stream(queue_name)) == 2
    assert 0 < r.pttl(seen[0]) <= 60_000

    # The client passes the seen keys itself: re-sending one prepared batch (what a
    # retry after a lost reply does) leaves one entry per request.
    url = f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}/0"
    with Client(url, queue_name, max_queue_length=0) as client:
        batch = prepare_many(client, [f"text {i}" for i in range(3)], now_ms=0)
        enqueue(client, batch)
        enqueue(client, batch)
    assert r.xlen(stream(queue_name)) == 2 + 3


@pytest.mark.parametrize("named", [False, True], ids=["fresh ids", "caller's ids"])
def test_a_retry_of_an_enqueue_that_filled_the_queue_is_not_queue_full(
    redis_url: str, r: redis.Redis, queue_name: str, named: bool
) -> None:
    """The lost-reply retry of a batch that filled the queue answers the first ids.

    Seen entries are looked up before the length check, so they do not count
    again; otherwise the retry would say QueueFull ("nothing was written")
    although everything was, and the caller would submit the work twice. A
    call of fresh ids is remembered by one seen key, ids the caller chose by
    one each.
    """
    limit = 3
    with Client(redis_url, queue_name, max_queue_length=limit) as client:
        unique = [uuid.uuid4().hex for _ in range(limit)] if named else None
        batch = prepare_many(client, [f"text {i}" for i in range(limit)], now_ms=0, unique=unique)
        script = client._scripts[calls.ENQUEUE]
        call = calls.enqueue_arguments(client._core, client._core.lanes.home, batch)
        assert len(call["keys"]) == 1 + (limit if named else 1)
        first = script(**call)
        assert r.xlen(stream(queue_name)) == limit
        again = script(**call)  # the same call again: what redis-py's retry sends
        assert again == first and r.xlen(stream(queue_name)) == limit
        enqueue(client, batch)  # through the client: no QueueFull either
        assert r.xlen(stream(queue_name)) == limit
        if named:
            # One new entry among seen ones still counts, and still writes nothing.
            extra = prepare_many(client, ["one too many"], now_ms=0,
                                 unique=[uuid.uuid4().hex])[0]
            with pytest.raises(QueueFull, match="1 more would not fit"):
                enqueue(client, [*batch, extra])
            assert r.xlen(stream(queue_name)) == limit and not r.exists(
                keys.seen(keys.QueueRef(queue_name), extra.id)
            )


def test_one_seen_key_remembers_a_call_of_fresh_ids(r: redis.Redis, queue_name: str) -> None:
    """A call of fresh ids leaves one seen key, holding its stream ids, with the TTL."""
    q = keys.QueueRef(queue_name)
    url = f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}/0"
    with Client(url, queue_name, max_queue_length=0) as client:
        ids = client.submit_many([f"text {i}" for i in range(5)])
    (call_key,) = r.scan_iter(match=keys.seen(q, "*"), count=1000)
    assert call_key == keys.seen_call(q, ids).encode()
    entries = [entry_id for entry_id, _ in r.xrange(stream(queue_name))]
    assert r.get(call_key).split() == entries
    assert 0 < r.pttl(call_key) <= 60_000


def test_a_call_seen_key_that_does_not_fit_the_call_is_refused_by_name(
    r: redis.Redis, queue_name: str
) -> None:
    """A call key of the wrong type or holding another count of ids writes nothing."""
    q = keys.QueueRef(queue_name)
    script = r.register_script(ENQUEUE_SCRIPT)
    call_key = keys.seen_call(q, ["a", "b"])
    entries = [2, "id", "a", "text", "x", 2, "id", "b", "text", "y"]
    r.set(call_key, "1-0")
    with pytest.raises(redis.ResponseError, match="seen key holds 1 ids for 2 entries"):
        script(keys=[stream(queue_name), call_key], args=[0, 2, "call:60000", *entries])
    r.delete(call_key)
    r.rpush(call_key, "x")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        script(keys=[stream(queue_name), call_key], args=[0, 2, "call:60000", *entries])
    for refused, keys_given in [("call:0", [call_key]), ("call:", [call_key]),
                                ("call:1e5", [call_key]), ("call:60000", []),
                                ("call:60000", [call_key, call_key, call_key])]:
        with pytest.raises(redis.ResponseError, match="tokenq enqueue: "):
            script(keys=[stream(queue_name), *keys_given], args=[0, 2, refused, *entries])
    assert not r.exists(stream(queue_name))


def test_an_entry_of_too_many_fields_is_refused_before_anything_is_written(
    r: redis.Redis, queue_name: str
) -> None:
    """An entry's fields reach XADD by one Lua unpack, which fails past ~8,000 values:
    an entry of more than 1,000 fields is refused while the arguments are checked, so a
    batch is never half written (a fine entry before it included); 1,000 still go in."""
    script = r.register_script(ENQUEUE_SCRIPT)

    def entry(fields: int) -> list[object]:
        return [fields, *(part for i in range(fields) for part in (f"f{i}", "x"))]

    fine = [2, "id", "a", "text", "x"]
    for hostile in (1001, 5000):
        with pytest.raises(redis.ResponseError, match="malformed entry at argument 9"):
            script(keys=[stream(queue_name)], args=[0, 2, 0, *fine, *entry(hostile)])
        assert not r.exists(stream(queue_name))
    [entry_id] = script(keys=[stream(queue_name)], args=[0, 1, 0, *entry(1000)])
    assert len(r.xrange(stream(queue_name))[0][1]) == 1000 + 1 and entry_id  # and "counted"


@hypothesis_settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    data=st.data(),
    others=st.integers(0, 4),
    max_len=st.integers(0, 8),
    seen_mask=st.lists(st.booleans(), min_size=1, max_size=6),
)
def test_enqueue_counts_only_new_entries_against_the_limit(
    redis_url: str, data: st.DataObject, others: int, max_len: int, seen_mask: list[bool]
) -> None:
    """Any mix of seen and new entries: seen ones keep their ids; new ones all or nothing."""
    q = keys.QueueRef(f"p{uuid.uuid4().hex[:12]}")
    with redis.Redis.from_url(redis_url) as raw:
        script = raw.register_script(ENQUEUE_SCRIPT)

        def enqueue(ids: list[str], limit: int) -> list[bytes]:
            entries: list[str | int] = []
            for request_id in ids:
                entries += [2, "id", request_id, "text", "t"]
            seen_keys = [keys.seen(q, i) for i in ids]
            return script(keys=[keys.requests(q), *seen_keys],
                          args=[limit, len(ids), 60_000, *entries])

        if others:
            enqueue([f"other{i}" for i in range(others)], 0)
        ids = [f"r{i}" for i in range(len(seen_mask))]
        earlier = [i for i, seen in zip(ids, seen_mask, strict=True) if seen]
        first_ids = dict(zip(earlier, enqueue(earlier, 0), strict=True)) if earlier else {}
        batch = data.draw(st.permutations(ids))
        length = raw.xlen(keys.requests(q))
        fresh = len(batch) - len(earlier)
        if max_len and fresh and length + fresh > max_len:
            with pytest.raises(redis.ResponseError, match=f"QUEUEFULL {length} {max_len} {fresh}"):
                enqueue(batch, max_len)
            assert raw.xlen(keys.requests(q)) == length
            assert not any(raw.exists(keys.seen(q, i)) for i in ids if i not in first_ids)
        else:
            answered = enqueue(batch, max_len)
            assert raw.xlen(keys.requests(q)) == length + fresh
            for request_id, entry_id in zip(batch, answered, strict=True):
                if request_id in first_ids:
                    assert entry_id == first_ids[request_id]
                else:
                    (stored,) = raw.xrange(keys.requests(q), entry_id, entry_id)
                    assert stored[1][b"id"] == request_id.encode()
            assert enqueue(batch, max_len) == answered  # and a retry changes nothing
            assert raw.xlen(keys.requests(q)) == length + fresh
        raw.delete(keys.requests(q), *(keys.seen(q, i) for i in ids),
                   *(keys.seen(q, f"other{i}") for i in range(others)))


def test_an_id_twice_in_one_batch_is_added_once(r: redis.Redis, queue_name: str) -> None:
    q = keys.QueueRef(queue_name)
    script = r.register_script(ENQUEUE_SCRIPT)
    seen = keys.seen(q, "twin")
    entry = [2, "id", "twin", "text", "t"]
    ids = script(keys=[stream(queue_name), seen, seen], args=[1, 2, 60_000, *entry, *entry])
    assert ids[0] == ids[1] and r.xlen(stream(queue_name)) == 1


# ------------------------------------------------------------------ timeouts, outages


def test_timeout_without_worker_is_prompt(client: Client) -> None:
    started = time.monotonic()
    with pytest.raises(ReplyTimeout) as caught:
        client.infer("nobody listens", timeout_s=0.5)
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 1.5
    assert isinstance(caught.value, TimeoutError)
    assert caught.value.request_ids and caught.value.request_ids[0] in str(caught.value)


def test_infer_many_timeout_names_missing_ids(client: Client) -> None:
    started = time.monotonic()
    outcomes = client.infer_many(["a", "b"], timeout_s=0.3, return_exceptions=True)
    assert time.monotonic() - started < 1.3
    assert all(isinstance(o, ReplyTimeout) for o in outcomes)


def test_result_of_unknown_id_times_out(client: Client) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        client.result(uuid.uuid4().hex, timeout_s=0.3)
    assert time.monotonic() - started < 1.3


def test_timeout_longer_than_socket_timeout(redis_url: str, queue_name: str) -> None:
    """Waits are chopped into BLPOPs shorter than the socket timeout, never one long read."""
    # 1 s, not less: on a loaded 2-core CI box a real read can take a few
    # hundred ms, and a socket timeout that expires is (rightly) BrokerUnavailable.
    settings = ClientSettings(redis_url=redis_url, queue=queue_name, socket_timeout_s=1.0)
    with Client(settings=settings) as client:
        started = time.monotonic()
        with pytest.raises(ReplyTimeout):
            client.infer("a", timeout_s=2.5)
    assert 2.5 <= time.monotonic() - started < 3.5


def test_broker_unavailable_on_closed_port(queue_name: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with Client(url, queue_name, timeout_s=0.5) as client:  # default retries: ~1 s of backoff
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable):
            client.infer("a")
        assert time.monotonic() - started < 2.5
    settings = ClientSettings(redis_url=url, queue=queue_name, retries=1, timeout_s=0.5)
    with Client(settings=settings) as client:
        for call in (
            lambda: client.submit("a"),
            lambda: client.result("abc"),
            lambda: client.infer("a"),
            lambda: client.infer_many(["a", "b"]),
            client.queue_length,
        ):
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable) as caught:
                call()
            assert time.monotonic() - started < 1.5
            assert isinstance(caught.value, ConnectionError)


def test_redis_dying_mid_wait_is_broker_unavailable(tmp_path: Path, queue_name: str) -> None:
    server = RedisServer(tmp_path / "dies")
    server.start()
    settings = ClientSettings(redis_url=server.url, queue=queue_name, retries=1)
    with Client(settings=settings) as client:
        request_id = client.submit("a")
        server.stop(kill=True)
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="unreachable until the"):
            client.result(request_id, timeout_s=0.8)
        assert time.monotonic() - started < 2


def test_reconnects_after_a_redis_restart(tmp_path: Path, queue_name: str) -> None:
    server = RedisServer(tmp_path / "restarts")
    server.start()
    try:
        with Client(server.url, queue_name) as client:
            client.submit("before")
            server.restart()  # same port; the pooled connection is now dead
            client.submit("after")  # redis-py's Retry reconnects transparently
            assert client.queue_length() == 1
    finally:
        server.stop()


def test_password_is_not_shown_in_errors(queue_name: str) -> None:
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    with Client(settings=ClientSettings(redis_url=url, queue=queue_name, retries=0)) as client:
        with pytest.raises(BrokerUnavailable) as caught:
            client.submit("a")
        assert "s3cret" not in str(caught.value) and "s3cret" not in repr(client)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("call", "problem"),
    [
        (lambda c: c.submit(""), "text is empty"),
        (lambda c: c.submit(" \n\t "), "text is empty"),
        (lambda c: c.submit(42), "must be a string, got int"),
        (lambda c: c.submit(b"bytes"), "must be a string, got bytes"),
        (lambda c: c.submit(None), "must be a string, got NoneType"),
        (lambda c: c.submit("\ud800"), "not valid Unicode"),
        (lambda c: c.submit("x" * 1001), "over the limit of 1000 bytes"),
        (lambda c: c.submit("x" * 600, text_pair="y" * 600), "over the limit"),
        (lambda c: c.submit("a", text_pair=" "), "text_pair is empty"),
        (lambda c: c.submit("a", deadline_s=-1), "deadline_s must be a positive"),
        (lambda c: c.submit("a", deadline_s=0), "deadline_s must be a positive"),
        (lambda c: c.submit("a", deadline_s=float("nan")), "deadline_s must be a positive"),
        (lambda c: c.submit("a", deadline_s="5"), "deadline_s must be a number"),
        (lambda c: c.submit("a", deadline_ms=1), "already passed"),
        (lambda c: c.submit("a", deadline_ms=1.5e15), "deadline_ms must be an integer"),
        (lambda c: c.submit("a", deadline_ms=2**50), "deadline_ms 1125899906842624 is out of"),
        (lambda c: c.submit("a", deadline_s=31 * 86400), "deadline_s 2678400 is out of range"),
        (lambda c: c.submit("a", deadline_s=float("inf")), "deadline_s must be a positive"),
        (lambda c: c.submit("a", deadline_s=1, deadline_ms=2**50), "not both"),
        (lambda c: c.submit("a", opts=[1]), "opts must be a mapping"),
        (lambda c: c.submit("a", opts={"f": object()}), "opts cannot be encoded"),
        (lambda c: c.submit("a", reply_to=""), "reply_to"),
        (lambda c: c.infer("a", timeout_s=0), "timeout_s must be a positive"),
        (lambda c: c.submit_many("abc"), "not a single string"),
        (lambda c: c.submit_many(["a", "b", ""]), "texts[2] is empty"),
        (lambda c: c.submit_many(["a", 7]), "texts[1] must be a string"),
        (lambda c: c.submit_many(["a", ("q",)]), "texts[1] must be a string or a (text"),
        (lambda c: c.submit_many(["a", ("q", "")]), "texts[1] text_pair is empty"),
        (lambda c: c.infer_many(["ok", "x" * 2000]), "texts[1] is 2000 bytes"),
        (lambda c: c.submit_many(5), "texts must be a sequence"),
        (lambda c: c.result(""), "request id must be a non-empty string"),
        (lambda c: c.result("a b"), "request id must not contain whitespace"),
        (lambda c: c.results("abc"), "not a single string"),
    ],
)
def test_bad_input_is_refused_before_writing(
    redis_url: str, queue_name: str, r: redis.Redis, call, problem: str
) -> None:
    settings = ClientSettings(redis_url=redis_url, queue=queue_name, max_request_bytes=1000)
    with Client(settings=settings, timeout_s=1) as client, pytest.raises(BadRequest) as caught:
        call(client)
    assert problem in str(caught.value)
    assert r.exists(stream(queue_name)) == 0


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"queue": "has space"}, "queue name 'has space' is invalid"),
        ({"queue": "x" * 200}, "is invalid"),
        ({"prefix": "a:b"}, "prefix"),
        ({"redis_url": "http://localhost"}, "redis_url"),
        ({"max_queue_length": -1}, "max_queue_length"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_settings_are_refused(redis_url: str, kwargs: dict, problem: str) -> None:
    args = {"redis_url": redis_url, "queue": "fine", **kwargs}
    with pytest.raises(BadRequest, match="invalid client settings") as caught:
        Client(**args)
    assert problem in str(caught.value)


def test_estimator_that_returns_nonsense_is_refused(
    redis_url: str, queue_name: str, r: redis.Redis
) -> None:
    client = Client(redis_url, queue_name, estimator=lambda text: -1)
    with client, pytest.raises(BadRequest, match="estimator returned -1"):
        client.submit("a")
    huge = Client(redis_url, queue_name, estimator=lambda text: wire.MAX_TOKENS + 1)
    with huge, pytest.raises(BadRequest, match="over the protocol's limit of 16777216"):
        huge.submit_many(["a", "b"])
    with Client(redis_url, queue_name, estimator=lambda text: wire.MAX_TOKENS) as at_limit:
        at_limit.submit("a")
    assert r.xlen(stream(queue_name)) == 1


# ------------------------------------------------------------------ estimators, settings


def test_custom_estimator_sets_tokens(redis_url: str, queue_name: str, r: redis.Redis) -> None:
    with Client(redis_url, queue_name, estimator=lambda text: 40 + len(text)) as client:
        client.submit("ab")
        client.submit("ab", text_pair="cde")  # one-argument estimators are summed per text
    assert [f[b"tokens"] for f in entries(r, queue_name)] == [b"42", b"85"]


def test_pair_aware_estimator_sees_the_pair(
    redis_url: str, queue_name: str, r: redis.Redis
) -> None:
    def estimator(text: str, text_pair: str | None = None) -> int:
        return 7 if text_pair is None else 99

    with Client(redis_url, queue_name, estimator=estimator) as client:
        client.submit_many(["a", ("a", "b")])
    assert [f[b"tokens"] for f in entries(r, queue_name)] == [b"7", b"99"]


def test_settings_from_environment_with_keyword_overrides(
    redis_url: str, queue_name: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENQ_REDIS_URL", redis_url)
    monkeypatch.setenv("TOKENQ_QUEUE", "from-env")
    monkeypatch.setenv("TOKENQ_MAX_QUEUE_LENGTH", "1")
    with Client(queue=queue_name) as client:
        assert client.queue == queue_name and client.settings.max_queue_length == 1
        client.submit("a")
        with pytest.raises(QueueFull):
            client.submit("b")
    assert r.xlen(stream(queue_name)) == 1


def test_prefix_changes_every_key(redis_url: str, queue_name: str, r: redis.Redis) -> None:
    with Client(redis_url, queue_name, prefix="other") as client:
        client.submit("a")
    assert r.xlen(f"other:{{{queue_name}}}:requests") == 1


def test_config_reads_the_queue_hash(client: Client, r: redis.Redis, queue_name: str) -> None:
    assert client.config() == {}
    r.hset(keys.config(keys.QueueRef(queue_name)), mapping={"max_input_tokens": 512})
    assert client.config() == {"max_input_tokens": "512"}


def test_import_pulls_in_no_heavy_dependencies() -> None:
    code = (
        "import sys, tokenq.producer; "
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tempfile.gettempdir())
