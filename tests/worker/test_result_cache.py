"""The result cache and coalescing (docs/OPERATIONS.md, "Result cache"): a repeated request is
answered from the cache before tokenizing, identical requests in flight run as one row, the
reply is the computed one's, the cache stays within its budget, and neither a forged field nor
a refused cache write makes anyone get a wrong answer or lose one."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest
import redis.asyncio as aioredis

from tests.redis_full import fill, full_fixture
from tests.support import SIM_FLAGS, SimModel, starter_fixture, wait_for
from tokenq.producer import Client
from tokenq.shared import keys, wire
from tokenq.shared.request_options import NO_OPTIONS, RequestOptions
from tokenq.worker.loop.cache import ResultCache
from tokenq.worker.metrics import NullMetrics
from tokenq.worker.pipeline.coalesce import Coalescer
from tokenq.worker.pipeline.digest import cache_scope, request_digest
from tokenq.worker.pipeline.execute import Failure
from tokenq.worker.pipeline.pipeline import Job, Outcome

BUDGET = 200_000
start_worker = starter_fixture("start_worker", *SIM_FLAGS, "--cache-bytes", str(BUDGET))
full = full_fixture()
SIM = SimModel()


def request(text: str, request_id: str = "r") -> wire.Request:
    return wire.Request(request_id, text, 3, "reply")


# ------------------------------------------------------------------ pure parts


@pytest.mark.unit
def test_the_digest_changes_with_everything_that_changes_the_answer() -> None:
    scope = cache_scope("q", "model", "truncate")
    base = request_digest(scope, request("a text"), NO_OPTIONS, "", True)
    assert base == request_digest(scope, request("a text", "other id"), NO_OPTIONS, "", True)
    others = [
        request_digest(cache_scope("other queue", "model", "truncate"), request("a text"),
                       NO_OPTIONS, "", True),
        request_digest(cache_scope("q", "other model", "truncate"), request("a text"),
                       NO_OPTIONS, "", True),
        request_digest(cache_scope("q", "model", "chunk"), request("a text"), NO_OPTIONS, "",
                       True),
        request_digest(scope, request("a text!"), NO_OPTIONS, "", True),
        request_digest(scope, request("a text"), NO_OPTIONS, "query: ", True),
        request_digest(scope, request("a text"), NO_OPTIONS, "", False),
        request_digest(scope, request("a text"), RequestOptions(dimensions=8), "", True),
        request_digest(scope, request("a text"), RequestOptions(normalize=False), "", True),
        request_digest(scope, request("a text"), RequestOptions(output_tokens=True), "", True),
        request_digest(scope, request("a text"), RequestOptions(raw_scores=True), "", True),
        request_digest(scope, wire.Request("r", "a text", 3, "reply", text_pair="b"),
                       NO_OPTIONS, "", True),
    ]
    assert len({base, *others}) == len(others) + 1


def job(ref: int, digest: bytes | None) -> Job[int]:
    return Job(ref, request(f"text {digest!r}", f"id{ref}"), None, 0.0,
               types.SimpleNamespace(length=3), digest=digest)  # type: ignore[arg-type]


@pytest.mark.unit
def test_identical_jobs_wait_for_their_leader_and_get_its_result_as_their_own() -> None:
    coalescer: Coalescer[int] = Coalescer()
    packed = coalescer.take([job(1, b"a"), job(2, b"a"), job(3, b"b"), job(4, None)])
    assert [j.ref for j in packed] == [1, 3, 4]
    assert coalescer.take([job(5, b"a")]) == []  # a later read waits for the same leader
    vector = np.ones(3, dtype=np.float32)
    shared, again, led = coalescer.settled([Outcome(1, request("x", "id1"), vector, 3)])
    assert [(o.ref, o.request.id, o.tokens) for o in shared] == [(2, "id2", 3), (5, "id5", 3)]
    assert all(o.result is vector for o in shared) and again == []
    assert [(digest, o.ref) for digest, o in led] == [(b"a", 1)]
    assert coalescer.coalesced == 2
    assert [j.ref for j in coalescer.take([job(6, b"a")])] == [6]  # settled: a new leader


@pytest.mark.unit
def test_a_leader_out_of_its_own_deadline_sends_its_waiters_back_to_be_run() -> None:
    coalescer: Coalescer[int] = Coalescer()
    coalescer.take([job(1, b"a"), job(2, b"a"), job(3, b"a")])
    late = Failure("deadline_exceeded", "deadline passed before the request ran")
    shared, again, _ = coalescer.settled([Outcome(1, request("x"), late)])
    assert shared == [] and [j.ref for j in again] == [2, 3]
    assert [j.ref for j in coalescer.take(again)] == [2]


@pytest.mark.unit
def test_a_reply_for_another_id_is_the_same_bytes_but_its_id() -> None:
    vector = np.arange(4, dtype="<f4").tobytes()
    one = wire.encode_embedding_reply("first", vector, 4, tokens=7, truncated=True)
    assert wire.reply_with_id(one, "second") == wire.encode_embedding_reply(
        "second", vector, 4, tokens=7, truncated=True)


# ------------------------------------------------------------------ a worker


def rows_and_tokens(worker) -> tuple[int, int]:
    batches = worker.batches()
    return sum(b["rows"] for b in batches), sum(b["tokens"] for b in batches)


def test_a_repeated_text_is_answered_from_the_cache_with_the_computed_reply(
        start_worker, redis_url, r, queue_name) -> None:
    worker = start_worker()
    texts = [f"text number {i} about queues" for i in range(20)]
    with Client(redis_url=redis_url, queue=queue_name) as client:
        first = client.infer_many(texts, timeout_s=30)
        computed = rows_and_tokens(worker)
        wait_for(lambda: r.hlen(keys.cache(keys.QueueRef(queue_name))[0]) == len(texts))
        again = client.infer_many(texts, timeout_s=30)
        assert rows_and_tokens(worker) == computed  # nothing more ran on the device
        fresh = client.infer_many(texts[:3], timeout_s=30, cache=False)
    for text, one, two in zip(texts, first, again, strict=True):
        assert SIM.vector_ok(two.embedding, text)
        assert one.id != two.id and one.tokens == two.tokens
        assert np.array_equal(one.embedding, two.embedding)
    assert all(SIM.vector_ok(f.embedding, t) for f, t in zip(fresh, texts[:3], strict=True))
    assert rows_and_tokens(worker)[0] == computed[0] + 3  # cache: false ran again
    q = keys.QueueRef(queue_name)
    entries, index, counted = keys.cache(q)
    assert r.hlen(entries) == len(texts) == r.zcard(index)
    assert 0 < int(r.get(counted)) <= BUDGET
    assert int(r.hget(keys.pending(q), keys.PENDING_TOTAL)) == 0  # hits take their tokens off


def test_identical_requests_in_one_call_make_one_row(start_worker, redis_url, r, queue_name):
    worker = start_worker()
    with Client(redis_url=redis_url, queue=queue_name) as client:
        results = client.infer_many(["the same question"] * 64, timeout_s=30)
    assert len({result.id for result in results}) == 64
    assert all(SIM.vector_ok(result.embedding, "the same question") for result in results)
    assert rows_and_tokens(worker)[0] == 1
    pending = r.hget(keys.pending(keys.QueueRef(queue_name)), keys.PENDING_TOTAL)
    assert int(pending) == 0  # the coalesced answers take their tokens off too


def test_a_forged_digest_or_a_forged_entry_never_answers_anyone_else(
        start_worker, redis_url, r, queue_name) -> None:
    """The worker computes the digest from what it ran: a producer's field is ignored, and a
    cache entry is found only by the digest of the request's own text and options."""
    start_worker()
    q = keys.QueueRef(queue_name)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.infer("the honest text", timeout_s=30)
        wait_for(lambda: r.hlen(keys.cache(q)[0]) == 1)
        (honest,) = r.hkeys(keys.cache(q)[0])
        # a forged field naming the honest text's digest, on another text
        r.xadd(keys.requests(q), {"v": "1", "id": "forged", "text": "a poisoned text",
                                  "tokens": "5", "digest": honest,
                                  "reply_to": keys.reply(q, "forged")})
        reply = wire.decode_reply(r.blpop([keys.reply(q, "forged")], 30)[1])
        assert SIM.vector_ok(reply.embedding, "a poisoned text")
        wait_for(lambda: r.hlen(keys.cache(q)[0]) == 2)  # cached under its own text's digest
        result = client.infer("the honest text", timeout_s=30)
    assert SIM.vector_ok(result.embedding, "the honest text")


def test_the_cache_stays_within_its_budget(start_worker, redis_url, r, queue_name) -> None:
    start_worker()
    q = keys.QueueRef(queue_name)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        for start in range(0, 2000, 250):
            client.infer_many([f"entry {i} of many" for i in range(start, start + 250)],
                              timeout_s=60)
    counted = int(r.get(keys.cache(q)[2]))
    used = sum(r.memory_usage(key, samples=0) or 0 for key in keys.cache(q))
    assert 0.5 * BUDGET < counted <= BUDGET
    assert used <= BUDGET


def wiring(client) -> types.SimpleNamespace:
    clock = types.SimpleNamespace(now_ms=lambda: 1_000_000)
    return types.SimpleNamespace(client=client, clock=clock,
                                 recorder=types.SimpleNamespace(metrics=NullMetrics()))


def test_a_refused_cache_write_gives_memory_back_and_a_failed_lookup_is_a_miss(full) -> None:
    url, sync = full
    q = keys.QueueRef("cached")

    async def main() -> tuple[list[bytes | None], list[bytes | None]]:
        client = aioredis.Redis.from_url(url)
        cache = ResultCache(wiring(client), q, 10_000_000, 60_000)  # type: ignore[arg-type]
        await cache._write([(b"d%d" % i, b"x" * 1000) for i in range(50)])
        fill(sync)  # now at maxmemory: the next write is refused with OOM
        await cache._write([(b"late", b"y" * 1000)])
        found = await cache.get([b"d1", b"late"])
        await client.aclose()
        broken = ResultCache(wiring(aioredis.Redis(port=1)), q, 1000, 1000)  # type: ignore[arg-type]
        return found, await broken.get([b"d1"])

    found, missed = asyncio.run(main())
    assert found[1] is None and missed == [None]
    assert sync.zcard(keys.cache(q)[1]) <= 25  # half given back for the queue's writes


def test_a_cache_redis_refuses_leaves_every_request_answered(
        start_worker, redis_url, r, queue_name) -> None:
    """The cache's hash of the wrong type: each lookup and each write is refused (WRONGTYPE),
    and the requests are computed and answered as without a cache."""
    r.set(keys.cache(keys.QueueRef(queue_name))[0], "not a hash")
    worker = start_worker()
    texts = ["refused one", "refused two", "refused one"]
    with Client(redis_url=redis_url, queue=queue_name) as client:
        for _ in range(2):
            results = client.infer_many(texts, timeout_s=30)
            assert all(SIM.vector_ok(f.embedding, t) for f, t in zip(results, texts, strict=True))
    assert rows_and_tokens(worker)[0] == 4  # twice the two distinct texts: nothing cached
    assert "result cache write refused" in worker.output()


@pytest.mark.unit
def test_the_hf_model_identity_is_its_weights_not_its_name(tmp_path) -> None:
    from tokenq.worker.backends.hf.load import ModelSource, weights_identity

    (tmp_path / "2_Dense").mkdir()
    (tmp_path / "model.safetensors").write_bytes(b"weights" * 1000)
    (tmp_path / "2_Dense" / "model.safetensors").write_bytes(b"head")
    (tmp_path / "model.onnx").write_bytes(b"an export, not the weights")
    source = ModelSource("my-model", str(tmp_path), local=True)
    first = weights_identity(source)
    (tmp_path / "model.onnx").write_bytes(b"another export")
    assert weights_identity(source) == first
    (tmp_path / "2_Dense" / "model.safetensors").write_bytes(b"hea!")
    assert weights_identity(source) != first


def test_tenants_never_share_a_cached_or_coalesced_answer(
        start_worker, redis_url, r, queue_name) -> None:
    """The digest's namespace is the request's tenant: the same text asked by two tenants runs
    once for each and is cached once for each (docs/SECURITY.md)."""
    worker = start_worker()
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.infer_many(["asked by both"] * 8, timeout_s=30, tenant="team-a")
        wait_for(lambda: r.hlen(keys.cache(keys.QueueRef(queue_name))[0]) == 1)
        client.infer_many(["asked by both"] * 8, timeout_s=30, tenant="team-b")
        wait_for(lambda: r.hlen(keys.cache(keys.QueueRef(queue_name))[0]) == 2)
        again = client.infer_many(["asked by both"] * 2, timeout_s=30, tenant="team-a")
    assert all(SIM.vector_ok(result.embedding, "asked by both") for result in again)
    assert rows_and_tokens(worker)[0] == 2  # one row per tenant; the third call a hit
