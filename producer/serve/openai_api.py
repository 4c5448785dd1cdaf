"""The OpenAI-style routes beside ``/v1/embeddings`` (``GET /v1/models``, the Cohere v1 and Jina
``POST /v1/rerank``) and Cohere's v2 ``POST /v2/rerank``, both TEI's ``/rerank`` underneath."""

from __future__ import annotations

import functools
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field, PlainValidator
from typing_extensions import NotRequired, TypedDict

from tokenq.producer.serve import schemas
from tokenq.producer.serve.bounds import kind
from tokenq.producer.serve.errors import empty, invalid
from tokenq.producer.serve.schemas import Body, Job, parse_job
from tokenq.producer.serve.tei_api import post

router = APIRouter()


def documents_only(value: Any) -> list[str]:
    """``documents``: strings or ``{"text": str}`` objects (Cohere's two spellings), as texts."""
    if type(value) is not list:
        raise invalid("documents", f"expected a list, got {kind(value)}")
    texts = []
    for index, item in enumerate(value):
        if type(item) is dict and type(item.get("text")) is str:
            item = item["text"]
        if type(item) is not str:
            raise invalid(f"documents[{index}]",
                          f"expected a string or {{\"text\": string}}, got {kind(item)}")
        texts.append(item)
    return texts


class TextObject(TypedDict):
    """A document as an object (Cohere v1, Jina): only ``text`` is read, other keys ignored."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    text: str


class RerankBody(Body):
    """What Cohere's v1 and v2 rerank bodies share (and Jina's); unknown fields refused, as
    on /v1/embeddings."""

    model_config = ConfigDict(extra="forbid", strict=True)

    query: str
    documents: Annotated[list[str], PlainValidator(
        documents_only, json_schema_input_type=list[str | TextObject])]
    top_n: Annotated[int, Field(ge=1)] | None = None


class Rerank(RerankBody):
    """``POST /v1/rerank`` (Cohere v1, Jina)."""

    return_documents: bool = False
    max_chunks_per_doc: Annotated[int, Field(ge=1)] | None = None  # accepted, unused: never split


def rerank_job(body: RerankBody) -> Job:
    if not body.documents:
        raise empty("documents")
    return Job([(body.query, text) for text in body.documents], {}, "documents")


rerank_request = functools.partial(parse_job, Rerank, rerank_job)


def ranked(body: RerankBody, results: list[Any], return_documents: bool = False
           ) -> list[dict[str, Any]]:
    """Cohere's ``results``: the best ``top_n`` documents, best first (ties in input order)."""
    ranks = schemas.rerank_answer(results, body.documents, return_documents)
    out = []
    for rank in ranks[:body.top_n]:
        entry: dict[str, Any] = {"index": rank["index"], "relevance_score": rank["score"]}
        if return_documents:
            entry["document"] = {"text": rank["text"]}
        out.append(entry)
    return out


def tokens_of(results: list[Any]) -> int:
    return sum(result.tokens or 0 for result in results)


def rerank_answer(results: list[Any], body: Rerank, model: str, *_: Any) -> dict[str, Any]:
    """Cohere's v1 answer, with OpenAI's ``object``, ``model`` and ``usage`` beside it."""
    tokens = tokens_of(results)
    return {"object": "list", "results": ranked(body, results, body.return_documents),
            "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def model_card(name: str) -> dict[str, Any]:
    # ``created``: the gateway does not know when a model was made
    return {"id": name, "object": "model", "created": 0, "owned_by": "tokenq"}


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    gateway = request.app.state.gateway

    async def work() -> dict[str, Any]:
        names = list(gateway.models) or [gateway.default_model()]
        return {"object": "list", "data": [model_card(name) for name in names]}
    return await gateway.answer("/v1/models", work)


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str) -> Response:
    gateway = request.app.state.gateway

    async def work() -> dict[str, Any]:
        gateway.queue_of(model)  # 404 for a name --models does not list; without it any
        return model_card(model)  # name is served by --queue, as /v1/embeddings takes it
    return await gateway.answer("/v1/models/{model}", work)


class RelevantSpans(TypedDict):
    """Cohere's ``relevant_spans``; only ``mode: "disabled"`` is served."""

    mode: Literal["enabled", "disabled"]
    threshold: NotRequired[float]
    max_spans: NotRequired[int]


class RerankV2(RerankBody):
    """``POST /v2/rerank``."""

    max_tokens_per_doc: Annotated[int, Field(ge=1)] | None = None  # accepted; --policy decides
    relevant_spans: RelevantSpans | None = None
    priority: Annotated[int, Field(ge=0)] | None = None  # accepted, unused: not tokenq's classes


def rerank_v2_job(body: RerankV2) -> Job:
    """:func:`rerank_job`; ``relevant_spans`` are not served."""
    if body.relevant_spans is not None and body.relevant_spans["mode"] == "enabled":
        raise invalid("relevant_spans", "not served: a cross-encoder scores whole documents "
                      "and finds no spans; leave it out or send mode 'disabled'")
    return rerank_job(body)


rerank_v2_request = functools.partial(parse_job, RerankV2, rerank_v2_job)


def rerank_v2_answer(results: list[Any], body: RerankV2, *_: Any) -> dict[str, Any]:
    """Cohere's v2 answer (``model`` is not part of it)."""
    return {"id": str(uuid.uuid4()), "results": ranked(body, results), "meta": {
        "api_version": {"version": "2"},
        "billed_units": {"input_tokens": tokens_of(results)}}}


for path in ("/v1/embeddings", "/embeddings"):  # the second: Infinity's
    post(router, path, schemas.openai_request, schemas.require_embeddings,
         schemas.openai_answer, schemas.truncation_headers)
post(router, "/v1/rerank", rerank_request, schemas.require_reranker, rerank_answer)
post(router, "/v2/rerank", rerank_v2_request, schemas.require_reranker, rerank_v2_answer)
