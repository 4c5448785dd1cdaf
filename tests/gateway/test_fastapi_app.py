"""scripts/fastapi_app.py: a FastAPI backend enqueueing through AsyncClient to a real worker."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import numpy as np
import pytest

from tests.cli_support import DIM, MAX_INPUT
from tests.conftest import REPO_ROOT
from tokenq.shared.settings import ClientSettings
from tokenq.worker.backends.sim import SIM_FAIL_MARKER, expected_vector

pytest_plugins = ("tests.cli_fixtures",)

fastapi = pytest.importorskip("fastapi")
testclient = pytest.importorskip("fastapi.testclient")


def load_app_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "tokenq_fastapi_app", REPO_ROOT / "scripts" / "fastapi_app.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_post_embed_through_a_real_worker(sim_worker, redis_url, queue_name):
    sim_worker()
    app = load_app_module().create_app(ClientSettings(redis_url=redis_url, queue=queue_name))
    texts = ["the web process holds no model", "a GPU worker answers", "同じ順序で"]
    with testclient.TestClient(app) as http:
        response = http.post("/embed", json={"texts": texts})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["dim"] == DIM and len(body["embeddings"]) == 3
        for text, vector in zip(texts, body["embeddings"], strict=True):
            np.testing.assert_allclose(vector, expected_vector(text, DIM, MAX_INPUT), atol=1e-6)
        assert all(tokens > 0 for tokens in body["tokens"])

        assert http.post("/embed", json={"texts": []}).status_code == 422
        assert http.post("/embed", json={"texts": ["   "]}).status_code == 422
        failed = http.post("/embed", json={"texts": [f"bad {SIM_FAIL_MARKER}"]})
        assert failed.status_code == 502
        assert failed.json()["detail"]["code"] == "inference_failed"
        health = http.get("/healthz")
        assert health.status_code == 200 and health.json()["queue_length"] >= 0


def test_a_classifier_queue_is_refused_naming_why_not_answered_with_empty_vectors(
    sim_worker, redis_url, queue_name
):
    sim_worker("--backend", "tests.plugins_for_tests:sim_classifier")
    app = load_app_module().create_app(ClientSettings(redis_url=redis_url, queue=queue_name))
    with testclient.TestClient(app) as http:
        response = http.post("/embed", json={"texts": ["is this spam?"]})
    assert response.status_code == 409, response.text
    assert "answers scores" in response.json()["detail"] and queue_name in response.text


def test_redis_down_is_503(queue_name):
    app = load_app_module().create_app(ClientSettings(
        redis_url="redis://127.0.0.1:1/0", queue=queue_name, retries=0, socket_timeout_s=0.2,
    ))
    with testclient.TestClient(app) as http:
        response = http.post("/embed", json={"texts": ["x"], "timeout_s": 1})
        assert response.status_code == 503
