"""TEI's scoring routes, ``POST /rerank`` and ``POST /predict``: bodies in, answers out (whether a
queue can answer is its config hash's ``task``, ``pairs``, ``labels``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import PlainValidator

from tokenq.producer import Result
from tokenq.producer.core import TextItem
from tokenq.producer.serve.bounds import TEXT, TEXTS, check_each, kind
from tokenq.producer.serve.errors import ApiError, empty, invalid, wrong_model
from tokenq.producer.serve.schemas import Job, Truncating, given, one_kind, parse_job
from tokenq.shared.queue_config import QueueConfig


def texts_only(value: Any) -> list[str]:
    """``texts``: a list of strings, checked in one pass that stops at the first that is not."""
    if type(value) is not list:
        raise invalid("texts", f"expected a list of strings, got {kind(value)}")
    check_each(value, "texts", TEXT)
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
    """One (query, text) pair per text."""
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
        return Job([inputs], _options(body), "inputs")
    if not inputs:
        raise empty("inputs")
    if not is_batch(body):
        one = _sequence(inputs, "inputs")  # type: ignore[arg-type]
        return Job([one], _options(body), "inputs")
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
    """424 unless the queue's model is a reranker (TEI refuses any other model, too)."""
    if config is None:
        return  # no worker has described the queue yet: the workers will decide
    if config.task == "rerank" or (config.task is None and config.pairs):
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
    """The name of each of ``count`` scores: ``labels`` when they fit, else ``LABEL_i``."""
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
    pairs = zip(names, scores, strict=True)
    predictions: list[dict[str, Any]] = [{"label": name, "score": score} for name, score in pairs]
    predictions.sort(key=lambda prediction: -prediction["score"])
    return predictions


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
