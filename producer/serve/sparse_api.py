"""TEI's ``POST /embed_sparse`` (a SPLADE queue's nonzero weights per input, else 424) and
``POST /embed_all`` (every token's vector: the option ``output: "tokens"``, 413 beyond
:data:`.bounds.MAX_TOKEN_ANSWER_FLOATS` in the worst case, checked before sending).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenq.producer import Result
from tokenq.producer.serve import openapi, render, schemas
from tokenq.producer.serve.bounds import (
    MAX_TOKEN_ANSWER_FLOATS,
    check_count,
    check_token_answer,
)
from tokenq.producer.serve.errors import ApiError, wrong_model
from tokenq.producer.serve.render import Answer, Raw, encode
from tokenq.producer.serve.schemas import (
    Body,
    Direction,
    Job,
    TEIInputs,
    parse,
)
from tokenq.shared.queue_config import QueueConfig

if TYPE_CHECKING:
    from tokenq.producer.serve.app import Gateway

SPARSE_TASK = "sparse"  # the ``task`` a sparse queue's workers publish in its config hash


class TEIPerToken(Body):
    """``POST /embed_sparse`` and ``/embed_all`` (TEI's ``EmbedSparseRequest`` and
    ``EmbedAllRequest``, which have the same fields)."""

    inputs: TEIInputs
    truncate: bool | None = None
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None
    model: str | None = None  # not TEI's: which of ``--models`` serves it (default: the first)


def sparse_request(raw: bytes) -> tuple[TEIPerToken, Job]:
    """``/embed_sparse``'s body and job (module level: bounds.Parser pickles it by name)."""
    return _request(raw, {})


def all_request(raw: bytes) -> tuple[TEIPerToken, Job]:
    """``/embed_all``'s body and job: the option ``output: tokens`` on every input."""
    return _request(raw, {"output": "tokens"})


def _request(raw: bytes, options: dict[str, Any]) -> tuple[TEIPerToken, Job]:
    """The body, and its job with ``options`` (:func:`.schemas.tei_job`)."""
    body = parse(TEIPerToken, raw)
    return body, schemas.tei_job(body, options)


def require_sparse(config: QueueConfig | None, model: str) -> None:
    """424 before anything is sent when the queue's config says it serves another kind."""
    if config is not None and config.task is not None and config.task != SPARSE_TASK:
        raise _not_sparse(model, config.task)


def sparse_answer(results: Sequence[Result], model: str) -> list[Raw]:
    """TEI's ``EmbedSparseResponse``: each input's nonzero ``{index, value}`` pairs, written
    straight to JSON; 413 beyond :data:`.bounds.MAX_TOKEN_ANSWER_FLOATS` weights in all."""
    for result in results:
        if result.sparse is None:
            raise _not_sparse(model, "embed" if result.embedding is not None else "score")
    check_count(sum(len(result.sparse or ()) for result in results), MAX_TOKEN_ANSWER_FLOATS,
                "nonzero weights", "inputs", "send fewer inputs")
    return [Raw(b"[" + b",".join(b'{"index":%d,"value":%s}' % (index, encode(float(value)))
                                 for index, value in result.sparse or ()) + b"]")
            for result in results]


def tokens_answer(results: Sequence[Result], model: str) -> list[list[array.array]]:
    """TEI's ``EmbedAllResponse``: each input's token vectors, in token order (render.encode
    writes each)."""
    answer = []
    for result in results:
        if result.token_embeddings is None:
            raise wrong_model("not_an_embedding_model",
                              f"model {model!r} answered no token embeddings")
        answer.append(list(result.token_embeddings))
    return answer


def _not_sparse(model: str, task: str) -> ApiError:
    return wrong_model(
        "not_a_sparse_model",
        f"model {model!r} is not a sparse (SPLADE) model (its queue serves task {task!r}): "
        "/embed_sparse needs a queue whose workers run --task sparse",
    )


async def embed_sparse(gateway: Gateway, answer: Answer, request: Request,
                       route: str = "/embed_sparse") -> Response:
    """``/embed_sparse``'s work; TEI's ``POST /`` on a sparse queue answers with it too."""
    async def work() -> render.Later:
        body, job = await gateway.read(request, sparse_request)
        queue = gateway.queue_of(body.model)
        model = body.model or gateway.default_model()
        require_sparse(await gateway.config(queue), model)
        return render.Later(sparse_answer, await gateway.infer(request, queue, job), model)
    return await answer(route, ApiError.tei_body, work, admit=True)


def router(gateway: Gateway, answer: Answer) -> APIRouter:
    """``/embed_sparse`` and ``/embed_all`` over ``gateway``, answered through ``answer``."""
    api = APIRouter()

    @api.post("/embed_sparse")
    async def sparse_route(request: Request) -> Response:
        return await embed_sparse(gateway, answer, request)

    @api.post("/embed_all")
    async def embed_all(request: Request) -> Response:
        async def work() -> render.Later:
            body, job = await gateway.read(request, all_request)
            queue = gateway.queue_of(body.model)
            model = body.model or gateway.default_model()
            config = await gateway.config(queue)
            schemas.require_embeddings(config, model)
            if config is not None:
                check_token_answer(len(job.items), config.max_input_tokens, config.token_dim,
                                   job.where)
            return render.Later(tokens_answer, await gateway.infer(request, queue, job), model)
        return await answer("/embed_all", ApiError.tei_body, work, admit=True)

    return api


openapi.describe_route("post", "/embed_sparse", TEIPerToken, list[list[openapi.SparseValue]],
                       summary="TEI: sparse (SPLADE) embeddings")
openapi.describe_route("post", "/embed_all", TEIPerToken, list[list[list[float]]],
                       summary="TEI: every token's embedding")
