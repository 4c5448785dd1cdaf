"""The simulated GPU backend: exact tokens, modelled memory and time, checkable vectors."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenq.shared.errors import ConfigError, DeviceOutOfMemory
from tokenq.worker.backends import sim
from tokenq.worker.backends.base import Backend, TextInput
from tokenq.worker.backends.sim import (
    SIM_FAIL_MARKER,
    SIM_NAN_MARKER,
    SimBackend,
    SimEncoding,
    _truncated_pair_lengths,
    build_sim_backend,
    count_tokens,
    encode,
    expected_chunked_vector,
    expected_vector,
    split_tokens,
)
from tokenq.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit

# Letters, digits, punctuation, spaces of several kinds, CJK, kana, hangul, emoji.
texts = st.text(
    alphabet=st.sampled_from(list("ab zé9_,.!?-'\t\n\u00a0\u3000日本語テキスト한국어😀")),
    max_size=60,
)


def test_english_token_count() -> None:
    assert split_tokens("Hello, world! It's 2024.") == [
        "Hello", ",", "world", "!", "It", "'", "s", "2024", ".",
    ]  # fmt: skip
    assert count_tokens("Hello, world!") == 4 + 2


def test_cjk_one_token_per_character() -> None:
    assert split_tokens("日本語のテキスト") == list("日本語のテキスト")
    assert count_tokens("한국어 text") == 3 + 1 + 2
    # A word run stops at a CJK character, which counts alone.
    assert split_tokens("abc日本def") == ["abc", "日", "本", "def"]


def test_pair_adds_three_special_tokens() -> None:
    assert count_tokens("a b", "c") == 3 + 3
    backend = SimBackend()
    (encoding,) = backend.tokenize([TextInput("a b", "c")], None)
    assert encoding.length == 6


@given(texts)
def test_tokens_cover_every_non_space_character(text: str) -> None:
    tokens = split_tokens(text)
    assert "".join(tokens) == "".join(text.split())
    assert all(token and not any(ch.isspace() for ch in token) for token in tokens)
    assert count_tokens(text) == len(tokens) + 2


@given(texts, st.integers(min_value=2, max_value=40))
def test_truncation_keeps_length_consistent(text: str, max_length: int) -> None:
    encoding = encode(text, max_length=max_length)
    assert encoding.length == min(count_tokens(text), max_length)
    assert encoding.length == len(encoding.tokens) + 2
    assert list(encoding.tokens) == split_tokens(text)[: max_length - 2]


@given(texts, texts, st.integers(min_value=3, max_value=40))
def test_pair_truncation_fits_and_is_consistent(first: str, second: str, max_length: int) -> None:
    encoding = encode(first, second, max_length)
    assert encoding.pair_tokens is not None
    assert encoding.length == min(count_tokens(first, second), max_length)
    assert encoding.length == len(encoding.tokens) + len(encoding.pair_tokens) + 3
    assert list(encoding.tokens) == split_tokens(first)[: len(encoding.tokens)]
    assert list(encoding.pair_tokens) == split_tokens(second)[: len(encoding.pair_tokens)]


def _longest_first(first: int, second: int, room: int) -> tuple[int, int]:
    """Hugging Face's longest_first, one token at a time (the reference)."""
    while first + second > room:
        if first > second:
            first -= 1
        else:
            second -= 1
    return first, second


@given(st.integers(0, 300), st.integers(0, 300), st.integers(0, 300))
def test_pair_truncation_matches_longest_first(first: int, second: int, room: int) -> None:
    assert _truncated_pair_lengths(first, second, room) == _longest_first(first, second, room)


def test_max_length_below_special_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="special tokens"):
        encode("a", "b", max_length=2)


def test_vectors_are_deterministic_unit_float32() -> None:
    first = expected_vector("the quick brown fox", 48)
    again = expected_vector("the quick brown fox", 48)
    other = expected_vector("the quick brown dog", 48)
    assert first.dtype == np.float32 and first.shape == (48,)
    assert np.array_equal(first, again)
    assert not np.allclose(first, other)
    assert np.linalg.norm(first) == pytest.approx(1.0, abs=1e-6)
    # Whitespace is not a token, so it does not change the vector.
    assert np.array_equal(first, expected_vector("the  quick\nbrown fox", 48))
    # A pair is not the concatenation of its sides.
    assert not np.allclose(expected_vector("a", 48, text_pair="b"), expected_vector("a b", 48))


def test_vector_follows_the_tokens_kept_after_truncation() -> None:
    long_text = " ".join(f"w{i}" for i in range(100))
    truncated = expected_vector(long_text, 16, max_input_tokens=10)
    assert np.array_equal(truncated, expected_vector(" ".join(f"w{i}" for i in range(8)), 16))
    assert not np.allclose(truncated, expected_vector(long_text, 16))


@given(st.integers(0, 40), st.integers(0, 40), st.integers(4, 30), st.booleans())
def test_an_encoding_is_truncated_exactly_when_tokens_were_cut(
    first: int, second: int, max_length: int, paired: bool,
) -> None:
    text = " ".join(f"w{i}" for i in range(first))
    pair = " ".join(f"p{i}" for i in range(second)) if paired else None
    whole, cut = sim.encode(text, pair), sim.encode(text, pair, max_length)
    assert cut.truncated == (whole.length > max_length) and not whole.truncated


def test_the_pipeline_asks_the_tokenizer_again_only_when_an_encoding_cannot_tell() -> None:
    """``truncated`` from the backend is taken as it is; an encoding without it, at the
    limit, is tokenized again whole (once, for those only) to tell."""
    from types import SimpleNamespace

    from tokenq.worker.pipeline.pipeline import Pipeline

    calls: list[int] = []

    def tokenize(inputs, max_length):
        calls.append(len(inputs))
        return [SimpleNamespace(length=len(item.text.split()) + 2) for item in inputs]

    stub = SimpleNamespace(tokenizer=SimpleNamespace(tokenize=tokenize))
    inputs = [TextInput(" ".join(["w"] * n)) for n in (3, 8, 8, 9)]
    told = [sim.encode(item.text, None, 10) for item in inputs]
    assert Pipeline._cut(stub, inputs, told, 10) == {3} and calls == []
    bare = [SimpleNamespace(length=min(e.length, 10)) for e in told]
    assert Pipeline._cut(stub, inputs, bare, 10) == {3} and calls == [3]  # the three at 10


def test_run_returns_expected_vectors_in_order() -> None:
    backend = SimBackend(dim=24, max_input_tokens=16)
    inputs = [TextInput(t) for t in ["short", "a somewhat longer text here", "日本語", "x " * 50]]
    encodings = backend.tokenize(inputs, 16)
    outputs = backend.run(encodings)
    assert [e.length for e in encodings] == [3, 7, 5, 16]
    for item, output in zip(inputs, outputs, strict=True):
        assert np.array_equal(output, expected_vector(item.text, 24, 16))
    assert backend.batches == 1 and backend.rows == 4
    assert backend.peak_memory_bytes == 4 * 16 * backend.bytes_per_token


def test_out_of_memory_above_capacity() -> None:
    backend = SimBackend(max_input_tokens=100, bytes_per_token=10, capacity_bytes=10 * 250)
    fits = [encode("x " * 48, max_length=100)] * 5  # 5 x 50 = 250 tokens
    backend.run(fits)
    with pytest.raises(DeviceOutOfMemory) as raised:
        backend.run([*fits, fits[0]])  # 300 tokens
    assert "3000" in str(raised.value) and "2500" in str(raised.value)
    assert backend.oom_events == 1
    assert backend.batches == 1
    assert backend.peak_memory_bytes == 2500


def test_ragged_cost_is_the_sum_of_lengths() -> None:
    long, short = encode("x " * 98), encode("y")  # 100 and 3 tokens
    padded = SimBackend(max_input_tokens=100, bytes_per_token=1, capacity_bytes=150)
    ragged = SimBackend(max_input_tokens=100, bytes_per_token=1, capacity_bytes=150, ragged=True)
    assert padded.cost([long, short]) == 200
    assert ragged.cost([long, short]) == 103
    with pytest.raises(DeviceOutOfMemory):
        padded.run([long, short])
    assert len(ragged.run([long, short])) == 2
    assert ragged.info.padded is False


def test_time_grows_with_the_batch() -> None:
    backend = SimBackend(max_input_tokens=2048, batch_ms=20, token_us=10)
    started = time.perf_counter()
    backend.run([encode("x")])
    small = time.perf_counter() - started
    started = time.perf_counter()
    backend.run([encode("x " * 2000, max_length=2048)] * 2)  # + 2 x 2002 x 10us = ~40 ms
    large = time.perf_counter() - started
    assert small >= 0.015
    assert large > small
    assert backend.busy_s == pytest.approx((20_000 + 3 * 10) / 1e6 + (20_000 + 4004 * 10) / 1e6)


def test_fail_marker_poisons_the_whole_batch() -> None:
    backend = SimBackend()
    batch = backend.tokenize([TextInput("fine"), TextInput(f"bad {SIM_FAIL_MARKER}")], None)
    with pytest.raises(ValueError, match="tokenq-sim-fail"):
        backend.run(batch)
    assert backend.failures == 1
    assert len(backend.run(batch[:1])) == 1


def test_nan_marker_spoils_only_its_row() -> None:
    backend = SimBackend()
    outputs = backend.run(backend.tokenize([TextInput("ok"), TextInput(SIM_NAN_MARKER)], None))
    assert np.isfinite(outputs[0]).all()
    assert np.isnan(outputs[1]).all()


def test_row_longer_than_the_model_is_refused() -> None:
    backend = SimBackend(max_input_tokens=8)
    (encoding,) = backend.tokenize([TextInput("x " * 20)], None)  # no truncation asked
    with pytest.raises(ValueError, match="max_input_tokens 8"):
        backend.run([encoding])


def test_run_refuses_foreign_encodings_and_runs_nothing_when_empty() -> None:
    backend = SimBackend()
    assert backend.run([]) == []
    with pytest.raises(TypeError):
        backend.run([object()])  # type: ignore[list-item]


def test_build_from_settings() -> None:
    settings = WorkerSettings(
        backend="sim", sim_dim=7, sim_max_input_tokens=99, sim_ragged=True,
        sim_capacity_bytes=123_456,
    )
    backend = build_sim_backend(settings)
    assert isinstance(backend, Backend)
    assert backend.info.name == "sim" and backend.info.model == "sim"
    assert backend.info.task == "embed"
    assert (backend.info.dim, backend.info.max_input_tokens) == (7, 99)
    assert backend.info.padded is False
    assert backend.capacity_bytes == 123_456
    assert backend.run(backend.tokenize([TextInput("hi")], 99))[0].shape == (7,)


def test_too_short_max_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_input_tokens=2"):
        SimBackend(max_input_tokens=2)


def test_closed_backend_refuses_to_run() -> None:
    backend = SimBackend()
    backend.close()
    with pytest.raises(RuntimeError):
        backend.run([encode("x")])


def test_windows_cover_an_over_long_input_with_overlap() -> None:
    backend = SimBackend(max_input_tokens=12)
    words = [f"w{i}" for i in range(30)]
    encoding = encode(" ".join(words))  # 32 tokens, untruncated (the chunk policy)
    windows = backend.windows(encoding, 12, 2)
    # 10 content tokens per window, consecutive windows share 2.
    assert [list(w.tokens) for w in windows] == [
        words[0:10],
        words[8:18],
        words[16:26],
        words[24:30],
    ]
    assert [w.length for w in windows] == [12, 12, 12, 8]
    assert backend.windows(encode("short"), 12, 2) == [encode("short")]
    with pytest.raises(ValueError, match="pair"):
        backend.windows(encode("a " * 20, "b"), 12, 2)
    with pytest.raises(ValueError, match="exceeds"):
        backend.windows(encoding, 13, 2)


def test_expected_chunked_vector_is_the_weighted_mean_of_the_windows() -> None:
    backend = SimBackend(dim=DIM_CHUNK, max_input_tokens=12)
    text = " ".join(f"w{i}" for i in range(30))
    windows = backend.windows(encode(text), 12, 2)
    vectors = backend.run(windows)
    weights = np.array([w.length for w in windows], dtype=np.float64)
    mean = weights @ np.stack(vectors).astype(np.float64) / weights.sum()
    expected = (mean / np.linalg.norm(mean)).astype(np.float32)
    got = expected_chunked_vector(text, DIM_CHUNK, 12, 2)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-6)
    # A text that fits is answered whole.
    assert np.array_equal(
        expected_chunked_vector("short", DIM_CHUNK, 12, 2), expected_vector("short", DIM_CHUNK)
    )


DIM_CHUNK = 24


def test_encoding_is_small_and_frozen() -> None:
    encoding = encode("hello there")
    assert isinstance(encoding, SimEncoding)
    with pytest.raises(AttributeError):
        encoding.length = 5  # type: ignore[misc]


# Every class of character the sim tells apart, plus astral ones inside and
# outside the CJK ranges and a lone surrogate.
_ANY_CLASS = [
    *"ab zé9_,.!?-'\t\n\x1c\x00\u00a0\u2028\u3000日本語テキスト한국어ｱ",
    "\U00020001", "\U0001f600", "\ud800", "\u0663", "\u00b2",
]
long_texts = st.text(alphabet=st.sampled_from(_ANY_CLASS), min_size=0, max_size=700)


def test_every_bmp_character_is_classed_as_the_regex_sees_it() -> None:
    """The bulk tokenizer's class table against the reference regex, character by character."""
    table = sim._bmp_classes()
    wrong = [
        code for code in range(0x10000)
        if sim._ScannedTokens.of(f"a{chr(code)}a").count != len(split_tokens(f"a{chr(code)}a"))
        or (table[code] == sim._SPACE) != bool(split_tokens(chr(code)) == [])
    ]
    assert wrong == []


@given(long_texts, st.data())
def test_bulk_and_regex_tokenizers_agree(text: str, data: st.DataObject) -> None:
    """Both paths give the same tokens: count, and canonical form of any run of them."""
    scanned, matched = sim._ScannedTokens.of(text), sim._MatchedTokens(split_tokens(text))
    assert scanned.count == matched.count
    first = data.draw(st.integers(0, matched.count))
    last = data.draw(st.integers(first, matched.count))
    assert scanned.canonical(first, last) == matched.canonical(first, last)


@given(long_texts, long_texts)
def test_vector_depends_on_the_tokens_alone(text: str, spacing: str) -> None:
    """Re-spacing a text's tokens changes nothing, on either path (long or short text)."""
    tokens = split_tokens(text)
    gaps = [" " * (1 + len(spacing) % 3), "\n"]
    respaced = "".join(token + gaps[i % 2] for i, token in enumerate(tokens))
    assert encode(text).digest == encode(respaced).digest
    assert encode(text).length == len(tokens) + 2
    if len(tokens) > 1:  # a different split of the same characters is another vector
        merged = "".join(tokens[:2]) + " " + " ".join(tokens[2:])
        if split_tokens(merged) != tokens:
            assert encode(merged).digest != encode(text).digest
