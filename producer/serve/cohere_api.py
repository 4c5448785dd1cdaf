"""Cohere's v2 API: ``POST /v2/rerank``, ``cohere.ClientV2``'s rerank, over ``/v1/rerank``'s work
(:func:`.openai_api.serve_rerank`), with Cohere's v2 shapes and error bodies.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field
from typing_extensions import NotRequired, TypedDict

from tokenq.producer.serve import openapi
from tokenq.producer.serve.errors import ApiError, invalid
from tokenq.producer.serve.openai_api import RerankBody, ranked, rerank_job, serve_rerank, tokens_of
from tokenq.producer.serve.schemas import Job, parse

router = APIRouter()

API_VERSION = "2"
"""``meta.api_version.version`` of every answer."""


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


def rerank_v2_request(raw: bytes) -> tuple[RerankV2, Job]:
    """The body and its job (module level: bounds.Parser pickles it by name)."""
    body = parse(RerankV2, raw)
    if body.relevant_spans is not None and body.relevant_spans["mode"] == "enabled":
        raise invalid("relevant_spans", "not served: a cross-encoder scores whole documents "
                      "and finds no spans; leave it out or send mode 'disabled'")
    return body, rerank_job(body)


def rerank_v2_answer(body: RerankV2, model: str, results: list[Any]) -> dict[str, Any]:
    """Cohere's v2 answer (``model`` is not part of it)."""
    return {"id": str(uuid.uuid4()), "results": ranked(body, results), "meta": {
        "api_version": {"version": API_VERSION},
        "billed_units": {"input_tokens": tokens_of(results)}}}


@router.post("/v2/rerank")
async def rerank_v2(request: Request) -> Response:
    return await serve_rerank(request, "/v2/rerank", rerank_v2_request, rerank_v2_answer,
                              ApiError.cohere_body)


openapi.describe_route("post", "/v2/rerank", RerankV2, openapi.RerankV2Answer,
                       openapi.CohereError, "Cohere v2 rerank")
