"""``tokenq serve``: the OpenAI and TEI APIs over a queue, against real workers and Redis.

The real ``openai`` SDK and httpx talk to the gateway (in process through
FastAPI's TestClient, and once as the ``tokenq serve`` command on a port),
which talks to a real redis-server and real workers: sim workers, and tiny
random BERTs run by the hf backend (an embedder with a named prompt, a
classifier, a reranker; started once for the module). Vectors must equal the
sim's own, scores and labels the queue's own (asked directly with
``AsyncClient.infer_many`` and the same options), usage must equal the
workers' exact token counts, and every error status comes from a real
condition: a body or batch too large, a field that does not validate, an
option the workers refuse, a route the queue's model does not answer, an
unknown model, a full queue, no worker, a worker's failure, Redis down, a
client that goes away. The request parsing itself is tested without I/O in
tests/gateway/test_serve_schemas.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import redis

from tests.cli_support import DIM, MAX_INPUT
from tests.redis_server import RedisServer, free_port
from tests.serve_process import (
    DOC_URL,
    MIGRATING,
    README,
    README_URL,
    doc_code,
    run_doc_code,
    start_gateway,
)
from tests.support import wait_for
from tests.workers import WorkerProcess
from tokenq.producer import AsyncClient, Result
from tokenq.shared import keys
from tokenq.shared.settings import ServeSettings
from tokenq.worker.backends.sim import SIM_FAIL_MARKER, encode, expected_vector

pytest_plugins = ("tests.cli_fixtures",)

openai = pytest.importorskip("openai")
testclient = pytest.importorskip("fastapi.testclient")
from tokenq.producer.serve.app import create_app  # noqa: E402  (after the skips)

TEXTS = ["the gateway holds no model", "a GPU worker answers", "同じ順序で答える"]


def gateway(redis_url: str, queue: str, **settings) -> testclient.TestClient:
    app = create_app(ServeSettings(redis_url=redis_url, queue=queue, **settings))
    return testclient.TestClient(app, raise_server_exceptions=True)


def tokens_of(texts: list[str]) -> int:
    return sum(encode(text, None, MAX_INPUT).length for text in texts)


def assert_vectors(vectors, texts: list[str]) -> None:
    assert len(vectors) == len(texts)
    for vector, text in zip(vectors, texts, strict=True):
        np.testing.assert_allclose(vector, expected_vector(text, DIM, MAX_INPUT), atol=1e-6)


def test_the_openai_sdk_gets_the_queues_vectors_and_exact_usage(sim_worker, redis_url, queue_name):
    sim_worker()
    with gateway(redis_url, queue_name) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                               http_client=http, max_retries=0)
        created = client.embeddings.create(model="anything", input=TEXTS)
        assert_vectors([item.embedding for item in created.data], TEXTS)
        assert [item.index for item in created.data] == [0, 1, 2]
        assert created.usage.prompt_tokens == created.usage.total_tokens == tokens_of(TEXTS)
        assert created.model == "anything"
        one = client.embeddings.create(model="anything", input="just one")
        assert_vectors([one.data[0].embedding], ["just one"])
        packed = client.embeddings.create(model="m", input=TEXTS, encoding_format="base64")
        decoded = [np.frombuffer(base64.b64decode(item.embedding), "<f4") for item in packed.data]
        assert_vectors(decoded, TEXTS)
        cut = client.embeddings.create(model="m", input=TEXTS, dimensions=8)
        for item, text in zip(cut.data, TEXTS, strict=True):
            full = expected_vector(text, DIM, MAX_INPUT)[:8]
            np.testing.assert_allclose(item.embedding, full / np.linalg.norm(full), atol=1e-6)
        with pytest.raises(openai.UnprocessableEntityError, match="dimensions") as refused:
            client.embeddings.create(model="m", input="x", dimensions=DIM + 1)
        assert refused.value.body["param"] == "dimensions"
        infinity = http.post("/embeddings", json={"model": "m", "input": TEXTS, "dimensions": 0})
        assert_vectors([item["embedding"] for item in infinity.json()["data"]], TEXTS)


def test_tei_embed_info_health_and_ready(sim_worker, redis_url, queue_name):
    with gateway(redis_url, queue_name) as http:
        not_ready = http.get("/ready")
        assert not_ready.status_code == 503 and queue_name in not_ready.json()["error"]
        assert http.get("/readyz").json() == not_ready.json()  # the worker's names too
        assert http.get("/health").status_code == 200
        assert http.get("/livez").json() == http.get("/health").json()
        sim_worker()
        assert http.get("/ready").status_code == 200
        assert http.get("/readyz").json() == http.get("/ready").json()
        vectors = http.post("/embed", json={"inputs": TEXTS, "normalize": True})
        assert vectors.status_code == 200, vectors.text
        assert_vectors(vectors.json(), TEXTS)
        single = http.post("/embed", json={"inputs": "only one"})
        assert_vectors(single.json(), ["only one"])
        info = http.get("/info").json()
        assert info["model_id"] == "sim" and info["max_input_length"] == MAX_INPUT
        assert info["model_type"] == {"embedding": {"pooling": "unknown"}}
        assert info["auto_truncate"] is True
        for refused, status, field in (
            ({"inputs": "x", "prompt_name": "query"}, 422, "prompt_name"),  # sim has no prompts
            ({"inputs": "x", "normalize": False}, 422, "normalize"),  # sim answers unit vectors
            ({"inputs": "word " * 3000, "truncate": False}, 422, "input"),  # 3002 > 2048 tokens
            ({"inputs": "x", "truncation_direction": "Left"}, 422, "truncation_direction"),
            ({"inputs": [[1, 2, 3]]}, 422, "token-id"),
            ({"inputs": []}, 400, "inputs"),
        ):
            answer = http.post("/embed", json=refused)
            assert answer.status_code == status, (refused, answer.text)
            assert answer.json()["error_type"] == ("Empty" if status == 400 else "Validation")
            assert field in answer.json()["error"], answer.text
        cut = http.post("/embed", json={"inputs": "word " * 3000, "truncate": True})
        assert_vectors(cut.json(), ["word " * 3000])  # the sim's own truncation
        metrics = http.get("/metrics").text
        assert 'tokenq_serve_requests_total{route="/embed",status="200"} 3.0' in metrics
        assert 'tokenq_serve_requests_total{route="/embed",status="422"} 5.0' in metrics
        assert 'tokenq_serve_requests_total{route="/embed",status="400"} 1.0' in metrics


def test_the_readmes_first_gateway_example_runs_as_written_offline(
    sim_worker, redis_url, queue_name, spawn, tmp_path, monkeypatch
):
    pytest.importorskip("langchain_openai")
    import tiktoken

    def download(*args, **kwargs):
        raise AssertionError("the README's example must not need tiktoken's tables")
    monkeypatch.setattr(tiktoken, "get_encoding", download)  # what an offline machine gets
    monkeypatch.setattr(tiktoken, "encoding_for_model", download)
    sim_worker()
    url = start_gateway(spawn, redis_url, queue_name, tmp_path / "serve.log")
    code = doc_code(README, "Using it", containing="base_url=")  # its block of gateway calls
    names = run_doc_code(code, {README_URL: url}, "README.md (the gateway's example)")
    assert_vectors([item.embedding for item in names["vectors"].data], ["hello", "world"])
    assert_vectors(names["documents"], ["hello", "world"])


def test_migratings_curl_to_vectors_runs_as_written(sim_worker, redis_url, queue_name, spawn,
                                                    tmp_path):
    """docs/MIGRATING.md's ``curl`` to ``POST /embed``, run by curl itself, host swapped."""
    sim_worker()
    url = start_gateway(spawn, redis_url, queue_name, tmp_path / "serve.log")
    command = doc_code(MIGRATING, "`POST /embed`", containing="curl", language="bash")
    done = subprocess.run(["bash", "-c", command.replace(DOC_URL, url)], capture_output=True,
                          text=True, timeout=60, check=True)
    assert_vectors(json.loads(done.stdout), ["hello", "world"])


def test_over_length_input_is_cut_and_said_so_or_refused_when_asked(
    sim_worker, redis_url, queue_name
):
    limit = 16
    sim_worker("--sim-max-input-tokens", str(limit), "--policy", "truncate")
    short, long, over = "a short one", "word " * 40, "w " * (limit - 1)  # 42 and 17 tokens
    exact = "w " * (limit - 2)  # the limit's length: read whole, not cut
    assert encode(long).length > encode(over).length > limit == encode(exact).length
    with gateway(redis_url, queue_name) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                               http_client=http, max_retries=0)
        texts = [short, long, exact, over]
        raw = client.embeddings.with_raw_response.create(model="m", input=texts)
        assert raw.headers["x-tokenq-truncated"] == "2"  # long and over
        created = raw.parse()
        for item, text in zip(created.data, texts, strict=True):
            np.testing.assert_allclose(item.embedding, expected_vector(text, DIM, limit),
                                       atol=1e-6)
        read = encode(short).length + 3 * limit  # the tokens the model read: two cut
        assert created.usage.prompt_tokens == created.usage.total_tokens == read
        whole = client.embeddings.with_raw_response.create(model="m", input=[short, exact])
        assert whole.headers["x-tokenq-truncated"] == "0"
        # truncate: false (TEI's field, in extra_body) refuses instead, naming the limit:
        # far over, the gateway's estimate refuses it with its index before queueing ...
        with pytest.raises(openai.UnprocessableEntityError) as far:
            client.embeddings.create(model="m", input=[short, long],
                                     extra_body={"truncate": False})
        assert far.value.body["code"] == "too_long" and far.value.body["param"] == "input"
        assert "[1]" in far.value.message and f"limit of {limit}" in far.value.message
        assert "truncate: false" in far.value.message
        # ... and just over, the worker does, reading no further than the limit
        with pytest.raises(openai.UnprocessableEntityError) as near:
            client.embeddings.create(model="m", input=[over], extra_body={"truncate": False})
        assert near.value.body["code"] == "too_long"
        assert f"more than {limit} tokens, the model's limit" in near.value.message
        kept = client.embeddings.with_raw_response.create(
            model="m", input=[short, exact], extra_body={"truncate": False})
        assert kept.headers["x-tokenq-truncated"] == "0"
        assert kept.parse().usage.prompt_tokens == encode(short).length + limit


def test_each_error_status_comes_from_its_real_condition(sim_worker, redis_url, queue_name):
    with gateway(redis_url, queue_name, max_body_bytes=2048, max_client_batch_size=4,
                 timeout_s=1.0) as http:
        def post(body=None, **kwargs) -> httpx.Response:
            return http.post("/v1/embeddings", json=body, **kwargs)

        big = post({"model": "m", "input": "x" * 5000})
        assert big.status_code == 413 and big.json()["error"]["param"] == "body"
        many = post({"model": "m", "input": ["a"] * 5})
        assert many.status_code == 413 and "over the limit of 4" in many.json()["error"]["message"]
        bad = post({"model": "m", "input": 5})
        assert bad.status_code == 422 and bad.json()["error"]["param"].startswith("input")
        missing = post({"input": "x"})
        assert missing.status_code == 422 and missing.json()["error"]["param"] == "model"
        nobody = post({"model": "m", "input": "is anyone there?"})  # --cold-start-s 0
        assert nobody.status_code == 503 and nobody.json()["error"]["code"] == "no_worker"
        assert "no live worker serves queue" in nobody.json()["error"]["message"]
        sim_worker()
        empty = post({"model": "m", "input": "   "})
        assert empty.status_code == 422 and "empty" in empty.json()["error"]["message"]
        failed = post({"model": "m", "input": [f"poison {SIM_FAIL_MARKER}"]})
        assert failed.status_code == 424 and failed.json()["error"]["code"] == "inference_failed"
        assert post({"model": "m", "input": ["fine"]}).status_code == 200


def test_a_full_queue_is_429_with_retry_after_and_an_unknown_model_404(redis_url, queue_name):
    with gateway(redis_url, queue_name, max_queue_length=1, models=f"small={queue_name}",
                 cold_start_s=5) as http:  # no worker: queued, as a fleet at zero is
        full = http.post("/v1/embeddings", json={"model": "small", "input": ["a", "b"]})
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["type"] == "rate_limit_error"
        unknown = http.post("/v1/embeddings", json={"model": "large", "input": "a"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_redis_down_is_503(queue_name):
    down = dict(redis_url="redis://127.0.0.1:1/0", retries=0, socket_timeout_s=0.2,
                timeout_s=1.0)
    with gateway(down.pop("redis_url"), queue_name, **down) as http:
        assert http.get("/health").status_code == 503
        assert http.post("/embed", json={"inputs": "x"}).status_code == 503


def test_a_classifier_queue_predicts_and_refuses_embeddings_by_name(
    sim_worker, redis_url, queue_name
):
    """The sim classifier answers its vector as scores and names no labels: ``LABEL_i``."""
    sim_worker("--backend", "tests.plugins_for_tests:sim_classifier")
    with gateway(redis_url, queue_name) as http:
        answer = http.post("/v1/embeddings", json={"model": "spam", "input": "buy now"})
        assert answer.status_code == 424
        assert answer.json()["error"]["code"] == "not_an_embedding_model"
        tei = http.post("/embed", json={"inputs": "buy now"})
        assert tei.status_code == 424 and "not embeddings" in tei.json()["error"]
        predicted = http.post("/predict", json={"inputs": "buy now"})
        assert predicted.status_code == 200, predicted.text
        scores = expected_vector("buy now", DIM, MAX_INPUT)
        assert [p["score"] for p in predicted.json()] == pytest.approx(
            sorted(scores, reverse=True), abs=1e-6)
        for p in predicted.json():
            assert p["score"] == pytest.approx(scores[int(p["label"].removeprefix("LABEL_"))],
                                               abs=1e-6)
        batch = http.post("/predict", json={"inputs": [["buy now"], ["hello"]]}).json()
        assert len(batch) == 2 and len(batch[0]) == DIM and batch[0] == predicted.json()
        pair = http.post("/predict", json={"inputs": ["a", "b"]})
        assert pair.status_code == 422 and "single texts" in pair.json()["error"]
        rerank = http.post("/rerank", json={"query": "q", "texts": ["a"]})
        assert rerank.status_code == 424 and "re-ranker" in rerank.json()["error"]
        model_type = http.get("/info").json()["model_type"]
        assert list(model_type) == ["classifier"]
        assert model_type["classifier"]["id2label"]["31"] == "LABEL_31"


def test_scoring_routes_refuse_an_embedding_queue(sim_worker, redis_url, queue_name):
    sim_worker()
    with gateway(redis_url, queue_name) as http:
        rerank = http.post("/rerank", json={"query": "q", "texts": ["a", "b"]})
        assert rerank.status_code == 424 and rerank.json()["error_type"] == "Backend"
        assert "not a re-ranker" in rerank.json()["error"]
        predict = http.post("/predict", json={"inputs": "a"})
        assert predict.status_code == 424 and "not a classifier" in predict.json()["error"]
        empty = http.post("/rerank", json={"query": "q", "texts": []})
        assert empty.status_code == 400 and empty.json()["error_type"] == "Empty"


@pytest.fixture
def served(sim_worker, redis_url, queue_name, spawn, tmp_path) -> Iterator[str]:
    """``tokenq serve`` as a process on a free port, with a slow sim worker behind it."""
    sim_worker("--sim-batch-ms", "1500")
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    spawn([sys.executable, "-m", "tokenq.shared.cli", "serve", "--redis-url", redis_url,
           "--queue", queue_name, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    else:
        raise AssertionError((tmp_path / "serve.log").read_text())
    yield url
    log.close()


def test_the_command_serves_the_sdk_and_a_client_that_leaves_stops_its_wait(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    created = client.embeddings.create(model="m", input=TEXTS)
    assert_vectors([item.embedding for item in created.data], TEXTS)
    body = b'{"model": "m", "input": "nobody waits for me"}'
    with socket.create_connection(("127.0.0.1", int(served.rsplit(":", 1)[1]))) as raw:
        raw.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)  # the wait has begun; the device takes 1.5 s
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{served}/metrics").text
        if 'route="/v1/embeddings",status="499"' in metrics:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(metrics)


# ------------------------------------------------------------- hf workers

PROMPT = "query: "
QUERY = "the quick brown fox"
PASSAGES = ["the quick brown fox", "hello world", "cat and dog", "你好世界", "the dog"]
CLASS_NAMES = ("negative", "neutral", "positive")
HF_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def hf(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[SimpleNamespace]:
    """Three hf workers on queues of their own, started together once for the module.

    ``embed``: a sentence-transformers folder (mean pooling, Normalize) whose
    ``config_sentence_transformers.json`` names one prompt, ``query``;
    ``classify``: three named labels; ``rerank``: one logit, ``--task rerank``.
    """
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.tiny_bert import write_sentence_transformers_files, write_tiny_bert

    root = tmp_path_factory.mktemp("serve-models")
    embed = write_sentence_transformers_files(write_tiny_bert(root / "embed", seed=21),
                                              pooling="mean", normalize=True)
    (embed / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": PROMPT}, "default_prompt_name": None}))
    classify = write_tiny_bert(root / "classify", head="classify", num_labels=3, seed=22)
    config = json.loads((classify / "config.json").read_text())
    config["id2label"] = dict(enumerate(CLASS_NAMES))
    config["label2id"] = {name: index for index, name in enumerate(CLASS_NAMES)}
    (classify / "config.json").write_text(json.dumps(config))
    rerank = write_tiny_bert(root / "rerank", head="classify", num_labels=1, seed=23)
    env = dict(os.environ, TOKENQ_REDIS_URL=redis_server.url, PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    logs = tmp_path_factory.mktemp("serve-workers")
    flags = {"embed": (embed,), "classify": (classify, "--task", "classify"),
             "rerank": (rerank, "--task", "rerank")}
    queues = {name: f"s{uuid.uuid4().hex[:12]}" for name in flags}
    workers = [
        WorkerProcess(env, logs, "--queue", queues[name], "--backend", "hf", "--model",
                      str(model), *rest, "--heartbeat-s", "0.5", name=name)
        for name, (model, *rest) in flags.items()
    ]
    client = redis.Redis.from_url(redis_server.url)
    try:
        for worker, queue in zip(workers, queues.values(), strict=True):
            worker.wait_ready(client, queue, timeout=120)
        yield SimpleNamespace(url=redis_server.url, workers=dict(zip(flags, workers, strict=True)),
                              **queues)
    finally:
        client.close()
        for worker in workers:
            worker.close()


def direct(hf: SimpleNamespace, queue: str, items: list, **options) -> list[Result]:
    """What the queue itself answers ``items`` with ``options``, without the gateway."""
    async def ask() -> list[Result]:
        async with AsyncClient(hf.url, queue, timeout_s=HF_TIMEOUT_S) as client:
            return await client.infer_many(items, **options)

    return asyncio.run(ask())


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.slow  # three hf workers: about a minute to start
def test_rerank_ranks_the_queues_own_scores(hf):
    pairs = [(QUERY, text) for text in PASSAGES]
    own = [result.scores[0] for result in direct(hf, hf.rerank, pairs)]
    raw = [result.scores[0] for result in direct(hf, hf.rerank, pairs, raw_scores=True)]
    with gateway(hf.url, hf.rerank, timeout_s=HF_TIMEOUT_S, max_client_batch_size=5) as http:
        ranks = http.post("/rerank", json={"query": QUERY, "texts": PASSAGES})
        assert ranks.status_code == 200, ranks.text
        assert sorted(rank["index"] for rank in ranks.json()) == list(range(len(PASSAGES)))
        assert [rank["score"] for rank in ranks.json()] == pytest.approx(
            sorted(own, reverse=True), abs=1e-6)
        for rank in ranks.json():
            assert rank["score"] == pytest.approx(own[rank["index"]], abs=1e-6)
            assert "text" not in rank
        texts = http.post("/rerank", json={"query": QUERY, "texts": PASSAGES,
                                           "return_text": True}).json()
        assert all(rank["text"] == PASSAGES[rank["index"]] for rank in texts)
        logits = http.post("/rerank", json={"query": QUERY, "texts": PASSAGES,
                                            "raw_scores": True}).json()
        by_index = {rank["index"]: rank["score"] for rank in logits}
        assert [by_index[i] for i in range(len(PASSAGES))] == pytest.approx(raw, abs=1e-6)
        # by default a one-logit reranker's score is its sigmoid, as TEI answers
        assert own == pytest.approx([sigmoid(x) for x in raw], abs=1e-6)
        assert own != pytest.approx(raw, abs=1e-3)
        too_many = http.post("/rerank", json={"query": QUERY, "texts": [*PASSAGES, "one more"]})
        assert too_many.status_code == 413 and "over the limit of 5" in too_many.json()["error"]
        left = http.post("/rerank", json={"query": QUERY, "texts": PASSAGES,
                                          "truncation_direction": "Left"})
        assert left.status_code == 422 and "truncation_direction" in left.json()["error"]
        pair = http.post("/predict", json={"inputs": [QUERY, PASSAGES[1]]}).json()
        assert pair == [{"label": "LABEL_0", "score": pytest.approx(own[1], abs=1e-6)}]
        assert list(http.get("/info").json()["model_type"]) == ["reranker"]


@pytest.mark.slow  # three hf workers: about a minute to start
def test_predict_answers_the_queues_labels_and_scores(hf):
    texts = ["hello world", "the cat", "狗"]
    own = direct(hf, hf.classify, texts)
    raw = direct(hf, hf.classify, texts, raw_scores=True)

    def expected(result: Result) -> list[dict]:
        names = result.labels or CLASS_NAMES
        return sorted(({"label": name, "score": pytest.approx(score, abs=1e-6)}
                       for name, score in zip(names, result.scores, strict=True)),
                      key=lambda p: -p["score"].expected)

    with gateway(hf.url, hf.classify, timeout_s=HF_TIMEOUT_S) as http:
        one = http.post("/predict", json={"inputs": texts[0]})
        assert one.status_code == 200, one.text
        assert one.json() == expected(own[0])
        assert http.post("/predict", json={"inputs": [texts[0]]}).json() == one.json()
        batch = http.post("/predict", json={"inputs": [[text] for text in texts]}).json()
        assert batch == [expected(result) for result in own]
        logits = http.post("/predict", json={"inputs": [[text] for text in texts],
                                             "raw_scores": True}).json()
        assert logits == [expected(result) for result in raw]
        # by default a classifier's scores are the softmax of its logits, as TEI answers
        for result, logit in zip(own, raw, strict=True):
            exps = [math.exp(x) for x in logit.scores]
            assert result.scores == pytest.approx([e / sum(exps) for e in exps], abs=1e-6)
        info = http.get("/info").json()["model_type"]
        assert info == {"classifier": {"id2label": dict(zip("012", CLASS_NAMES, strict=True)),
                                       "label2id": {n: i for i, n in enumerate(CLASS_NAMES)}}}


@pytest.mark.slow  # three hf workers: about a minute to start
def test_info_reports_the_pooling_the_hf_worker_logs(hf):
    """The tiny embedder's sentence-transformers folder says mean pooling: the worker logs
    it at start, publishes it, and ``/info`` reports the same."""
    logged = re.search(r" pooling=(\S+)", hf.workers["embed"].output())
    assert logged is not None, hf.workers["embed"].output()
    with gateway(hf.url, hf.embed, timeout_s=HF_TIMEOUT_S) as http:
        info = http.get("/info").json()
    assert info["model_type"] == {"embedding": {"pooling": logged.group(1)}}
    assert logged.group(1) == "mean"  # what the fixture's folder configured


@pytest.mark.slow  # three hf workers: about a minute to start
def test_embedding_options_reach_the_hf_worker(hf):
    text = "hello world"
    default, = direct(hf, hf.embed, [text])
    raw, = direct(hf, hf.embed, [text], normalize=False)
    prompted, = direct(hf, hf.embed, [text], prompt_name="query")
    spelled, = direct(hf, hf.embed, [PROMPT + text])
    models = f"embed={hf.embed},classify={hf.classify},rerank={hf.rerank}"
    with gateway(hf.url, hf.embed, timeout_s=HF_TIMEOUT_S, models=models) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                               http_client=http, max_retries=0)
        full = np.array(client.embeddings.create(model="embed", input=text).data[0].embedding)
        np.testing.assert_allclose(full, default.embedding, atol=1e-6)
        cut = client.embeddings.create(model="embed", input=text, dimensions=8).data[0]
        assert len(cut.embedding) == 8
        np.testing.assert_allclose(cut.embedding, full[:8] / np.linalg.norm(full[:8]),
                                   atol=1e-5)

        unnormalized = http.post("/embed", json={"inputs": text, "normalize": False})
        assert unnormalized.status_code == 200, unnormalized.text
        np.testing.assert_allclose(unnormalized.json()[0], raw.embedding, atol=1e-6)
        assert abs(np.linalg.norm(unnormalized.json()[0]) - 1) > 1e-3
        normalized = http.post("/embed", json={"inputs": text}).json()[0]
        np.testing.assert_allclose(normalized, default.embedding, atol=1e-6)
        np.testing.assert_allclose(normalized, raw.embedding / np.linalg.norm(raw.embedding),
                                   atol=1e-5)

        with_prompt = http.post("/embed", json={"inputs": text, "prompt_name": "query"})
        assert with_prompt.status_code == 200, with_prompt.text
        np.testing.assert_allclose(with_prompt.json()[0], prompted.embedding, atol=1e-6)
        np.testing.assert_allclose(with_prompt.json()[0], spelled.embedding, atol=1e-5)
        assert not np.allclose(with_prompt.json()[0], default.embedding, atol=1e-3)
        unknown = http.post("/embed", json={"inputs": text, "prompt_name": "passage"})
        assert unknown.status_code == 422, unknown.text
        assert "prompt_name" in unknown.json()["error"] and "passage" in unknown.json()["error"]

        # ``model`` routes a TEI body to one of --models' queues
        ranked = http.post("/rerank", json={"model": "rerank", "query": QUERY,
                                            "texts": PASSAGES[:2]})
        assert ranked.status_code == 200, ranked.text
        assert http.post("/rerank", json={"query": QUERY, "texts": ["a"]}).status_code == 424
        labels = http.post("/predict", json={"model": "classify", "inputs": text}).json()
        assert {p["label"] for p in labels} == set(CLASS_NAMES)
        assert http.post("/embed", json={"model": "large", "inputs": text}).status_code == 404


def test_the_pending_tokens_gauge_skips_a_hand_written_sum_and_logs_a_failing_refresh_once(
        redis_url, queue_name, monkeypatch, caplog):
    """A sum holding no count is read as 0 (logged once), and a refresh Redis refuses (the hash
    is no hash) keeps the last figure, logged once until a refresh works again."""
    from tokenq.producer.serve import app

    monkeypatch.setattr(app, "PENDING_EVERY_S", 0.02)
    q, r = keys.QueueRef(queue_name), redis.Redis.from_url(redis_url)
    r.hset(keys.pending(q), keys.PENDING_TOTAL, "12")
    line = f'tokenq_queue_pending_tokens{{queue="{queue_name}"}}'
    with gateway(redis_url, queue_name) as http:
        def exported() -> float | None:
            found = [row for row in http.get("/metrics").text.splitlines()
                     if row.startswith(line)]
            return float(found[0].split()[1]) if found else None

        wait_for(lambda: exported() == 12, timeout=10, what="the gauge")
        r.delete(keys.pending(q))
        r.set(keys.pending(q), "not a hash")
        wait_for(lambda: "cannot refresh" in caplog.text, timeout=10, what="the warning")
        time.sleep(0.3)  # many refreshes, all refused
        assert exported() == 12 and caplog.text.count("cannot refresh") == 1
        r.delete(keys.pending(q))
        r.hset(keys.pending(q), keys.PENDING_TOTAL, "\u00b2")
        wait_for(lambda: exported() == 0, timeout=10, what="the hand-written sum read as 0")
        time.sleep(0.3)
        assert caplog.text.count("not a count") == 1, caplog.text
        r.set(keys.pending(q), "not a hash")
        wait_for(lambda: caplog.text.count("cannot refresh") == 2, timeout=10,
                 what="a new failure after one that worked, logged again")
    r.close()


def test_with_no_worker_the_gateway_exports_the_queues_pending_tokens_for_keda(
        redis_url, queue_name):
    with gateway(redis_url, queue_name, cold_start_s=0.2, timeout_s=0.5) as http:
        waited = http.post("/embed", json={"inputs": "a tenant's first"},
                           headers={"X-Tokenq-Tenant": "t"})
        assert waited.status_code == 503  # no worker came: but it was queued, as KEDA needs
        line = f'tokenq_queue_pending_tokens{{queue="{queue_name}"}}'

        def exported() -> float:
            found = [row for row in http.get("/metrics").text.splitlines()
                     if row.startswith(line)]
            return float(found[0].split()[1]) if found else 0.0

        wait_for(lambda: exported() > 0, timeout=15, what="the pending tokens gauge")
        q, r = keys.QueueRef(queue_name), redis.Redis.from_url(redis_url)
        assert exported() == int(r.hget(keys.pending(q), keys.PENDING_TOTAL))
        assert r.xlen(keys.tenant_requests(q, "t")) == 1  # a tenant's: not in XLEN(requests)
        r.close()
