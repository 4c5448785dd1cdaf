"""The gateway's sans-I/O core: request bodies in, jobs and answers out, no network.

``tokenq serve`` parses every body itself (producer/serve/schemas.py and
schemas.py) and maps every failure in one place (errors.py). These tests
drive those functions directly: what each API's body becomes (the inputs
and the options sent to the workers), what is refused and with which
status and field, and how results become each API's answer. The same
requests run end to end against real workers in tests/gateway/test_serve.py.
"""

from __future__ import annotations

import array
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.producer import BadRequest, QueueFull, RemoteError, Result
from tokenq.producer.serve import schemas
from tokenq.producer.serve.errors import ApiError, from_exception
from tokenq.shared.queue_config import QueueConfig

pytestmark = pytest.mark.unit

PROPERTY = settings(max_examples=200, deadline=None)


def body(model: type[schemas.Body], value: Any) -> Any:
    return schemas.parse(model, json.dumps(value).encode())


def refused(call: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    return caught.value


def result(*, scores_: tuple[float, ...] | None = None, vector: list[float] | None = None,
           labels: tuple[str, ...] | None = None) -> Result:
    embedding = None if vector is None else array.array("f", vector)
    return Result(id="r", embedding=embedding, dim=None if vector is None else len(vector),
                  scores=scores_, tokens=3, labels=labels)


# ------------------------------------------------------------------ OpenAI


def test_openai_bodies_become_texts_and_dimensions():
    one = schemas.openai_job(body(schemas.OpenAIEmbeddings, {"model": "m", "input": "hi"}))
    assert one == schemas.Job(["hi"], {})
    cut = schemas.openai_job(body(schemas.OpenAIEmbeddings,
                                  {"model": "m", "input": ["a", "b"], "dimensions": 8}))
    assert cut == schemas.Job(["a", "b"], {"dimensions": 8})
    # Infinity's client sends dimensions 0 for "all of them"
    whole = body(schemas.OpenAIEmbeddings, {"model": "m", "input": "a", "dimensions": 0})
    assert schemas.openai_job(whole).options == {}


def test_openai_truncate_is_sent_only_when_given():
    refuse = body(schemas.OpenAIEmbeddings, {"model": "m", "input": "a", "truncate": False})
    assert schemas.openai_job(refuse).options == {"truncate": False}
    cut = body(schemas.OpenAIEmbeddings, {"model": "m", "input": "a", "truncate": True})
    assert schemas.openai_job(cut).options == {"truncate": True}
    assert "truncate" not in schemas.openai_job(
        body(schemas.OpenAIEmbeddings, {"model": "m", "input": "a"})).options


def test_the_truncated_header_counts_the_replies_that_say_cut():
    results = [Result(id=str(n), embedding=None, dim=None, scores=None, tokens=8, truncated=cut)
               for n, cut in enumerate((False, True, True))]
    assert schemas.truncation_headers(results) == {schemas.TRUNCATED_HEADER: "2"}
    assert schemas.truncation_headers(results[:1]) == {schemas.TRUNCATED_HEADER: "0"}


@pytest.mark.parametrize(("value", "field"), [
    ({"model": "m", "input": "a", "truncate": "no"}, "truncate"),
    ({"model": "m", "input": "a", "dimensions": -1}, "dimensions"),
    ({"model": "m", "input": "a", "dimensions": True}, "dimensions"),
    ({"model": "m", "input": "a", "dimensions": 8.5}, "dimensions"),
    ({"model": "m", "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a"}, "model"),
])
def test_openai_fields_that_do_not_validate_are_named(value, field):
    error = refused(body, schemas.OpenAIEmbeddings, value)
    assert error.status == 422 and error.param == field


@pytest.mark.parametrize(("value", "field"), [
    ({"model": "m", "input": [[1, 2, 3]]}, "input"),
    ({"model": "m", "input": [1, 2, 3]}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": ["http://x/cat.jpg"], "modality": "image"}, "modality"),
])
def test_what_no_worker_serves_is_refused_by_name(value, field):
    error = refused(schemas.openai_job, body(schemas.OpenAIEmbeddings, value))
    assert error.status == 422 and error.param == field and field in error.message


# --------------------------------------------------------------------- TEI


def test_tei_embed_sends_normalize_always_and_the_rest_when_given():
    plain = schemas.tei_embed_job(body(schemas.TEIEmbed, {"inputs": "a"}))
    assert plain == schemas.Job(["a"], {"normalize": True}, "inputs")
    every = schemas.tei_embed_job(body(schemas.TEIEmbed, {
        "inputs": ["a", "b"], "normalize": False, "truncate": False, "prompt_name": "query",
        "dimensions": 4, "truncation_direction": "right",
    }))
    assert every == schemas.Job(["a", "b"], {
        "normalize": False, "truncate": False, "prompt_name": "query", "dimensions": 4,
    }, "inputs")


@pytest.mark.parametrize(("value", "status", "field"), [
    ({"inputs": []}, 400, "inputs"),
    ({"inputs": [1, 2]}, 422, "inputs"),
    ({"inputs": ["a", [1, 2]]}, 422, "inputs"),
    ({"inputs": "a", "truncation_direction": "Left"}, 422, "truncation_direction"),
])
def test_tei_embed_refusals(value, status, field):
    error = refused(schemas.tei_embed_request, json.dumps(value).encode())
    assert (error.status, error.param) == (status, field)
    assert error.tei_body()["error_type"] == ("Empty" if status == 400 else "Validation")


def test_an_embedding_route_refuses_a_scoring_queue_before_sending():
    schemas.require_embeddings(None, "m")
    schemas.require_embeddings(QueueConfig(task="embed"), "m")
    error = refused(schemas.require_embeddings, QueueConfig(task="classify"), "spam")
    assert error.status == 424 and error.code == "not_an_embedding_model"


def test_rerank_is_one_pair_per_text_with_its_options():
    job = schemas.rerank_job(body(schemas.TEIRerank, {
        "query": "q", "texts": ["a", "b"], "raw_scores": True, "truncate": True,
    }))
    assert job == schemas.Job([("q", "a"), ("q", "b")], {"raw_scores": True, "truncate": True},
                              "texts")
    quiet = schemas.rerank_job(body(schemas.TEIRerank, {"query": "q", "texts": ["a"],
                                                      "raw_scores": False}))
    assert quiet.options == {}
    empty = refused(schemas.rerank_job, body(schemas.TEIRerank, {"query": "q", "texts": []}))
    assert empty.status == 400 and empty.param == "texts"
    left = {"query": "q", "texts": ["a"], "truncation_direction": "left"}
    assert refused(body, schemas.TEIRerank, left).param == "truncation_direction"


@pytest.mark.parametrize(("inputs", "items", "batched"), [
    ("a", ["a"], False),
    (["a"], ["a"], False),
    (["a", "b"], [("a", "b")], False),
    ([["a"], ["a", "b"]], ["a", ("a", "b")], True),
    ([["a"]], ["a"], True),
])
def test_predict_reads_inputs_as_tei_does(inputs, items, batched):
    parsed = body(schemas.TEIPredict, {"inputs": inputs})
    assert (schemas.predict_job(parsed).items, schemas.is_batch(parsed)) == (items, batched)


@pytest.mark.parametrize(("inputs", "status", "field"), [
    ([], 400, "inputs"),
    (["a", "b", "c"], 422, "inputs"),
    ([["a"], ["a", "b", "c"]], 422, "inputs[1]"),
    ([["a"], "b"], 422, "inputs"),
])
def test_predict_refuses_what_tei_refuses(inputs, status, field):
    def parse_and_build() -> None:
        schemas.predict_job(body(schemas.TEIPredict, {"inputs": inputs}))

    error = refused(parse_and_build)
    assert error.status == status and error.param.startswith(field)


def test_scoring_routes_refuse_a_queue_whose_model_cannot_answer():
    schemas.require_reranker(None)
    schemas.require_reranker(QueueConfig(task="rerank", pairs=True))
    for config in (QueueConfig(task="embed"), QueueConfig(task="classify", pairs=False)):
        error = refused(schemas.require_reranker, config)
        assert error.status == 424 and error.code == "not_a_reranker"
        assert "re-ranker" in error.message
    pair = schemas.Job([("a", "b")])
    schemas.require_classifier(QueueConfig(task="rerank", pairs=True), "m", pair)
    schemas.require_classifier(QueueConfig(task="classify", pairs=False), "m",
                              schemas.Job(["a"]))
    embedder = refused(schemas.require_classifier, QueueConfig(task="embed"), "m", pair)
    assert embedder.code == "not_a_classifier"
    single = refused(schemas.require_classifier, QueueConfig(task="classify", pairs=False), "m",
                     pair)
    assert single.param == "inputs" and "pair" in single.message


# ----------------------------------------------------------------- answers


score_lists = st.lists(st.floats(-50, 50, allow_nan=False, width=32), min_size=1, max_size=40)


@PROPERTY
@given(score_lists, st.booleans())
def test_ranks_are_the_scores_best_first_by_their_input_index(values, return_text):
    texts = [f"text {i}" for i in range(len(values))]
    ranks = schemas.rerank_answer([result(scores_=(v,)) for v in values], texts, return_text)
    assert sorted(rank["index"] for rank in ranks) == list(range(len(values)))
    assert [rank["score"] for rank in ranks] == sorted(values, reverse=True)
    for rank in ranks:
        assert rank["score"] == values[rank["index"]]
        assert rank.get("text") == (texts[rank["index"]] if return_text else None)


@PROPERTY
@given(st.lists(score_lists, min_size=1, max_size=5), st.booleans(), st.booleans())
def test_predictions_name_every_score_best_first(rows, named, batched):
    rows = rows if batched else rows[:1]
    results = [
        result(scores_=tuple(row), labels=tuple(f"c{i}" for i in range(len(row))) if named
               else None)
        for row in rows
    ]
    answer = schemas.predict_answer(results, batched, None)
    lists = answer if batched else [answer]
    assert len(lists) == len(rows)
    for row, predictions in zip(rows, lists, strict=True):
        assert [p["score"] for p in predictions] == sorted(row, reverse=True)
        prefix = "c" if named else "LABEL_"
        for p in predictions:
            assert p["label"].startswith(prefix)
            assert row[int(p["label"].removeprefix(prefix))] == p["score"]


def test_labels_come_from_the_result_then_the_queue_then_label_i():
    queue_labels = ("no", "yes")
    own = schemas.predict_answer([result(scores_=(0.2, 0.8), labels=("a", "b"))], False,
                                queue_labels)
    assert own == [{"label": "b", "score": 0.8}, {"label": "a", "score": 0.2}]
    from_queue = schemas.predict_answer([result(scores_=(0.2, 0.8))], False, queue_labels)
    assert [p["label"] for p in from_queue] == ["yes", "no"]
    mismatched = schemas.predict_answer([result(scores_=(0.2, 0.8, 0.0))], False, queue_labels)
    assert [p["label"] for p in mismatched] == ["LABEL_1", "LABEL_0", "LABEL_2"]


def test_a_nan_score_is_the_models_failure_and_an_embedding_is_the_wrong_model():
    nan = refused(schemas.rerank_answer, [result(scores_=(math.nan,))], ["a"], False)
    assert nan.status == 424
    vector = refused(schemas.predict_answer, [result(vector=[0.6, 0.8])], False, None)
    assert vector.status == 424 and vector.code == "not_a_classifier"


def test_info_model_type_follows_the_queues_task():
    embedder = {"embedding": {"pooling": "unknown"}}  # TEI's spec requires pooling
    assert schemas.tei_model_type(QueueConfig()) == embedder
    assert schemas.tei_model_type(QueueConfig(task="embed", dim=32)) == embedder
    rerank = schemas.tei_model_type(QueueConfig(task="rerank", dim=1))
    assert rerank == {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    named = schemas.tei_model_type(QueueConfig(task="classify", dim=2, labels=("neg", "pos")))
    assert named == {"classifier": {"id2label": {"0": "neg", "1": "pos"},
                                    "label2id": {"neg": 0, "pos": 1}}}
    unnamed = schemas.tei_model_type(QueueConfig(task="classify", dim=3))
    assert unnamed["classifier"]["id2label"] == {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}


# ------------------------------------------------------------------ errors


def test_a_refused_option_names_itself_as_the_field():
    options = {"prompt_name": "nope", "normalize": True}
    worker = RemoteError("bad_request", "opts: prompt_name 'nope' is not one of this model's "
                         "prompts (its prompts are ['query'])")
    error = from_exception(worker, options)
    assert (error.status, error.param, error.code) == (422, "prompt_name", "bad_request")
    assert error.message.startswith("prompt_name 'nope'")
    early = from_exception(BadRequest("dimensions 64 is more than the model's 32",
                                      param="dimensions"), {"dimensions": 64})
    assert early.status == 422 and early.param == "dimensions"
    text = from_exception(BadRequest("texts[0] is empty"), options)
    assert text.param == "input" and text.message == "input: texts[0] is empty"
    pair = from_exception(BadRequest("texts[1] is empty"), {}, "texts")
    assert pair.param == "texts" and pair.message.startswith("texts: ")
    long = from_exception(RemoteError("too_long", "3002 tokens, over 2048"), options)
    assert (long.status, long.param) == (422, "input")


def test_the_other_failures_keep_their_statuses():
    failed = from_exception(RemoteError("inference_failed", "boom"), {"normalize": True})
    assert failed.status == 424 and failed.tei_body()["error_type"] == "Backend"
    full = from_exception(QueueFull("full"))
    assert full.status == 429 and full.headers == {"Retry-After": "1"}
    with pytest.raises(KeyError):
        from_exception(KeyError("a bug is re-raised"))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["inputs", "input", "query", "texts", "model", "dimensions",
                         "normalize", "truncate", "raw_scores", "prompt_name",
                         "truncation_direction", "return_text"]), inner, max_size=6),
    max_leaves=12,
)


@PROPERTY
@given(json_values)
def test_any_json_body_is_a_job_or_an_api_error(value):
    raw = json.dumps(value).encode()
    builders = [
        (schemas.OpenAIEmbeddings, schemas.openai_job),
        (schemas.TEIEmbed, schemas.tei_embed_job),
        (schemas.TEIRerank, schemas.rerank_job),
        (schemas.TEIPredict, schemas.predict_job),
    ]
    for model, build in builders:
        try:
            job = build(schemas.parse(model, raw))
        except ApiError as error:
            assert error.status in (400, 422) and error.message
            continue
        assert job.items and all(isinstance(item, str | tuple) for item in job.items)
