"""TEI's ``POST /embed_sparse`` (a SPLADE queue's nonzero weights per input, else 424) and
``POST /embed_all`` (every token's vector: the option ``output: "tokens"``, 413 beyond
:data:`.bounds.MAX_TOKEN_ANSWER_FLOATS` in the worst case, checked before sending).
"""

from __future__ import annotations

import array
import functools
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenq.producer import Result
from tokenq.producer.serve import render, schemas
from tokenq.producer.serve.bounds import (
    MAX_TOKEN_ANSWER_FLOATS,
    check_count,
    check_token_answer,
)
from tokenq.producer.serve.errors import ApiError, wrong_model
from tokenq.producer.serve.render import Raw, encode
from tokenq.producer.serve.schemas import Job, TEIPerToken, parse_job
from tokenq.shared.queue_config import QueueConfig

SPARSE_TASK = "sparse"  # the ``task`` a sparse queue's workers publish in its config hash

sparse_request = functools.partial(parse_job, TEIPerToken,
                                   functools.partial(schemas.tei_job, options={}))
all_request = functools.partial(parse_job, TEIPerToken, functools.partial(
    schemas.tei_job, options={"output": "tokens"}))  # every token's vector


def require_sparse(config: QueueConfig | None, model: str, *_: Any) -> None:
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


def _tokens_fit(config: QueueConfig | None, model: str, job: Job) -> None:
    """Embeddings, and at most :data:`.bounds.MAX_TOKEN_ANSWER_FLOATS` in the worst case."""
    schemas.require_embeddings(config, model)
    if config is not None:
        check_token_answer(len(job.items), config.max_input_tokens, config.token_dim, job.where)


router = APIRouter()


async def embed_sparse(request: Request, route: str) -> Response:
    """``/embed_sparse``; TEI's ``POST /`` on a sparse queue answers with it too."""
    return await request.app.state.gateway.serve(
        request, route, sparse_request, require_sparse,
        lambda results, body, model, config: render.Later(sparse_answer, results, model))


@router.post("/embed_sparse")
async def sparse_route(request: Request) -> Response:
    return await embed_sparse(request, "/embed_sparse")


@router.post("/embed_all")
async def embed_all(request: Request) -> Response:
    return await request.app.state.gateway.serve(
        request, "/embed_all", all_request, _tokens_fit,
        lambda results, body, model, config: render.Later(tokens_answer, results, model))

