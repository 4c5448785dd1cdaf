"""The gateway's ``/openapi.json`` and ``/docs``: the routes read their own bodies, so each is
described in :data:`ROUTES` by the pydantic models that parse it, merged into FastAPI's."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from pydantic import TypeAdapter
from typing_extensions import NotRequired, TypedDict

from tokenq.producer.serve import openai_api, schemas, tei_api
from tokenq.producer.serve.errors import ApiError, body_for

ERROR_STATUSES = {
    400: "the batch is empty, or the body is not JSON",
    401: "no or a wrong API key (--api-key)",
    404: "an unknown model name (or path)",
    408: "the body was not received within --timeout-s",
    413: "the body or the batch is too large",
    415: "the body is not JSON",
    422: "a field does not validate, or the queue cannot serve it as asked",
    424: "the model failed, or the queue's model is not of the kind the route needs",
    429: "overloaded: too many requests in flight, or the queue is full",
    503: "Redis is unreachable, or no worker serves the queue",
    504: "no answer within --timeout-s",
}
"""Every status a route may answer besides 200 (errors.py decides which, for what)."""


class TEIError(TypedDict):
    """TEI's ``ErrorResponse``."""

    error: str
    error_type: Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]


class OpenAIErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(TypedDict):
    """OpenAI's error body."""

    error: OpenAIErrorDetail


class CohereError(TypedDict):
    """Cohere's error body (its v2 API)."""

    message: str


ERROR_BODIES: dict[Any, type] = {ApiError.openai_body: OpenAIError,
                                  ApiError.cohere_body: CohereError,
                                  ApiError.tei_body: TEIError}
"""Each error shape's schema, by the ApiError method that writes it."""


class Rank(TypedDict, total=False):
    index: int
    score: float
    text: str


class Prediction(TypedDict):
    label: str
    score: float


class SimpleToken(TypedDict):
    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class SparseValue(TypedDict):
    index: int
    value: float


class OpenAIEmbedding(TypedDict):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class OpenAIUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingList(TypedDict):
    """OpenAI's answer (named apart from the request's model, ``OpenAIEmbeddings``)."""

    object: Literal["list"]
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


class RerankResult(TypedDict):
    """One of Cohere's ``results``: ``document`` only with ``return_documents``."""

    index: int
    relevance_score: float
    document: NotRequired[openai_api.TextObject]


class RerankList(TypedDict):
    """``POST /v1/rerank``'s answer: Cohere's ``results`` (best first), as Jina's clients read
    them too."""

    object: Literal["list"]
    results: list[RerankResult]
    model: str
    usage: OpenAIUsage


class CohereVersion(TypedDict):
    version: str


class CohereBilled(TypedDict):
    input_tokens: int


class CohereMeta(TypedDict):
    api_version: CohereVersion
    billed_units: CohereBilled


class RerankV2Answer(TypedDict):
    """``POST /v2/rerank``'s answer: Cohere's ``V2RerankResponse``, best first."""

    id: str
    results: list[RerankResult]  # never with ``document``
    meta: CohereMeta


class ModelCard(TypedDict):
    """OpenAI's ``Model``."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(TypedDict):
    """``GET /v1/models``' answer."""

    object: Literal["list"]
    data: list[ModelCard]


Embeddings = list[list[float]]
Predictions = list[Prediction] | list[list[Prediction]]


Route = tuple[Any, Any, str]
"""A route's body (its pydantic model or a union; None for a GET), its 200 answer's type, and
its summary; its errors are those of its path's family."""

_OPENAI: Route = (schemas.OpenAIEmbeddings, OpenAIEmbeddingList,
                  "OpenAI (and Infinity): embeddings")
ROUTES: dict[tuple[str, str], Route] = {
    ("post", "/embed"): (schemas.TEIEmbed, Embeddings, "TEI: embeddings"),
    ("post", "/rerank"): (schemas.TEIRerank, list[Rank], "TEI: rerank texts against a query"),
    ("post", "/predict"): (schemas.TEIPredict, Predictions, "TEI: classify"),
    ("post", "/similarity"): (tei_api.TEISimilarity, list[float],
                              "TEI: cosine of a sentence with others"),
    ("post", "/tokenize"): (tei_api.TEITokenize, list[list[SimpleToken]],
                            "TEI: the queue's tokenizer"),
    ("post", "/decode"): (tei_api.TEIDecode, list[str], "TEI: ids back to text"),
    ("post", "/"): (
        schemas.TEIEmbed | tei_api.TEISimilarity | schemas.TEIPredict | schemas.TEIRerank,
        Embeddings | list[float] | Predictions | list[Rank],
        "TEI: the route of the model's kind (embed or similarity, predict, rerank)"),
    ("post", "/embed_sparse"): (schemas.TEIPerToken, list[list[SparseValue]],
                                "TEI: sparse (SPLADE) embeddings"),
    ("post", "/embed_all"): (schemas.TEIPerToken, list[list[list[float]]],
                             "TEI: every token's embedding"),
    ("post", "/v1/embeddings"): _OPENAI,
    ("post", "/embeddings"): _OPENAI,
    ("post", "/v1/rerank"): (openai_api.Rerank, RerankList, "Cohere/Jina-style rerank"),
    ("post", "/v2/rerank"): (openai_api.RerankV2, RerankV2Answer, "Cohere v2 rerank"),
    ("get", "/v1/models"): (None, ModelList, "OpenAI: the models served"),
    ("get", "/v1/models/{model}"): (None, ModelCard, "OpenAI: one model"),
    ("get", "/info"): (None, dict[str, Any], "TEI: the model and the gateway's limits"),
    ("get", "/health"): (None, dict[str, Any], "200 while Redis answers"),
    ("get", "/"): (None, dict[str, Any], "TEI's health alias"),
    ("get", "/ping"): (None, dict[str, Any], "TEI's (SageMaker's) health alias"),
    ("get", "/ready"): (None, dict[str, Any], "200 while every queue has a live worker"),
    ("get", "/livez"): (None, dict[str, Any], "the worker's name for /health"),
    ("get", "/readyz"): (None, dict[str, Any], "the worker's name for /ready"),
}
"""Each described route by (method, path)."""

GET_STATUSES = {"/v1/models/{model}": (401, 404, 503)}
"""A GET's error statuses where not just (401, 503); a POST's are all of ERROR_STATUSES."""


def describe(app: FastAPI) -> None:
    """Serve the complete document at ``/openapi.json`` and Swagger UI at ``/docs``."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # GET / and POST / are one route: ids set below
                warnings.filterwarnings("ignore", "Duplicate Operation ID")
                spec = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                   description="tokenq serve: TEI's and OpenAI's APIs over a "
                                               "queue")
            _complete(spec)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]

    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} docs")

    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)


def _complete(spec: dict[str, Any]) -> None:
    components: dict[str, Any] = spec.setdefault("components", {}).setdefault("schemas", {})
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            name = path.strip("/").replace("/", "_").replace("{", "").replace("}", "")
            operation["operationId"] = f"{method}_{name or 'root'}"
            if path == "/metrics":
                operation["responses"] = {"200": {
                    "description": "Prometheus text",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}
                continue
            body, answer, operation["summary"] = ROUTES[(method, path)]  # missing: a test fails
            operation["responses"] = {"200": _content("the answer", answer, components)}
            if body is not None:
                operation["requestBody"] = {"required": True,
                                            **_content("the body", body, components)}
            error = ERROR_BODIES[body_for(path)]
            for status in ERROR_STATUSES if method == "post" else GET_STATUSES.get(
                    path, (401, 503)):
                operation["responses"][str(status)] = _content(
                    ERROR_STATUSES[status], error, components)


def _content(description: str, kind: Any, components: dict[str, Any]) -> dict[str, Any]:
    """A JSON ``content`` entry for ``kind``, its named parts moved into ``components``."""
    schema = TypeAdapter(kind).json_schema(ref_template="#/components/schemas/{model}")
    definitions: dict[str, Any] = schema.pop("$defs", {})
    if "title" in schema and schema.get("type") == "object":
        definitions[schema["title"]] = schema
        schema = {"$ref": f"#/components/schemas/{schema['title']}"}
    for name, definition in definitions.items():
        if components.setdefault(name, definition) != definition:  # two types, one name: a bug
            raise ValueError(f"two schemas are named {name!r}")
    return {"description": description, "content": {"application/json": {"schema": schema}}}
