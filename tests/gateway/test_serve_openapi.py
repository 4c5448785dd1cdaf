"""The gateway's ``/openapi.json`` is complete, ``/docs`` answers, and
schemathesis finds no 5xx or schema violation, against tokenq's own document (``--checks all``)
and against TEI's published spec (tests/data/tei_openapi.json) on the routes an embedder queue
serves (sim workers). The classifier and reranker kinds, and the tokenizer routes with a real
tokenizer, are checked against TEI's spec in tests/gateway/test_serve_hf_client.py (hf workers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serve_process import TEI_CHECKS, TEI_SPEC, schemathesis, start_gateway
from tokenq.shared.settings import ServeSettings

pytest_plugins = ("tests.cli_fixtures",)

testclient = pytest.importorskip("fastapi.testclient")
pytest.importorskip("schemathesis")
from tokenq.producer.serve.app import create_app  # noqa: E402  (after the skips)
from tokenq.producer.serve.errors import body_for  # noqa: E402
from tokenq.producer.serve.openapi import ERROR_BODIES  # noqa: E402

EMBEDDER_ROUTES = ("/embed", "/similarity", "/tokenize", "/decode", "/", "/info", "/health",
                   "/metrics", "/embed_all")
"""TEI's routes an embedder queue answers (``/embed_all`` where the gateway has it)."""


def document(redis_url: str = "redis://127.0.0.1:1") -> dict:
    app = create_app(ServeSettings(redis_url=redis_url, queue="q"))
    return testclient.TestClient(app).get("/openapi.json").json()


@pytest.mark.unit
def test_every_route_declares_its_body_its_answer_and_its_errors():
    spec = document()
    assert spec["paths"], spec
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            where = f"{method.upper()} {path}"
            if path == "/metrics":
                assert list(responses["200"]["content"]) == ["text/plain"], where
                continue
            ok = responses["200"]["content"]["application/json"]["schema"]
            assert ok, f"{where}: the 200 answer has no schema"
            assert {"503"} <= set(responses), where
            if method == "post":
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                assert body, f"{where}: no request schema"
                assert {"400", "413", "422", "424", "429", "503", "504"} <= set(responses), where
            for status, response in responses.items():
                if status != "200":
                    schema = response["content"]["application/json"]["schema"]
                    family = ERROR_BODIES[body_for(path)].__name__  # by the path's prefix
                    assert schema.get("$ref", "") == f"#/components/schemas/{family}", where
    schemas = spec["components"]["schemas"]
    assert schemas["TEIError"]["required"] == ["error", "error_type"]
    assert set(schemas["OpenAIErrorDetail"]["required"]) == {"message", "type", "param", "code"}
    assert schemas["CohereError"]["required"] == ["message"]
    assert schemas["TEIEmbed"]["properties"]["inputs"].get("anyOf"), "inputs has no shape"


@pytest.mark.unit
def test_docs_answers_swagger_ui():
    app = create_app(ServeSettings(redis_url="redis://127.0.0.1:1", queue="q"))
    docs = testclient.TestClient(app).get("/docs")
    assert docs.status_code == 200
    assert docs.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in docs.text and "swagger" in docs.text.lower()


@pytest.fixture
def sim_gateway(sim_worker, redis_url, queue_name, spawn, tmp_path) -> str:
    sim_worker()
    return start_gateway(spawn, redis_url, queue_name, tmp_path / "serve.log")


def test_schemathesis_finds_nothing_against_tokenqs_own_document(sim_gateway, tmp_path: Path):
    run = schemathesis(f"{sim_gateway}/openapi.json", sim_gateway, tmp_path, "--checks", "all")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout, run.stdout[-2000:]


def test_schemathesis_finds_nothing_against_teis_spec_on_an_embedder(sim_gateway, tmp_path):
    """``/v1/embeddings`` is left out: tokenq answers OpenAI's error body there, which the
    OpenAI SDK parses; TEI's spec gives its own (``{message, code, error_type}``)."""
    served = set(document()["paths"])
    include = [arg for path in EMBEDDER_ROUTES if path in served
               for arg in ("--include-path", path)]
    run = schemathesis(str(TEI_SPEC), sim_gateway, tmp_path, "--checks", TEI_CHECKS, *include)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout, run.stdout[-2000:]
