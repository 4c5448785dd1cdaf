"""One derivation per model fact: BackendInfo → config hash → ModelFacts.

The worker checks a request's options with the facts of the config it
publishes, and the producer with the facts of the hash it reads; these pin
that the two are the same facts, under the same names.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenq.shared.queue_config import describe, encode_config, model_facts, parse_config
from tokenq.worker.backends.base import TASKS, BackendInfo
from tokenq.worker.pipeline.finisher import facts_of

pytestmark = pytest.mark.unit

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8)


@st.composite
def infos(draw: st.DrawFn) -> BackendInfo:
    prompts = draw(st.dictionaries(names, st.text(max_size=12), max_size=3))
    default = draw(st.none() | st.sampled_from(sorted(prompts) or [None]))
    return BackendInfo(
        name=draw(st.sampled_from(["hf", "sim", "plugin"])),
        model=draw(names),
        task=draw(st.sampled_from(TASKS)),
        max_input_tokens=draw(st.integers(1, 8192)),
        padded=draw(st.booleans()),
        dim=draw(st.none() | st.integers(1, 4096)),
        pairs=draw(st.booleans()),
        normalized=draw(st.booleans()),
        labels=tuple(draw(st.lists(names, max_size=3))),
        raw_vectors=draw(st.booleans()),
        prompts=prompts,
        default_prompt_name=default,
        token_dim=draw(st.none() | st.integers(1, 4096)),
        pooling=draw(st.none() | st.sampled_from(["mean", "cls", "mean+max", "lasttoken"])),
    )


@given(infos())
def test_the_producer_reads_the_facts_the_worker_checks(info: BackendInfo) -> None:
    published = encode_config(describe(info, policy="truncate", max_batch_tokens=16384))
    assert model_facts(parse_config(published)) == facts_of(info)


@given(infos())
def test_each_fact_keeps_its_name_and_value_through_the_hash(info: BackendInfo) -> None:
    facts = model_facts(parse_config(encode_config(describe(info))))
    embeds = info.task == "embed"
    assert facts.embeds == embeds and facts.sparse == (info.task == "sparse")
    assert facts.default_prompt_name == info.default_prompt_name
    assert facts.prompts == dict(info.prompts) and facts.token_dim == info.token_dim
    if embeds:
        assert (facts.dim, facts.normalized, facts.raw_vectors) == (
            info.dim, info.normalized, info.raw_vectors)
        assert facts.can_output_tokens == (info.token_dim is not None)


@given(infos())
def test_an_embedders_pooling_reaches_the_config_and_no_other_kind_claims_one(
    info: BackendInfo,
) -> None:
    config = parse_config(encode_config(describe(info)))
    assert config is not None
    assert config.pooling == (info.pooling if info.task == "embed" else None)


def test_a_hash_from_an_older_worker_is_read_under_its_old_names() -> None:
    old = {"task": "embed", "prompts": '{"q": "query: "}', "default_prompt": "q",
           "token_dim": "8"}
    facts = model_facts(parse_config(old))
    assert facts.default_prompt_name == "q"
    # Without raw_vectors the hash may predate publishing every fact: unknown, not refused.
    assert facts.raw_vectors is None and facts.can_output_tokens is True
    assert model_facts(parse_config({"task": "embed"})).can_output_tokens is None


def test_the_new_name_wins_over_an_old_workers_field_left_in_the_hash() -> None:
    stale = {"task": "embed", "default_prompt": "q", "default_prompt_name": ""}
    assert parse_config(stale).default_prompt_name is None  # type: ignore[union-attr]
