"""Cohere's SDK against ``tokenq serve``, and every unknown path in its API family's shape.

``cohere.Client`` (v1, ``POST /v1/rerank``) and ``cohere.ClientV2`` (v2,
``POST /v2/rerank``) run docs/MIGRATING.md's block against a gateway
process with ``--api-key`` (the SDK's ``Authorization: Bearer``) and a sim
reranker worker; both get the ranks and scores ``/v1/rerank`` answers. Then
404s and 405s: OpenAI's shape under ``/v1/``, Cohere's under ``/v2/``,
TEI's elsewhere, each as that API's client reads it.
"""

from __future__ import annotations

import httpx
import pytest

from tests.serve_process import DOC_URL, run_migrating_code, start_gateway
from tokenq.shared.settings import ServeSettings

pytest_plugins = ("tests.cli_fixtures",)

cohere = pytest.importorskip("cohere")
openai = pytest.importorskip("openai")
testclient = pytest.importorskip("fastapi.testclient")
from tokenq.producer.serve.app import create_app  # noqa: E402  (after the skips)

KEY = "s3cret"
QUERY = "what holds the model?"
DOCUMENTS = ["The worker holds the model.", "Redis holds the queue.", "Bananas are yellow."]


@pytest.fixture
def reranker(sim_worker, redis_url, queue_name, spawn, tmp_path) -> str:
    """A gateway process with ``--api-key`` over a sim reranker: its URL. Two scores a pair,
    so the first (the one ranked) differs between documents; with one it is always 1 or -1."""
    sim_worker("--backend", "tests.plugins_for_tests:sim_reranker", "--sim-dim", "2")
    return start_gateway(spawn, redis_url, queue_name, tmp_path / "serve.log",
                         "--api-key", KEY, "--timeout-s", "30")


def v1_route(url: str, **body) -> dict:
    answer = httpx.post(f"{url}/v1/rerank", headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": "reranker", "query": QUERY, "documents": DOCUMENTS,
                              **body}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_both_cohere_clients_rank_as_the_rerank_route(reranker):
    # docs/MIGRATING.md, "Cohere SDK", with this gateway's URL and key
    names = run_migrating_code("Cohere SDK", {DOC_URL: reranker, '"unused"': f'"{KEY}"'})
    assert names["documents"] == DOCUMENTS and names["query"] == QUERY
    expected = v1_route(reranker, top_n=2, return_documents=True)
    everything = v1_route(reranker)["results"]
    assert [r["relevance_score"] for r in everything] == sorted(
        (r["relevance_score"] for r in everything), reverse=True)
    assert len(set(r["relevance_score"] for r in everything)) == len(DOCUMENTS)
    assert [(r["index"], r["relevance_score"]) for r in expected["results"]] == [
        (r["index"], r["relevance_score"]) for r in everything[:2]]  # top_n keeps the best
    v1, v2 = names["ranked_v1"], names["ranked_v2"]
    assert [(r.index, r.relevance_score) for r in v1.results] == [
        (r["index"], r["relevance_score"]) for r in expected["results"]]
    assert [r.document.text for r in v1.results] == [
        DOCUMENTS[r["index"]] for r in expected["results"]]
    assert [(r.index, r.relevance_score) for r in v2.results] == [
        (r["index"], r["relevance_score"]) for r in expected["results"]]
    assert v2.id and v2.meta.api_version.version == "2"
    assert v2.meta.billed_units.input_tokens == expected["usage"]["prompt_tokens"] > 0


def test_cohere_v2_errors_are_cohere_shaped_and_raised_by_status(reranker):
    v2 = cohere.ClientV2(base_url=reranker, api_key=KEY)
    with pytest.raises(cohere.errors.BadRequestError) as empty:
        v2.rerank(model="reranker", query=QUERY, documents=[])
    assert empty.value.body == {"message": "documents: cannot be empty"}
    with pytest.raises(cohere.errors.UnprocessableEntityError) as spans:
        v2.rerank(model="reranker", query=QUERY, documents=DOCUMENTS,
                  relevant_spans=cohere.RerankRelevantSpans(mode="enabled"))
    assert spans.value.body["message"].startswith("relevant_spans: not served")
    unused = v2.rerank(model="reranker", query=QUERY, documents=DOCUMENTS,
                       max_tokens_per_doc=8, priority=3, top_n=1)
    assert [(r.index, r.relevance_score) for r in unused.results] == [
        (r["index"], r["relevance_score"]) for r in v1_route(reranker, top_n=1)["results"]]
    with pytest.raises(cohere.errors.UnauthorizedError) as v2_key:
        cohere.ClientV2(base_url=reranker, api_key="wrong").rerank(
            model="reranker", query=QUERY, documents=DOCUMENTS)
    assert "API key" in v2_key.value.body["message"]
    with pytest.raises(cohere.errors.UnauthorizedError) as v1_key:
        cohere.Client(base_url=reranker, api_key="wrong").rerank(
            model="reranker", query=QUERY, documents=DOCUMENTS)
    assert v1_key.value.body["error"]["code"] == "invalid_api_key"  # OpenAI's shape
    with pytest.raises(cohere.errors.NotFoundError) as unknown:
        cohere.ClientV2(base_url=reranker, api_key=KEY).embed(
            model="reranker", texts=["x"], input_type="search_query",
            embedding_types=["float"])
    assert unknown.value.body["message"].startswith("Invalid URL (POST /v2/embed)")


def openai_shaped(body: dict) -> str:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["message"]


def cohere_shaped(body: dict) -> str:
    assert set(body) == {"message"}
    return body["message"]


def tei_shaped(body: dict) -> str:
    assert set(body) == {"error", "error_type"} and body["error_type"] == "Validation"
    return body["error"]


@pytest.mark.parametrize(("method", "path", "status", "shaped"), [
    ("POST", "/v1/completions", 404, openai_shaped),
    ("GET", "/v1/rerank", 405, openai_shaped),
    ("DELETE", "/v1/models", 405, openai_shaped),
    ("POST", "/v2/embed", 404, cohere_shaped),
    ("GET", "/v2/rerank", 405, cohere_shaped),
    ("POST", "/v3/rerank", 404, tei_shaped),
    ("GET", "/nowhere", 404, tei_shaped),
    ("PUT", "/embed", 405, tei_shaped),
])
def test_unknown_paths_and_methods_answer_in_their_familys_shape(
    redis_url, queue_name, method, path, status, shaped
):
    app = create_app(ServeSettings(redis_url=redis_url, queue=queue_name))
    with testclient.TestClient(app) as http:
        answer = http.request(method, path, json={})
    assert answer.status_code == status, answer.text
    message = shaped(answer.json())
    assert method in message and path in message
    if status == 405:
        assert answer.headers["Allow"] in message


def test_the_openai_sdk_raises_not_found_for_an_unknown_route(redis_url, queue_name):
    app = create_app(ServeSettings(redis_url=redis_url, queue=queue_name))
    with testclient.TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                               http_client=http, max_retries=0)
        with pytest.raises(openai.NotFoundError, match=r"Invalid URL \(POST /v1/completions\)"):
            client.completions.create(model="m", prompt="x")
