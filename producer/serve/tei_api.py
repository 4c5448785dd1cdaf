"""TEI's router (its ``docs/openapi.json`` the contract, 0037-tei-routes-and-openapi.md): the
routes that send a job, ``POST /`` by the model's kind, /tokenize and /decode."""

from __future__ import annotations

import array
import asyncio
import functools
import math
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, PlainValidator

from tokenq.producer import Result
from tokenq.producer.serve import render, schemas
from tokenq.producer.serve.bounds import (
    MAX_DECODE_BYTES,
    MAX_TOKEN_ANSWER_FLOATS,
    MAX_TOKENIZE_BYTES,
    MAX_TOKENIZE_TOKENS,
    TEXT,
    TOKEN,
    TOKENS,
    check_count,
    check_token_answer,
    decode_json,
    text_bytes,
    text_or_list,
)
from tokenq.producer.serve.errors import ApiError, empty, invalid, wrong_model
from tokenq.producer.serve.render import Raw, encode
from tokenq.producer.serve.schemas import (
    Body,
    Direction,
    Job,
    TEIPerToken,
    given,
    one_kind,
    parse,
    parse_job,
)
from tokenq.producer.tokenizer import load_estimator
from tokenq.shared.queue_config import QueueConfig

if TYPE_CHECKING:
    from tokenq.producer.serve.app import Gateway

MAX_TOKEN_ID = 2**32 - 1
"""TEI's ids are ``uint32``; a larger (or negative) one is a 422, not the tokenizer's overflow."""


class SimilarityInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(BaseModel):
    prompt_name: str | None = None
    truncate: bool | None = None
    truncation_direction: Direction = "Right"


class TEISimilarity(Body):
    """``POST /similarity`` (and ``POST /`` on an embedder, ``inputs`` an object)."""

    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


def _ids(value: Any) -> Any:
    if type(value) is str:
        raise invalid("ids", "expected a list of token ids or a list of such lists")
    ids = text_or_list(value, "ids", (TOKEN, TOKENS))
    rows = ids if ids and type(ids[0]) is list else [ids]
    if any(not 0 <= token <= MAX_TOKEN_ID for row in rows for token in row):
        raise invalid("ids", f"a token id is outside 0..{MAX_TOKEN_ID}")
    return ids


class TEITokenize(Body):
    """``POST /tokenize``."""

    inputs: Annotated[str | list[str], one_kind("inputs", TEXT, shape=str | list[str])]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class TEIDecode(Body):
    """``POST /decode``."""

    ids: Annotated[list[int] | list[list[int]],
                   PlainValidator(_ids, json_schema_input_type=list[Annotated[int, Field(ge=0)]]
                                  | list[list[Annotated[int, Field(ge=0)]]])]
    skip_special_tokens: bool = True


tokenize_request = functools.partial(parse, TEITokenize)
decode_request = functools.partial(parse, TEIDecode)


def similarity_job(body: TEISimilarity) -> Job:
    if not body.inputs.sentences:
        raise empty("inputs.sentences")
    parameters = body.parameters or SimilarityParameters()
    options = given(truncate=parameters.truncate, prompt_name=parameters.prompt_name)
    items = [body.inputs.source_sentence, *body.inputs.sentences]
    return Job(items, options, "inputs")  # type: ignore[arg-type]


similarity_request = functools.partial(parse_job, TEISimilarity, similarity_job)


def root_embed_request(raw: bytes) -> tuple[Any, Job]:
    """``POST /`` on an embedder: a similarity body when ``inputs`` is an object, else
    ``/embed``'s."""
    document = decode_json(raw)
    if isinstance(document.get("inputs"), dict):
        return similarity_request(raw)
    return schemas.tei_embed_request(raw)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of two vectors; 0 when either is all zeros (TEI answers a number, never NaN)."""
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    if norms == 0.0:
        return 0.0
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norms


def tokenize_answer(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[Raw]:
    """Each text's ``SimpleToken`` list; a 413 beyond :data:`.bounds.MAX_TOKENIZE_TOKENS`."""
    count_tokens(tokenizer, texts, add_special_tokens)
    encodings = tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
    check_count(sum(map(len, encodings)), MAX_TOKENIZE_TOKENS, "tokens", "inputs",
                "send fewer or shorter texts")
    encodings.reverse()  # each encoding is let go once its records are written
    return [token_answer(encodings.pop(), text) for text in texts]


PIECE = 1 << 14  # most characters ``count_tokens`` encodes at once (at most 64 KiB of UTF-8)

CUT_SLACK = 16
"""Tokens a cut may add to the whole text's count (a split word, a stripped space): forgiven."""

_BEFORE_SPACE = re.compile(r"\s(?=\S)")


def _pieces(text: str) -> Iterator[str]:
    """``text`` in pieces of at most :data:`PIECE` characters, each cut just before a run of
    whitespace where one starts in the piece's second half."""
    start = 0
    while len(text) - start > PIECE:
        window = text[start + PIECE // 2:start + PIECE]
        found = _BEFORE_SPACE.search(window[::-1])  # the last run's first whitespace
        stop = start + PIECE - (found.start() + 1 if found else 0)
        yield text[start:stop]
        start = stop
    yield text[start:]


def count_tokens(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> None:
    """413 as soon as ``texts`` surely pass :data:`.bounds.MAX_TOKENIZE_TOKENS`, counted a
    group of pieces at a time, so a request far over is refused without all its encodings
    (each cut forgives :data:`CUT_SLACK`; what passes is counted exactly after)."""
    count = len(texts) * tokenizer.num_special_tokens_to_add(False) if add_special_tokens else 0
    cuts = 0
    group: list[str] = []
    size = 0
    for text in texts:
        for index, piece in enumerate(_pieces(text)):
            cuts += index > 0
            group.append(piece)
            size += len(piece)
            if size < PIECE:
                continue
            count += sum(map(len, tokenizer.encode_batch(group, add_special_tokens=False)))
            check_count(count - cuts * CUT_SLACK, MAX_TOKENIZE_TOKENS, "tokens or more",
                        "inputs", "send fewer or shorter texts")
            group, size = [], 0


def token_answer(encoding: Any, text: str) -> Raw:
    """TEI's ``SimpleToken`` list, written straight to JSON bytes (a dict per token would cost
    400 bytes a token); a special token has no span in the text."""
    records = []
    for token_id, token, special, (start, stop) in zip(
        encoding.ids, encoding.tokens, encoding.special_tokens_mask, encoding.offsets, strict=True
    ):
        if special:
            records.append(b'{"id":%d,"text":%s,"special":true,"start":null,"stop":null}'
                           % (token_id, encode(token)))
        else:
            records.append(b'{"id":%d,"text":%s,"special":false,"start":%d,"stop":%d}'
                           % (token_id, encode(text[start:stop]), start, stop))
    return Raw(b"[" + b",".join(records) + b"]")


async def tokenizer_of(config: QueueConfig | None) -> tuple[Any, int]:
    """The queue's ``tokenizers.Tokenizer`` and the UTF-8 bytes of its longest token, or a
    422; loaded once per published path."""
    path = config.tokenizer if config is not None else None
    if path is None:
        raise ApiError(422, "this queue's workers publish no tokenizer.json (the sim "
                       "backend has none; or no worker has started)", code="tokenizer")
    loaded = await asyncio.to_thread(_load, path)
    if isinstance(loaded, str):
        raise ApiError(422, f"the gateway cannot use the queue's tokenizer: {loaded}",
                       code="tokenizer")
    return loaded


@functools.cache
def _load(path: str) -> tuple[Any, int] | str:
    loaded = load_estimator(path)
    if isinstance(loaded, str):
        return loaded
    vocab = loaded.tokenizer.get_vocab()
    return loaded.tokenizer, max((len(token.encode("utf-8")) for token in vocab), default=1)


async def _reraise(exc: Exception) -> None:
    raise exc


def _check_inputs(count: int, where: str, limit: int) -> None:
    check_count(count, limit, "inputs", where, "the most --max-client-batch-size allows")


def _vectors(results: list[Result], body: Any, model: str, *_: Any) -> list[Any]:
    """``/embed``'s vectors, or ``/similarity``'s cosine of the source with each sentence."""
    vectors = schemas.embeddings_of(results, model)
    if isinstance(body, TEISimilarity):
        return [cosine(vectors[0], vector) for vector in vectors[1:]]
    return vectors


sparse_request = functools.partial(parse_job, TEIPerToken,
                                   functools.partial(schemas.tei_job, options={}))
all_request = functools.partial(parse_job, TEIPerToken, functools.partial(
    schemas.tei_job, options={"output": "tokens"}))  # every token's vector


def require_sparse(config: QueueConfig | None, model: str, *_: Any) -> None:
    """424 before anything is sent when the queue's config says it serves another kind."""
    if config is not None and config.task not in (None, "sparse"):
        raise _not_sparse(model, config.task)


def sparse_answer(results: Sequence[Result], model: str) -> list[Raw]:
    """TEI's ``EmbedSparseResponse``, written straight to JSON; 413 beyond
    :data:`.bounds.MAX_TOKEN_ANSWER_FLOATS` weights in all."""
    for result in results:
        if result.sparse is None:
            raise _not_sparse(model, "embed" if result.embedding is not None else "score")
    check_count(sum(len(result.sparse or ()) for result in results), MAX_TOKEN_ANSWER_FLOATS,
                "nonzero weights", "inputs", "send fewer inputs")
    return [Raw(b"[" + b",".join(b'{"index":%d,"value":%s}' % (index, encode(float(value)))
                                 for index, value in result.sparse or ()) + b"]")
            for result in results]


def tokens_answer(results: Sequence[Result], model: str) -> list[list[array.array]]:
    """TEI's ``EmbedAllResponse``: each input's token vectors, in token order."""
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


POSTS: dict[str, tuple[Any, ...]] = {
    "/embed": (schemas.tei_embed_request, schemas.require_embeddings, _vectors),
    "/rerank": (schemas.rerank_request, schemas.require_reranker, lambda results, body, *_:
                schemas.rerank_answer(results, body.texts, body.return_text)),
    "/predict": (schemas.predict_request, schemas.require_classifier,
                 lambda results, body, _, config: schemas.predict_answer(
                     results, schemas.is_batch(body), config and config.labels)),
    "/similarity": (similarity_request, schemas.require_embeddings, _vectors),
    "/embed_sparse": (sparse_request, require_sparse,
                      lambda results, _, model, *__: sparse_answer(results, model)),
    "/embed_all": (all_request, _tokens_fit,
                   lambda results, _, model, *__: tokens_answer(results, model)),
}
"""TEI's routes that send their body's job to a queue: what each hands ``Gateway.serve``."""


def post(router: APIRouter, path: str, *how: Any) -> None:
    """``POST path`` on ``router``: ``Gateway.serve`` with ``how``."""
    async def route(request: Request) -> Response:
        return await request.app.state.gateway.serve(request, path, *how)
    router.add_api_route(path, route, methods=["POST"])


router = APIRouter()
for path, how in POSTS.items():
    post(router, path, *how)


@router.api_route("/", methods=["GET", "POST"])  # one route: a 405 there names both methods
async def root(request: Request) -> Response:
    """TEI's ``POST /``: the route of the default queue's kind; ``GET /``: its health."""
    gateway: Gateway = request.app.state.gateway
    if request.method == "GET":
        return await gateway.health()
    try:
        config = await gateway.config(gateway.queue_of(None))
    except Exception as exc:  # Redis down: answered as /embed answers it
        return await gateway.answer("/", functools.partial(_reraise, exc))
    task = config.task if config is not None else None
    if task == "rerank" or (task is None and config is not None and config.pairs):
        return await gateway.serve(request, "/rerank", *POSTS["/rerank"])
    if task == "sparse":  # TEI: a SPLADE model's POST / is /embed_sparse
        return await gateway.serve(request, "/", *POSTS["/embed_sparse"])
    if task not in (None, "embed"):
        return await gateway.serve(request, "/predict", *POSTS["/predict"])
    return await gateway.serve(request, "/", root_embed_request, schemas.require_embeddings,
                               _vectors)


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway

    async def work() -> render.Later:
        body = await gateway.read(request, tokenize_request)
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        if not texts:
            raise empty("inputs")
        _check_inputs(len(texts), "inputs", gateway.settings.max_client_batch_size)
        config = await gateway.config(gateway.queue_of(body.model))
        tokenizer, _ = await tokenizer_of(config)
        if body.prompt_name is not None:
            prompts = (config.prompts if config is not None else None) or {}
            if body.prompt_name not in prompts:
                raise invalid("prompt_name", f"{body.prompt_name!r} is not one of the "
                              f"model's prompts ({', '.join(prompts) or 'none'})")
            texts = [prompts[body.prompt_name] + text for text in texts]
        check_count(text_bytes(texts), MAX_TOKENIZE_BYTES, "bytes of text", "inputs",
                    "/tokenize answers a record per token: send fewer or shorter texts")
        return render.Later(tokenize_answer, tokenizer, texts, body.add_special_tokens)
    return await gateway.answer("/tokenize", work, admit=True)


@router.post("/decode")
async def decode(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway

    async def work() -> list[str]:
        body = await gateway.read(request, decode_request)
        nested = body.ids and isinstance(body.ids[0], list)
        rows = cast("list[list[int]]", body.ids if nested else [body.ids])
        _check_inputs(len(rows), "ids", gateway.settings.max_client_batch_size)
        config = await gateway.config(gateway.queue_of(body.model))
        tokenizer, longest = await tokenizer_of(config)
        # each id counted at the vocabulary's longest token (in UTF-8 bytes) plus a space
        check_count(sum(map(len, rows)), MAX_DECODE_BYTES // (longest + 1),
                    f"ids (each up to {longest + 1} bytes of text)", "ids",
                    f"at most {MAX_DECODE_BYTES} bytes of text are answered")
        return await asyncio.to_thread(tokenizer.decode_batch, rows,
                                       skip_special_tokens=body.skip_special_tokens)
    return await gateway.answer("/decode", work, admit=True)
