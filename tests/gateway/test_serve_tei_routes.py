"""TEI's ``POST /``, ``/similarity``, ``/tokenize``, ``/decode``, ``GET /`` and
``/ping`` against sim workers (fast); the hf model's numbers, the tokenizer's own ids and each
kind of queue are in tests/gateway/test_serve_hf_client.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.cli_support import DIM, MAX_INPUT
from tests.redis_server import free_port
from tokenq.producer.serve.tei_api import cosine
from tokenq.shared.settings import ServeSettings
from tokenq.worker.backends.sim import expected_vector

pytest_plugins = ("tests.cli_fixtures",)

testclient = pytest.importorskip("fastapi.testclient")
from tokenq.producer.serve.app import create_app  # noqa: E402  (after the skips)

SOURCE = "the gateway holds no model"
SENTENCES = ["a GPU worker answers", "the gateway holds no model", "同じ順序で答える"]


def gateway(redis_url: str, queue: str, **settings) -> testclient.TestClient:
    return testclient.TestClient(create_app(ServeSettings(redis_url=redis_url, queue=queue,
                                                          **settings)))


def expected_similarities() -> list[float]:
    source = expected_vector(SOURCE, DIM, MAX_INPUT)
    return [cosine(source, expected_vector(text, DIM, MAX_INPUT)) for text in SENTENCES]


def test_similarity_and_post_root_on_an_embedder(sim_worker, redis_url, queue_name):
    sim_worker()
    body = {"inputs": {"source_sentence": SOURCE, "sentences": SENTENCES}}
    with gateway(redis_url, queue_name) as http:
        for route in ("/similarity", "/"):
            answer = http.post(route, json=body)
            assert answer.status_code == 200, answer.text
            np.testing.assert_allclose(answer.json(), expected_similarities(), atol=1e-6)
            assert answer.json()[1] == pytest.approx(1.0)
        embedded = http.post("/", json={"inputs": SENTENCES})
        assert embedded.json() == http.post("/embed", json={"inputs": SENTENCES}).json()
        empty = http.post("/similarity", json={"inputs": {"source_sentence": "a",
                                                          "sentences": []}})
        assert empty.status_code == 400 and empty.json()["error_type"] == "Empty"
        for bad in ({"inputs": {"source_sentence": "a"}}, {"inputs": "a"},
                    {"inputs": {"source_sentence": "a", "sentences": ["b"]},
                     "parameters": {"truncation_direction": "Left"}}):
            refused = http.post("/similarity", json=bad)
            assert refused.status_code == 422, (bad, refused.text)
            assert refused.json()["error_type"] == "Validation"
        for path in ("/", "/ping"):
            health = http.get(path)
            assert health.status_code == 200 and health.json()["status"] == "ok"


def test_tokenize_without_a_tokenizer_says_why_and_decode_checks_ids(
    sim_worker, redis_url, queue_name
):
    sim_worker()
    with gateway(redis_url, queue_name, max_client_batch_size=2) as http:
        refused = http.post("/tokenize", json={"inputs": "hello"})
        assert refused.status_code == 422 and "tokenizer" in refused.json()["error"]
        assert http.post("/tokenize", json={"inputs": []}).status_code == 400
        too_many = http.post("/tokenize", json={"inputs": ["a", "b", "c"]})
        assert too_many.status_code == 413, too_many.text
        for bad in ({"ids": [-1]}, {"ids": [2**32]}, {"ids": "1"}, {"ids": [1.5]}, {}):
            answer = http.post("/decode", json=bad)
            assert answer.status_code == 422, (bad, answer.text)
        assert http.post("/decode", json={"ids": [[1], [2], [3]]}).status_code == 413


def test_post_root_is_refused_like_embed_when_redis_is_down():
    url = f"redis://127.0.0.1:{free_port()}"  # nothing listens
    with gateway(url, "q", timeout_s=30) as http:
        started = time.monotonic()
        root = http.post("/", json={"inputs": "a"})
        assert root.status_code == 503 and root.json()["error_type"] == "Unhealthy"
        assert time.monotonic() - started < 2
