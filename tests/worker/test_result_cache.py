"""The result cache and coalescing (docs/OPERATIONS.md, "Result cache"): a repeated request is
answered from the cache before tokenizing, identical requests in flight run as one row, the
reply is the computed one's, the cache stays within its budget, and neither a forged field nor
a refused cache write makes anyone get a wrong answer or lose one."""

from __future__ import annotations

import asyncio
import struct
import types

import msgpack
import numpy as np
import pytest
import redis.asyncio as aioredis

from tests.redis_full import fill, full_fixture
from tests.support import FAST_BEAT, SIM_FLAGS, SimModel, starter_fixture, wait_for
from tokenq.producer import Client
from tokenq.producer.ops.snapshot import heartbeats
from tokenq.producer.ops.stats import main as stats_main
from tokenq.shared import keys, wire
from tokenq.shared.request_options import NO_OPTIONS, RequestOptions
from tokenq.worker.backends.sim import SimBackend
from tokenq.worker.loop.cache import ResultCache
from tokenq.worker.loop.lanes import Ref
from tokenq.worker.loop.worker import Worker
from tokenq.worker.metrics import NullMetrics
from tokenq.worker.pipeline import pipeline as pipeline_module
from tokenq.worker.pipeline.coalesce import Coalescer
from tokenq.worker.pipeline.digest import cache_scope, request_digest
from tokenq.worker.pipeline.execute import Failure
from tokenq.worker.pipeline.pipeline import Admit, Job, Outcome, Pipeline
from tokenq.worker.settings import WorkerSettings

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


@pytest.mark.unit
def test_a_digest_the_cache_lookup_made_is_carried_not_computed_again(monkeypatch) -> None:
    pipeline: Pipeline[int] = Pipeline(SimBackend(dim=8, batch_ms=0.0, token_us=0.0))
    pipeline.cache_scope = lambda ref: b"s" * 32
    computed = []
    monkeypatch.setattr(pipeline_module, "request_digest",
                        lambda *args: computed.append(args) or b"computed")
    looked_up = pipeline.digest(1, request("a text"))
    carried = Admit(1, request("a text"), None, 0.0, digest=looked_up)
    fresh = Admit(2, request("another text"), None, 0.0)
    admitted = pipeline.admit([carried, fresh], 0)
    assert [job.digest for job in admitted.jobs] == [b"computed", b"computed"]
    assert len(computed) == 2  # the lookup's, and the one request that had none


class WeighedSim(SimBackend):
    """A sim whose weights are hashed on request, counted (as the hf backend's are read)."""

    hashed = 0

    def weights_identity(self) -> str:
        WeighedSim.hashed += 1
        return f"sha256 {WeighedSim.hashed}"


@pytest.mark.unit
def test_the_weights_are_hashed_only_for_a_cache_and_scopes_follow_the_tenant_setting(
        ) -> None:
    def scopes(**given) -> tuple[bytes, bytes]:
        worker = Worker(WorkerSettings(queue="scoped", backend="sim", **given), WeighedSim())
        worker.lanes = types.SimpleNamespace(tenant=lambda ref: f"team-{ref.lane}")
        scope = worker._device.pipeline.cache_scope
        assert scope is not None
        return scope(Ref(0, b"1-0")), scope(Ref(1, b"1-0"))

    WeighedSim.hashed = 0
    a, b = scopes()
    assert WeighedSim.hashed == 0 and a != b  # no cache: no weights read; tenants apart
    a, b = scopes(cache_bytes=1000)
    assert WeighedSim.hashed == 1 and a != b
    a, b = scopes(cache_bytes=1000, cache_across_tenants=True)
    assert a == b


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
    return types.SimpleNamespace(client=client, clock=clock, consumer="w",
                                 settings=types.SimpleNamespace(heartbeat_s=2.0),
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
        found = await cache.claim([b"d1", b"late"])
        await client.aclose()
        broken = ResultCache(wiring(aioredis.Redis(port=1)), q, 1000, 1000)  # type: ignore[arg-type]
        return found, await broken.claim([b"d1"])

    found, missed = asyncio.run(main())
    assert found[1] is None and missed == [None]
    assert sync.zcard(keys.cache(q)[1]) <= 25  # half given back for the queue's writes


def test_a_cache_redis_refuses_leaves_every_request_answered(
        start_worker, redis_url, r, queue_name) -> None:
    """The cache's hash of the wrong type: each lookup and each write is refused (WRONGTYPE),
    and the requests are computed and answered as without a cache; each logged once."""
    r.set(keys.cache(keys.QueueRef(queue_name))[0], "not a hash")
    worker = start_worker()
    texts = ["refused one", "refused two", "refused one"]
    with Client(redis_url=redis_url, queue=queue_name) as client:
        for _ in range(2):
            results = client.infer_many(texts, timeout_s=30)
            assert all(SIM.vector_ok(f.embedding, t) for f, t in zip(results, texts, strict=True))
    assert rows_and_tokens(worker)[0] == 4  # twice the two distinct texts: nothing cached
    output = worker.output()  # each failure logged at its first, not at every read or batch
    assert output.count("result cache write refused") == 1, output
    assert output.count("result cache lookup failed") <= 1, output


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
        start_worker, redis_url, r, queue_name, capsys) -> None:
    """The digest's namespace is the request's tenant: the same text asked by two tenants runs
    once for each and is cached once for each (docs/SECURITY.md): B's request for a text A
    asked is computed as one for a text nobody asked, and its reply is the same in every field."""
    worker = start_worker(*FAST_BEAT)
    q = keys.QueueRef(queue_name)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        asked = client.infer_many(["asked by both"] * 8, timeout_s=30, tenant="team-a")
        wait_for(lambda: r.hlen(keys.cache(q)[0]) == 1)
        told = client.infer_many(["asked by both"] * 8, timeout_s=30, tenant="team-b")
        assert rows_and_tokens(worker)[0] == 2  # computed for B: no hit, nothing coalesced
        wait_for(lambda: r.hlen(keys.cache(q)[0]) == 2)
        again = client.infer_many(["asked by both"] * 2, timeout_s=30, tenant="team-a")
    assert all(SIM.vector_ok(result.embedding, "asked by both") for result in again)
    assert rows_and_tokens(worker)[0] == 2  # one row per tenant; the third call a hit
    for a, b in zip(asked, told, strict=True):
        assert (a.tokens, a.truncated) == (b.tokens, b.truncated)
        assert np.array_equal(a.embedding, b.embedding)
    # every request was looked up once (a hit or a miss); the metrics and stats show them

    def counted() -> tuple[int, int, int]:
        (beat,) = [beat for beat in heartbeats(r, q).values() if beat]
        return beat.cache_hits, beat.cache_misses, beat.coalesced

    wait_for(lambda: sum(counted()[:2]) == 18)
    hits, misses, coalesced = counted()
    assert hits >= 2 and coalesced >= 2  # A's last call; the first calls' shared rows
    assert stats_main(["--redis-url", redis_url, "--queue", queue_name]) == 0
    assert (f"cache: hit ratio {hits / 18:.1%} ({hits} hits, {misses} misses)  {coalesced} "
            "coalesced") in capsys.readouterr().out


def test_an_operator_may_share_the_cache_across_tenants(
        start_worker, redis_url, r, queue_name) -> None:
    worker = start_worker("--cache-across-tenants")
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.infer_many(["asked by both"] * 4, timeout_s=30, tenant="team-a")
        wait_for(lambda: r.hlen(keys.cache(keys.QueueRef(queue_name))[0]) == 1)
        told = client.infer_many(["asked by both"] * 4, timeout_s=30, tenant="team-b")
    assert all(SIM.vector_ok(result.embedding, "asked by both") for result in told)
    assert rows_and_tokens(worker)[0] == 1  # B's answered from A's entry


@pytest.mark.parametrize("poison", [
    b"\xc1 not msgpack", msgpack.packb([1, 2]), msgpack.packb({"id": "x", "ok": True}),
    msgpack.packb({"id": "x", "ok": True, "embedding": b"abc", "dim": 9}),
    wire.encode_reply(wire.error_reply("x", "inference_failed", "an error is never cached")),
], ids=["garbage", "a-list", "no-body", "short-vector", "an-error"])
def test_a_poisoned_cache_entry_is_computed_over_never_answered(
        poison, start_worker, redis_url, r, queue_name) -> None:
    """Garbage under a real digest (someone with write access to the cache's keys): the
    worker computes the request as a miss, answers it correctly, and keeps serving."""
    worker = start_worker()
    entries = keys.cache(keys.QueueRef(queue_name))[0]
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.infer("the honest text", timeout_s=30)
        wait_for(lambda: r.hlen(entries) == 1)
        (digest,) = r.hkeys(entries)
        r.hset(entries, digest, struct.pack(">Q", 2**62) + poison)  # fresh for ever
        for _ in range(2):
            result = client.infer("the honest text", timeout_s=30)
            assert SIM.vector_ok(result.embedding, "the honest text")
        other = client.infer("another text", timeout_s=30)
    assert SIM.vector_ok(other.embedding, "another text")
    # computed over each time (the first ask may still find the reply its write just sent)
    assert rows_and_tokens(worker)[0] in (3, 4)
    wait_for(lambda: "is not a reply" in worker.output())
