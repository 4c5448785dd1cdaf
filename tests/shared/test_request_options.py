"""Per-request options, sans-I/O: what each means (shared/request_options.py) and what it
does to a result (worker/pipeline/finisher.py), with hypothesis trying to break both."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.shared.request_options import (
    NO_OPTIONS,
    ModelFacts,
    RequestOptions,
    WorkerOptions,
    default_prompt,
    parse_options,
    prompt_of,
)
from tokenq.worker.backends.base import BackendInfo
from tokenq.worker.backends.chunks import combine_chunks
from tokenq.worker.pipeline.finisher import Finisher, facts_of, stack_rows

pytestmark = pytest.mark.unit

EMBED = ModelFacts(embeds=True, dim=8, normalized=True, raw_vectors=True,
                   prompts={"query": "query: ", "document": "passage: "},
                   default_prompt_name="query")
SCORES = ModelFacts(embeds=False, dim=3, prompts={})

values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 20), st.text(max_size=12),
    st.floats(allow_nan=True), st.lists(st.integers(), max_size=2),
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from([*sorted(WorkerOptions.__optional_keys__), "other"]),
                       values, max_size=6),
       st.sampled_from([EMBED, SCORES, ModelFacts()]))
def test_parse_either_checks_or_names_the_bad_key(opts: dict[str, Any], facts: ModelFacts) -> None:
    """Any map: options whose every field is valid for the model, or a ValueError naming a key."""
    try:
        options = parse_options(opts, facts)
    except ValueError as exc:
        assert any(key in str(exc) for key in opts), exc
        return
    if options.dimensions is not None:
        assert facts.embeds is not False and 1 <= options.dimensions <= (facts.dim or 10**9)
    for name in ("normalize", "truncate"):
        assert getattr(options, name) in (None, True, False)
    assert isinstance(prompt_of(options, facts), str)


def test_prompts_resolve_as_sentence_transformers_does() -> None:
    assert prompt_of(NO_OPTIONS, EMBED) == "query: "  # the default prompt
    assert prompt_of(parse_options({"prompt_name": "document"}, EMBED), EMBED) == "passage: "
    assert prompt_of(parse_options({"prompt": ""}, EMBED), EMBED) == ""  # overrides the default
    assert prompt_of(parse_options({"prompt": "x: "}, EMBED), EMBED) == "x: "
    assert default_prompt(ModelFacts()) == ""
    with pytest.raises(ValueError, match=r"'passage' is not one of .*\['document', 'query'\]"):
        parse_options({"prompt_name": "passage"}, EMBED)
    # Without the model's prompts (a producer with no config) a name is left to the worker.
    assert prompt_of(parse_options({"prompt_name": "any"}, ModelFacts()), ModelFacts()) == ""


def test_unknown_keys_are_kept_and_do_not_change_the_answer() -> None:
    options = parse_options({"future_option": 1}, EMBED)
    assert options is NO_OPTIONS or not options.shapes_output


def info(**fields: Any) -> BackendInfo:
    base: dict[str, Any] = dict(name="t", model="t", task="embed", max_input_tokens=32, dim=8)
    return BackendInfo(**(base | fields))


def unit(row: np.ndarray) -> np.ndarray:
    return row / max(float(np.linalg.norm(row)), 1e-12)


rows_strategy = st.lists(
    st.lists(st.floats(-50, 50, width=32), min_size=8, max_size=8).filter(
        lambda row: np.linalg.norm(row) > 1e-3
    ),
    min_size=1, max_size=12,
)
option_strategy = st.builds(
    RequestOptions,
    dimensions=st.none() | st.integers(1, 8),
    normalize=st.none() | st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(rows_strategy, st.data(), st.booleans(), st.booleans())
def test_a_batch_is_finished_as_each_row_alone(
    raw: list[list[float]], data: st.DataObject, normalized: bool, raw_vectors: bool
) -> None:
    """The batched default path and the per-row path give the same answers."""
    finisher = Finisher(info(normalized=normalized, raw_vectors=raw_vectors))
    rows = [np.asarray(row, dtype=np.float32) for row in raw]
    if normalized and not raw_vectors:  # such a backend returns unit vectors
        rows = [unit(row).astype(np.float32) for row in rows]
    options = [data.draw(option_strategy | st.just(NO_OPTIONS)) for _ in rows]
    answers = finisher.finish(rows, options)
    for row, option, answer in zip(rows, options, answers, strict=True):
        np.testing.assert_allclose(answer, finisher.one(row, option), rtol=1e-6, atol=1e-7)
        expected = row[: option.dimensions] if option.dimensions else row
        wanted_unit = normalized if option.normalize is None else option.normalize
        if wanted_unit:
            expected = unit(expected)
        np.testing.assert_allclose(answer, expected, rtol=1e-5, atol=1e-6)
        assert answer.dtype == np.float32


@pytest.mark.parametrize("rows", [
    [np.arange(4, dtype=np.float32) + i for i in range(3)],  # equal 1-D rows: joined
    list(np.ones((5, 3), dtype=np.float32)),  # views of one array
    [np.zeros(0, dtype=np.float32)] * 2,  # empty rows
    [np.ones(3, dtype=np.float32), np.ones(3, dtype=np.float64)],  # dtypes differ: np.stack
    [np.ones((2, 2), dtype=np.float32)] * 2,  # 2-D rows: np.stack
])
def test_stack_rows_is_np_stack(rows: list[np.ndarray]) -> None:
    stacked = stack_rows(rows)
    expected = np.stack(rows)
    assert stacked.shape == expected.shape and stacked.dtype == expected.dtype
    np.testing.assert_array_equal(stacked, expected)


def test_stack_rows_refuses_rows_of_different_lengths_as_np_stack_does() -> None:
    with pytest.raises(ValueError):
        stack_rows([np.ones(2, dtype=np.float32), np.ones(4, dtype=np.float32)])


def test_normalize_false_is_refused_where_the_backend_cannot_honour_it() -> None:
    facts = facts_of(info(normalized=True, raw_vectors=False))
    with pytest.raises(ValueError, match="only answers unit-length"):
        parse_options({"normalize": False}, facts)
    parse_options({"normalize": False}, facts_of(info(normalized=True, raw_vectors=True)))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.floats(-30, 30, width=32), min_size=3, max_size=3),
                min_size=1, max_size=8))
@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
def test_activations_equal_torch(activation: str, raw: list[list[float]]) -> None:
    torch = pytest.importorskip("torch")  # the reference only: a producer install has none
    finisher = Finisher(info(task="classify", dim=3, activation=activation))
    rows = [np.asarray(row, dtype=np.float32) for row in raw]
    logits = torch.tensor(np.stack(rows))
    reference = torch.sigmoid(logits) if activation == "sigmoid" else torch.softmax(logits, dim=1)
    answers = finisher.finish(rows, [NO_OPTIONS] * len(rows))
    np.testing.assert_allclose(np.stack(answers), reference.numpy(), rtol=1e-5, atol=1e-6)
    raw_answers = finisher.finish(rows, [RequestOptions(raw_scores=True)] * len(rows))
    np.testing.assert_array_equal(np.stack(raw_answers), np.stack(rows))


def test_chunked_windows_combine_as_unit_windows_when_the_answer_is_unit() -> None:
    """Raw windows of a normalising model give the mean of their unit vectors, re-normalised."""
    rng = np.random.default_rng(0)
    windows = [rng.normal(size=8).astype(np.float32) * scale for scale in (1.0, 5.0, 0.2)]
    lengths = [10, 10, 3]
    finisher = Finisher(info(normalized=True, raw_vectors=True))
    expected = combine_chunks([unit(w) for w in windows], lengths, normalize=True)
    np.testing.assert_allclose(finisher.combine(windows, lengths, NO_OPTIONS), expected, rtol=1e-5)
    raw = finisher.combine(windows, lengths, RequestOptions(normalize=False))
    np.testing.assert_allclose(raw, combine_chunks(windows, lengths, normalize=False), rtol=1e-5)
    short = finisher.combine(windows, lengths, RequestOptions(dimensions=3))
    np.testing.assert_allclose(short, unit(expected[:3]), rtol=1e-5)
