"""``tokenq serve``: the OpenAI and TEI APIs over a queue, against real workers and Redis.

The real ``openai`` SDK and httpx talk to the gateway (in process through
FastAPI's TestClient, and once as the ``tokenq serve`` command on a port),
which talks to a real redis-server and sim workers. Vectors must equal the
sim's own, usage must equal the workers' exact token counts, and every
error status comes from a real condition: a body or batch too large, a
field that does not validate, an unknown model, a full queue, no worker, a
worker's failure, Redis down, a client that goes away.
"""

from __future__ import annotations

import base64
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.cli_support import DIM, MAX_INPUT
from tests.redis_server import free_port
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
        with pytest.raises(openai.UnprocessableEntityError, match="dimensions"):
            client.embeddings.create(model="m", input="x", dimensions=8)


def test_tei_embed_info_health_and_ready(sim_worker, redis_url, queue_name):
    with gateway(redis_url, queue_name) as http:
        not_ready = http.get("/ready")
        assert not_ready.status_code == 503 and queue_name in not_ready.json()["error"]
        assert http.get("/health").status_code == 200
        sim_worker()
        assert http.get("/ready").status_code == 200
        vectors = http.post("/embed", json={"inputs": TEXTS, "normalize": True})
        assert vectors.status_code == 200, vectors.text
        assert_vectors(vectors.json(), TEXTS)
        single = http.post("/embed", json={"inputs": "only one"})
        assert_vectors(single.json(), ["only one"])
        info = http.get("/info").json()
        assert info["model_id"] == "sim" and info["max_input_length"] == MAX_INPUT
        assert info["model_type"] == {"embedding": {}} and info["auto_truncate"] is True
        for refused, field in (({"inputs": "x", "prompt_name": "query"}, "prompt_name"),
                               ({"inputs": "x", "normalize": False}, "normalize"),
                               ({"inputs": "x", "truncate": False}, "truncate"),
                               ({"inputs": []}, "inputs")):
            answer = http.post("/embed", json=refused)
            assert answer.status_code == 422, (refused, answer.text)
            assert answer.json()["error_type"] == "Validation" and field in answer.json()["error"]
        metrics = http.get("/metrics").text
        assert 'tokenq_serve_requests_total{route="/embed",status="200"} 2.0' in metrics
        assert 'tokenq_serve_requests_total{route="/embed",status="422"} 4.0' in metrics


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
        empty = post({"model": "m", "input": "   "})
        assert empty.status_code == 422 and "empty" in empty.json()["error"]["message"]
        nobody = post({"model": "m", "input": "is anyone there?"})
        assert nobody.status_code == 504
        assert "no live worker serves queue" in nobody.json()["error"]["message"]
        sim_worker()
        failed = post({"model": "m", "input": [f"poison {SIM_FAIL_MARKER}"]})
        assert failed.status_code == 424 and failed.json()["error"]["code"] == "inference_failed"
        assert post({"model": "m", "input": ["fine"]}).status_code == 200


def test_a_full_queue_is_429_with_retry_after_and_an_unknown_model_404(redis_url, queue_name):
    with gateway(redis_url, queue_name, max_queue_length=1, models=f"small={queue_name}") as http:
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


def test_a_classifier_queue_refuses_embeddings_by_name(sim_worker, redis_url, queue_name):
    sim_worker("--backend", "tests.plugins_for_tests:sim_classifier")
    with gateway(redis_url, queue_name) as http:
        answer = http.post("/v1/embeddings", json={"model": "spam", "input": "buy now"})
    assert answer.status_code == 422
    assert answer.json()["error"]["code"] == "not_an_embedding_model"


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
