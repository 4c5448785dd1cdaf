"""End to end: producers -> real Redis -> real worker processes -> replies."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
import uuid

import msgpack
import numpy as np
import pytest
import redis

from tests.support import DIM, MAX_INPUT, SIM_FLAGS, starter_fixture
from tests.workers import WorkerProcess
from tokenq.producer import AsyncClient, Client, ReplyTimeout
from tokenq.shared import keys, wire
from tokenq.shared.errors import DeadlineExceeded
from tokenq.worker.backends.sim import expected_vector


def words(rng: random.Random, n: int) -> str:
    vocabulary = ["alpha", "beta", "gamma", "delta", "queue", "token", "batch", "redis", "model"]
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def sim_tokens(text: str) -> int:
    """Tokens the sim backend sees for plain words: one per word plus [CLS] and [SEP]."""
    return len(text.split()) + 2


start_worker = starter_fixture("start_worker", *SIM_FLAGS)


def assert_vector(reply_embedding: bytes | list[float] | np.ndarray, text: str) -> None:
    got = np.frombuffer(reply_embedding, dtype="<f4") if isinstance(reply_embedding, bytes) \
        else np.asarray(reply_embedding, dtype=np.float32)
    np.testing.assert_allclose(got, expected_vector(text, DIM, MAX_INPUT), rtol=0, atol=1e-6)


def test_sync_and_async_clients_get_the_right_vectors(start_worker, redis_url, queue_name):
    start_worker()
    rng = random.Random(1)
    texts = [words(rng, rng.randint(3, 300)) for _ in range(50)]
    with Client(redis_url=redis_url, queue=queue_name) as client:
        results = client.infer_many(texts, timeout_s=30)
        for text, result in zip(texts, results, strict=True):
            assert_vector(list(result.embedding), text)
        single = client.infer("one lone request", timeout_s=30)
        assert_vector(list(single.embedding), "one lone request")

    async def many() -> list:
        async with AsyncClient(redis_url=redis_url, queue=queue_name) as aclient:
            return await asyncio.gather(*(aclient.infer(t, timeout_s=30) for t in texts))

    for text, result in zip(texts, asyncio.run(many()), strict=True):
        assert_vector(list(result.embedding), text)


def test_submit_now_fetch_later_from_another_client(start_worker, redis_url, queue_name):
    with Client(redis_url=redis_url, queue=queue_name) as client:
        request_id = client.submit("fetch me later")
    start_worker()
    with Client(redis_url=redis_url, queue=queue_name) as other:
        result = other.result(request_id, timeout_s=30)
    assert result.id == request_id
    assert_vector(list(result.embedding), "fetch me later")


def test_raw_xadd_from_redis_cli_is_answered(start_worker, redis_server, r, queue_name):
    start_worker()
    q = keys.QueueRef(queue_name)
    request_id = f"cli-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["redis-cli", "-p", str(redis_server.port), "XADD", keys.requests(q), "*",
         "v", "1", "id", request_id, "text", "hello from redis-cli", "tokens", "6"],
        check=True, capture_output=True,
    )
    popped = r.blpop([keys.reply(q, request_id)], timeout=20)
    assert popped is not None, "no reply on the default reply key"
    body = msgpack.unpackb(popped[1], raw=False)
    assert body["id"] == request_id and body["ok"] is True and body["dim"] == DIM
    assert_vector(body["embedding"], "hello from redis-cli")
    assert r.ttl(keys.reply(q, request_id)) == -2 or r.ttl(keys.reply(q, request_id)) > 0


def test_expired_deadline_gets_an_error_reply_not_a_result(start_worker, redis_url, queue_name):
    with Client(redis_url=redis_url, queue=queue_name) as client:
        late = client.submit("too late", deadline_s=0.05)
        time.sleep(0.3)
        start_worker()
        with pytest.raises(DeadlineExceeded) as caught:
            client.result(late, timeout_s=30)
        assert caught.value.code == "deadline_exceeded"
        assert_vector(list(client.infer("in time", deadline_s=30, timeout_s=30).embedding),
                      "in time")


def test_bad_entries_get_error_replies_and_the_worker_survives(start_worker, r, queue_name):
    start_worker()
    q = keys.QueueRef(queue_name)
    bad = {
        "empty": {"v": "1", "id": "empty", "text": "   "},
        "badversion": {"v": "9", "id": "badversion", "text": "x"},
        "badtokens": {"v": "1", "id": "badtokens", "text": "x", "tokens": "many"},
        "badutf8": {"v": "1", "id": "badutf8", "text": b"\xff\xfe"},
        "huge": {"v": "1", "id": "huge", "text": "a " * 600_000},
    }
    for fields in bad.values():
        r.xadd(keys.requests(q), fields)
    for request_id in bad:
        popped = r.blpop([keys.reply(q, request_id)], timeout=20)
        assert popped is not None, f"no error reply for {request_id}"
        body = msgpack.unpackb(popped[1], raw=False)
        assert body["ok"] is False and body["error"]["code"] == "bad_request"
        assert body["error"]["message"]
    good = "still serving"
    r.xadd(keys.requests(q), {"v": "1", "id": "good", "text": good})
    popped = r.blpop([keys.reply(q, "good")], timeout=20)
    assert popped is not None
    assert_vector(msgpack.unpackb(popped[1], raw=False)["embedding"], good)
    assert r.xlen(keys.requests(q)) == 0


def enqueue_raw(r: redis.Redis, q: keys.QueueRef, texts: list[str], reply_to: str) -> list[str]:
    """XADD requests exactly as the protocol says, in pipelined chunks."""
    ids = []
    with r.pipeline(transaction=False) as pipe:
        for index, text in enumerate(texts):
            request_id = f"r{index}"
            ids.append(request_id)
            fields = wire.encode_request(
                wire.Request(id=request_id, text=text, tokens=sim_tokens(text), reply_to=reply_to)
            )
            pipe.xadd(keys.requests(q), fields)
            if index % 1000 == 999:
                pipe.execute()
        pipe.execute()
    return ids


def collect(r: redis.Redis, reply_to: str, expected: int, timeout: float) -> list[wire.Reply]:
    replies: list[wire.Reply] = []
    deadline = time.monotonic() + timeout
    while len(replies) < expected and time.monotonic() < deadline:
        popped = r.blpop([reply_to], timeout=1)
        if popped is None:
            continue
        replies.append(wire.decode_reply(popped[1]))
        rest = r.lpop(reply_to, 1000) or []
        replies.extend(wire.decode_reply(item) for item in rest)
    return replies


@pytest.mark.slow
def test_ten_thousand_mixed_requests_through_two_workers(start_worker, r, queue_name):
    budget = 16384
    workers = [start_worker("--max-batch-tokens", str(budget), "--max-batch-size", "256",
                            wait=False) for _ in range(2)]
    for worker in workers:  # started together: their imports overlap
        worker.wait_ready(r, queue_name)
    rng = random.Random(7)
    lengths = [
        rng.randint(15, 23) if rng.random() < 0.5 else rng.randint(1400, 1550)
        for _ in range(10_000)
    ]
    texts = [words(rng, n) for n in lengths]
    q = keys.QueueRef(queue_name)
    reply_to = keys.reply(q, "bulk")
    ids = enqueue_raw(r, q, texts, reply_to)
    replies = collect(r, reply_to, len(ids), timeout=240)
    time.sleep(0.5)
    replies += collect(r, reply_to, 1, timeout=0.5)  # anything extra would be a duplicate

    by_id = {reply.id: reply for reply in replies}
    assert len(replies) == len(ids) == len(by_id), "every request answered exactly once"
    for request_id, text in zip(ids, texts, strict=True):
        reply = by_id[request_id]
        assert reply.ok, reply.error
        assert reply.tokens == sim_tokens(text)
        assert_vector(reply.embedding, text)

    batches = [batch for worker in workers for batch in worker.batches()]
    assert sum(batch["rows"] for batch in batches) == len(ids)
    assert all(workers_batch["rows"] > 0 for workers_batch in batches)
    for batch in batches:
        assert batch["cost"] <= budget and batch["rows"] <= 256, batch
        assert batch["padded_tokens"] <= budget
    efficiency = sum(b["tokens"] for b in batches) / sum(b["padded_tokens"] for b in batches)
    assert efficiency >= 0.9, efficiency
    assert all(worker.batches() for worker in workers), "both workers took part"
    assert r.xlen(keys.requests(q)) == 0
    assert r.xpending(keys.requests(q), keys.GROUP)["pending"] == 0


def test_sigterm_mid_load_loses_nothing(start_worker, r, queue_name):
    q = keys.QueueRef(queue_name)
    rng = random.Random(3)
    texts = [words(rng, rng.randint(5, 600)) for _ in range(3000)]
    reply_to = keys.reply(q, "term")
    ids = enqueue_raw(r, q, texts, reply_to)
    # ~3 s of device time for the 3,000 (about 900k tokens): the stop after 1 s
    # lands mid-load however fast the worker feeds the device.
    slow = ("--sim-batch-ms", "10", "--sim-token-us", "3")
    first = start_worker(*slow, name="first")
    time.sleep(1.0)
    assert first.terminate() == 0, first.output()
    answered_by_first = r.llen(reply_to)
    assert 0 < answered_by_first < len(ids), "stop should land mid-load"
    assert r.xpending(keys.requests(q), keys.GROUP)["pending"] == 0, (
        "the stopping worker answered everything it had read"
    )
    assert not r.exists(keys.worker_alive(q, "first")) and not r.hexists(keys.workers(q), "first")
    start_worker(name="second")
    replies = collect(r, reply_to, len(ids), timeout=120)
    assert sorted(reply.id for reply in replies) == sorted(ids)
    assert all(reply.ok for reply in replies)


def test_worker_refuses_bad_settings(worker_env):
    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tokenq.worker", *flags], env=worker_env,
            capture_output=True, text=True, timeout=60,
        )

    budget = run("--backend", "sim", "--sim-max-input-tokens", "4096", "--max-batch-tokens", "1000")
    assert budget.returncode == 2
    assert "1000" in budget.stderr and "4096" in budget.stderr

    negative = run("--max-batch-tokens", "-5")
    assert negative.returncode == 2 and "--max-batch-tokens" in negative.stderr

    url = run("--redis-url", "http://nope")
    assert url.returncode == 2 and "redis_url" in url.stderr

    plugin = run("--backend", "no.such.module:factory")
    assert plugin.returncode == 2 and "no.such.module" in plugin.stderr

    # A real model's name on the simulated GPU would serve fake vectors under it.
    fake = run("--backend", "sim", "--model", "BAAI/bge-small-en-v1.5")
    assert fake.returncode == 2
    assert "--backend sim ignores --model" in fake.stderr and "--backend hf" in fake.stderr
    from_env = subprocess.run(
        [sys.executable, "-m", "tokenq.worker", "--backend", "hf"],
        env={**worker_env, "TOKENQ_SIM_DIM": "8"}, capture_output=True, text=True, timeout=60,
    )
    assert from_env.returncode == 2 and "--backend hf ignores --sim-dim" in from_env.stderr


def test_worker_started_before_redis_waits_for_it(worker_env, tmp_path, queue_name):
    """A worker that starts first (compose, Kubernetes) retries until Redis is up."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path / "late")
    env = {**worker_env, "TOKENQ_REDIS_URL": server.url}
    worker = WorkerProcess(env, tmp_path, *SIM_FLAGS, "--retries", "0", name="early")
    try:
        refused = f"cannot reach Redis at {server.url}"
        deadline = time.monotonic() + 60  # a loaded machine starts Python slowly
        while refused not in worker.output() and time.monotonic() < deadline:
            assert worker.process.poll() is None, worker.output()
            time.sleep(0.1)
        assert refused in worker.output()
        server.start()
        client = redis.Redis.from_url(server.url)
        worker.wait_ready(client, queue_name, timeout=30)
        with Client(redis_url=server.url, queue=queue_name) as producer:
            assert_vector(list(producer.infer("finally", timeout_s=30).embedding), "finally")
        assert worker.process.poll() is None, worker.output()
    finally:
        worker.close()
        server.stop()


def test_a_timeout_says_when_no_live_worker_serves_the_queue(start_worker, redis_url, queue_name):
    nobody = f"no live worker serves queue '{queue_name}'"
    with Client(redis_url=redis_url, queue=queue_name) as client, \
            pytest.raises(ReplyTimeout, match=nobody):
        client.infer("nobody is home", timeout_s=0.5)
    start_worker("--sim-batch-ms", "3000")  # alive, but slower than the caller's timeout
    with Client(redis_url=redis_url, queue=queue_name) as client, \
            pytest.raises(ReplyTimeout) as raised:
        client.infer("a slow device", timeout_s=0.5)
    assert raised.value.why is None and "no live worker" not in str(raised.value)
