"""Request bodies and answers, as OpenAI, TEI and Infinity clients send and expect them: a body
becomes a :class:`Job`, a field that does not validate a 422 in the API's own shape."""

from __future__ import annotations

import array
import base64
import functools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, ValidationError

from tokenq.producer import Result
from tokenq.producer.core import TextItem
from tokenq.producer.serve import bounds
from tokenq.producer.serve.bounds import TEXT, TEXT_OR_TOKENS, TEXTS, TOKEN, TOKENS
from tokenq.producer.serve.errors import ApiError, empty, invalid, wrong_model
from tokenq.shared.queue_config import QueueConfig
from tokenq.shared.request_options import MAX_DIMENSIONS

T = TypeVar("T")

Dimensions = Annotated[int, Field(ge=0, le=MAX_DIMENSIONS, strict=True)]
"""OpenAI's ``dimensions``; 0 means all of them, as Infinity (whose client sends 0) reads it."""


def _rightward(direction: str) -> str:
    if direction.lower() != "right":
        raise invalid("truncation_direction",
                      "Left is not supported: the workers keep the start of an input (Right)")
    return direction


Direction = Annotated[Literal["Right", "right", "Left", "left"], AfterValidator(_rightward)]
"""TEI's ``truncation_direction``, spelled either way as TEI accepts it; only Right is served."""


def one_kind(where: str, *variants: bounds.Variant, shape: Any = Any) -> PlainValidator:
    """A field holding a string or a list of one of ``variants``, checked in one pass."""
    return PlainValidator(lambda value: bounds.text_or_list(value, where, variants),
                          json_schema_input_type=shape)  # ``shape``: what /openapi.json shows


OpenAIShape = str | list[str] | list[int] | list[list[int]]
OpenAIInput = Annotated[OpenAIShape, one_kind("input", TEXT, TOKEN, TOKENS, shape=OpenAIShape)]
TEIShape = str | list[int] | list[str | list[int]]
TEIInputs = Annotated[TEIShape, one_kind("inputs", TOKEN, TEXT_OR_TOKENS, shape=TEIShape)]


@dataclass(frozen=True, slots=True)
class Job:
    """What one HTTP request asks of a queue: its inputs, and the options for every one."""

    items: list[TextItem]
    options: dict[str, Any] = field(default_factory=dict)
    where: str = "input"  # the body's field holding the items


class Body(BaseModel):
    """A request body: unknown fields ignored, as TEI does; strict (``"normalize": "no"`` is a
    422, not a silent true)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None  # not TEI's: which of ``--models`` serves it (default: the first)


class Truncating(Body):
    """What TEI's bodies of texts to run say of an over-long input."""

    truncate: bool | None = None
    truncation_direction: Direction = "Right"


class OpenAIEmbeddings(Body):
    """``POST /v1/embeddings`` (OpenAI) and ``POST /embeddings`` (Infinity); unknown fields are
    refused, as OpenAI does (a misspelt ``extra_body`` field must not pass)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: OpenAIInput
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions | None = None
    user: str | None = None
    modality: str = "text"  # Infinity's: only text is served
    prompt_name: str | None = None  # TEI's, in ``extra_body``
    truncate: bool | None = None  # TEI's, in ``extra_body``: false refuses an over-long input
    cache: bool | None = None  # tokenq's, in ``extra_body``: false computes afresh


class TEIPerToken(Truncating):
    """``POST /embed_sparse`` and ``/embed_all`` (TEI's ``EmbedSparseRequest`` and
    ``EmbedAllRequest``): what every TEI body that embeds texts has."""

    inputs: TEIInputs
    prompt_name: str | None = None


class TEIEmbed(TEIPerToken):
    """``POST /embed`` (text-embeddings-inference)."""

    normalize: bool = True
    dimensions: Dimensions | None = None


def parse(model: type[Body], raw: bytes) -> Any:
    """The body as ``model``, or a 422 naming the first field that does not validate."""
    document = bounds.decode_json(raw)
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "body"
        raise invalid(where, first.get("msg", "invalid")) from None


def parse_job(model: type[Body], job: Callable[[Any], T], raw: bytes) -> tuple[Any, T]:
    """The body as ``model``, and ``job`` of it: a route's ``prepare``, as a ``partial`` of
    module-level parts (bounds.Parser pickles it by name)."""
    body = parse(model, raw)
    return body, job(body)


def openai_job(body: OpenAIEmbeddings) -> Job:
    """The texts of an OpenAI request (a string or a list of strings) and its ``dimensions``."""
    if body.modality != "text":
        raise invalid("modality", f"{body.modality!r} is not served: tokenq embeds text")
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise invalid("input", "must not be empty")
    if not all(isinstance(text, str) for text in texts):
        raise invalid("input", TOKEN_IDS_REFUSED)
    options = given(dimensions=body.dimensions or None, prompt_name=body.prompt_name,
                    truncate=body.truncate, cache=body.cache)
    return Job(list(texts), options)  # type: ignore[arg-type]


TOKEN_IDS_REFUSED = (
    "token-id input is not supported: send text. LangChain's OpenAIEmbeddings sends "
    "tiktoken ids by default: construct it with check_embedding_ctx_length=False"
)
"""Ids of the client's own tokenizer cannot be decoded for the model's (0032-strict-bodies)."""


openai_request = functools.partial(parse_job, OpenAIEmbeddings, openai_job)


def tei_embed_job(body: TEIEmbed) -> Job:
    job = tei_job(body, {"normalize": body.normalize})
    if body.dimensions:
        job.options["dimensions"] = body.dimensions
    return job


tei_embed_request = functools.partial(parse_job, TEIEmbed, tei_embed_job)


def tei_job(body: TEIPerToken, options: dict[str, Any]) -> Job:
    """A TEI body's texts, with ``options`` and ``truncate`` and ``prompt_name`` when given;
    token ids and an empty list are refused."""
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not all(isinstance(item, str) for item in texts):
        raise invalid("inputs", "token-id input is not supported: send text")
    if not texts:
        raise empty("inputs")
    options = {**options, **given(truncate=body.truncate, prompt_name=body.prompt_name)}
    return Job(list(texts), options, "inputs")  # type: ignore[arg-type]


def given(**options: Any) -> dict[str, Any]:
    return {name: value for name, value in options.items() if value is not None}


def require_embeddings(config: QueueConfig | None, model: str, *_: Any) -> None:
    """424 before anything is sent when the queue's config says its model embeds nothing."""
    if config is not None and config.task not in (None, "embed"):
        raise _not_embeddings(model)


def embeddings_of(results: Sequence[Result], model: str) -> list[Any]:
    """Each result's vector; 424 for a queue whose model answers scores."""
    vectors = []
    for result in results:
        if result.embedding is None:
            raise _not_embeddings(model)
        vectors.append(result.embedding)
    return vectors


def _not_embeddings(model: str) -> ApiError:
    return wrong_model(
        "not_an_embedding_model",
        f"model {model!r} answers scores or sparse weights (a classifier, reranker or SPLADE "
        "model), not embeddings",
    )


def openai_answer(results: Sequence[Result], body: OpenAIEmbeddings, *_: Any) -> dict[str, Any]:
    """OpenAI's list of embeddings, with usage from the workers' exact token counts."""
    model, encoding_format = body.model, body.encoding_format
    vectors = embeddings_of(results, model)
    tokens = sum(result.tokens or 0 for result in results)
    data = [{"object": "embedding", "index": index,
             "embedding": _base64_le(vector) if encoding_format == "base64" else vector}
            for index, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


TRUNCATED_HEADER = "x-tokenq-truncated"
"""How many of a request's inputs the workers cut to the model's limit (``/v1/embeddings``)."""


def truncation_headers(results: Sequence[Result]) -> dict[str, str]:
    return {TRUNCATED_HEADER: str(sum(1 for result in results if result.truncated))}


def _base64_le(vector: array.array) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian."""
    if sys.byteorder == "big":
        vector = array.array("f", vector)
        vector.byteswap()
    return base64.b64encode(vector.tobytes()).decode("ascii")


# TEI's scoring routes


def texts_only(value: Any) -> list[str]:
    if type(value) is not list:
        raise invalid("texts", f"expected a list of strings, got {bounds.kind(value)}")
    bounds.check_each(value, "texts", TEXT)
    return value


class TEIRerank(Truncating):
    """``POST /rerank``."""

    query: str
    texts: Annotated[list[str], PlainValidator(texts_only, json_schema_input_type=list[str])]
    raw_scores: bool = False
    return_text: bool = False


class TEIPredict(Truncating):
    """``POST /predict``."""

    inputs: Annotated[str | list[str] | list[list[str]],
                      one_kind("inputs", TEXT, TEXTS, shape=str | list[str] | list[list[str]])]
    raw_scores: bool = False


def _options(body: TEIRerank | TEIPredict) -> dict[str, Any]:
    return given(truncate=body.truncate, raw_scores=body.raw_scores or None)


def rerank_job(body: TEIRerank) -> Job:
    if not body.texts:
        raise empty("texts")
    return Job([(body.query, text) for text in body.texts], _options(body), "texts")


def is_batch(body: TEIPredict) -> bool:
    """As TEI reads ``inputs``: a string or a flat list (``[text]``, ``[text, text_pair]``) is
    one input, a list of lists a batch."""
    return not isinstance(body.inputs, str) and not all(isinstance(i, str) for i in body.inputs)


def predict_job(body: TEIPredict) -> Job:
    """The inputs of a predict request (:func:`is_batch`)."""
    inputs = body.inputs
    if isinstance(inputs, str):
        items: list[TextItem] = [inputs]
    elif not inputs:
        raise empty("inputs")
    elif not is_batch(body):
        items = [_sequence(inputs, "inputs")]  # type: ignore[arg-type]
    else:
        items = [_sequence(item, f"inputs[{index}]") for index, item in enumerate(inputs)]
    return Job(items, _options(body), "inputs")


rerank_request = functools.partial(parse_job, TEIRerank, rerank_job)
predict_request = functools.partial(parse_job, TEIPredict, predict_job)


def _sequence(parts: Sequence[str], where: str) -> TextItem:
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return (parts[0], parts[1])
    raise invalid(where, f"{len(parts)} strings: an input is [text] or a pair [text, text_pair]; "
                  "send a batch as a list of those")


def require_reranker(config: QueueConfig | None, *_: Any) -> None:
    """424 unless the queue's model is a reranker (TEI refuses any other model, too); no
    config (no worker has started): the workers decide."""
    if config is None or config.task == "rerank" or (config.task is None and config.pairs):
        return
    kind = {None: "takes no pairs", "embed": "embeds"}.get(config.task,
                                                             f"is a {config.task!r} model")
    raise wrong_model("not_a_reranker", f"model is not a re-ranker model: this queue's model "
                      f"{kind}; /rerank needs a cross-encoder run with --task rerank")


def require_classifier(config: QueueConfig | None, model: str, job: Job) -> None:
    """424 unless the queue's model answers scores, and takes pairs if ``job`` has any."""
    if config is None:
        return
    if config.task in (None, "embed", "sparse"):
        kind = "answers sparse weights" if config.task == "sparse" else "embeds"
        raise wrong_model("not_a_classifier", "model is not a classifier model: this queue's "
                          f"model {kind}; /predict needs a classifier or a reranker")
    if config.pairs is False and any(isinstance(item, tuple) for item in job.items):
        raise invalid("inputs", "a pair [text, text_pair], but this queue's model takes "
                      "single texts")


def label_names(count: int, labels: Sequence[str] | None) -> list[str]:
    """``labels`` when there are ``count`` of them, else ``LABEL_i``."""
    if labels is not None and len(labels) == count:
        return list(labels)
    return [f"LABEL_{index}" for index in range(count)]


def scores_of(result: Result) -> tuple[float, ...]:
    """A result's scores; 424 for an embedding (the wrong kind) or a NaN (as TEI answers one)."""
    if result.scores is None:
        raise wrong_model("not_a_classifier", "the queue answered an embedding, not scores")
    if any(math.isnan(score) for score in result.scores):
        raise ApiError(424, "score is NaN", code="inference_failed")
    return result.scores


def rerank_answer(
    results: Sequence[Result], texts: Sequence[str], return_text: bool
) -> list[dict[str, Any]]:
    """TEI's ranks, best first; ties keep input order."""
    ranks: list[dict[str, Any]] = []
    for index, result in enumerate(results):
        rank: dict[str, Any] = {"index": index, "score": scores_of(result)[0]}
        if return_text:
            rank["text"] = texts[index]
        ranks.append(rank)
    ranks.sort(key=lambda rank: -rank["score"])
    return ranks


def predict_answer(
    results: Sequence[Result], batched: bool, labels: Sequence[str] | None
) -> list[Any]:
    """TEI's predictions; a result's own labels first, then the queue's (``labels``)."""
    answers = [_predictions(result, labels) for result in results]
    return answers if batched else answers[0]


def _predictions(result: Result, labels: Sequence[str] | None) -> list[dict[str, Any]]:
    scores = scores_of(result)
    names = label_names(len(scores), result.labels or labels)
    pairs = sorted(zip(names, scores, strict=True), key=lambda pair: -pair[1])  # stable
    return [{"label": name, "score": score} for name, score in pairs]


def tei_model_type(config: QueueConfig) -> dict[str, Any]:
    """TEI's ``model_type``: ``embedding``, ``classifier`` (with ``id2label``) or ``reranker``."""
    if config.task in (None, "embed"):
        # TEI's spec requires ``pooling``: the workers' own, "unknown" where they publish none
        return {"embedding": {"pooling": config.pooling or "unknown"}}
    if config.task == "sparse":
        return {"embedding": {"pooling": "splade"}}  # as TEI describes a SPLADE model
    kind = "reranker" if config.task == "rerank" else "classifier"
    count = config.dim or len(config.labels or ()) or (1 if kind == "reranker" else 0)
    names = label_names(count, config.labels)
    return {kind: {
        "id2label": {str(index): label for index, label in enumerate(names)},
        "label2id": {label: index for index, label in enumerate(names)},
    }}
