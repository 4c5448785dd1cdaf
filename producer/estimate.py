"""A fast, dependency-free guess of how many tokens a text will cost.

Why a guess at all: the producer runs in a web backend that must not load a
tokenizer (no torch, no transformers, no 500 MB of vocabulary per process),
yet the worker wants a token count with every request so it can read "about
two budgets of estimated tokens ahead" without tokenizing what it may never
run. The worker tokenizes exactly before packing, so this number only steers
read-ahead; it must be cheap, roughly right, and never zero.

The rules follow what BERT's WordPiece tokenizer (the family most embedding
and reranking models use) does to text, calibrated against
``bert-base-uncased``:

* **CJK** ideographs, kana and hangul: BERT's basic tokenizer puts spaces
  around every CJK ideograph, so each becomes its own token; kana and hangul
  syllables come out at about one token per character in multilingual
  vocabularies too. One token each.
* **Latin words** (accents included): common words are one vocabulary
  entry; long, rare words split into a stem and ``##`` suffixes of several
  characters each. One token per word plus one per further 7 characters
  (``tokenization`` -> 2).
* **Other letters** (Cyrillic, Greek, Arabic, Hebrew, Indic, Thai, ...):
  vocabularies hold far fewer whole words of these scripts, so pieces are
  shorter: one token plus one per further 3 characters.
* **Digits**: numbers split into pieces of a few digits: one plus one per
  further 4 digits.
* **Punctuation**: the basic tokenizer splits every punctuation character
  (all ASCII punctuation and symbols, and Unicode's ``P*`` categories) off
  as its own token. One token each.
* **Other symbols** (emoji, box drawing, arrows, currency signs outside
  ASCII): these are *not* split off, so a glued run such as ``😀😀😀`` or
  ``╭───╮`` is one word, which WordPiece turns into a single ``[UNK]`` when
  any piece is missing from the vocabulary (or one piece per symbol when
  all are present). One token per run: counting each symbol made CLI help
  text with box drawing come out at 3-4x the real count, enough to
  refuse a request the worker would accept (see docs/ESTIMATES.md).
  Control and format characters (zero-width joiners) are dropped, as BERT's
  text cleaning drops them.
* **Very long words**: WordPiece gives up on a word over 100 characters and
  emits one ``[UNK]``; a letter or digit run that long (a hash, a blob)
  counts 1.
* **Special tokens**: ``[CLS] ... [SEP]`` adds 2; a pair adds a second
  ``[SEP]``, so 3.

Two regular-expression passes do the work in C, so a 10 kB text costs well
under a millisecond. A caller whose model tokenizes very differently (a
SentencePiece model, a byte-level BPE) plugs its own estimator into the client.
"""

from __future__ import annotations

import re
import unicodedata

SPECIAL_TOKENS = 2
"""``[CLS]`` and ``[SEP]`` around a single text."""

SPECIAL_TOKENS_PAIR = 3
"""``[CLS] a [SEP] b [SEP]`` for a query/passage pair."""

_CJK = re.compile(
    "["
    "\u1100-\u11ff"  # Hangul Jamo
    "\u3040-\u309f"  # Hiragana
    "\u30a0-\u30ff"  # Katakana
    "\u3130-\u318f"  # Hangul compatibility Jamo
    "\u31f0-\u31ff"  # Katakana phonetic extensions
    "\u3400-\u4dbf"  # CJK unified ideographs extension A
    "\u4e00-\u9fff"  # CJK unified ideographs
    "\uac00-\ud7af"  # Hangul syllables
    "\uf900-\ufaff"  # CJK compatibility ideographs
    "\U00020000-\U0002fa1f"  # CJK extensions B-F and compatibility supplement
    "]"
)
# Combining marks (accents written apart, Hebrew/Arabic vowel points, the
# vowel signs of Indic and Thai scripts) are not "word" characters to \w, yet
# they belong to the word they sit in, not to the punctuation count.
_MARKS = (
    "\u0300-\u036f\u0483-\u0489\u0591-\u05c7\u0610-\u061a\u064b-\u065f"
    "\u0900-\u0dff\u0e00-\u0eff\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f"
)
_LETTERS = re.compile(rf"(?:[^\W\d_]|[{_MARKS}])+")
_DIGITS = re.compile(r"\d+")
_ASCII_PUNCT = re.compile(r"[!-/:-@\[-`{-~]")  # BERT calls every one of these punctuation
# Everything else that is neither a word character, a space nor a mark:
# Unicode punctuation, symbols, control and format characters.
_NON_ASCII_OTHER = re.compile(rf"[^\w\s\x00-\x7f{_MARKS}]+")
_MAX_WORD_CHARS = 100
"""WordPiece's ``max_input_chars_per_word``: a longer word becomes one ``[UNK]``."""

_LATIN_PIECE = 7
# Latin up to Extended-B plus combining accents: accented Latin splits like ASCII.
_NOT_LATIN = re.compile("[^\u0000-\u024f\u0300-\u036f]")
_OTHER_PIECE = 3
_DIGIT_PIECE = 4


def estimate_tokens(text: str, text_pair: str | None = None) -> int:
    """Estimated token count of ``text`` (and ``text_pair``), special tokens included.

    Pure and deterministic; see the module docstring for why each rule is
    what it is. Always at least the number of special tokens.
    """
    total = _count(text)
    if text_pair is None:
        return total + SPECIAL_TOKENS
    return total + _count(text_pair) + SPECIAL_TOKENS_PAIR


def _count(text: str) -> int:
    """Tokens of one text without special tokens."""
    cjk = len(_CJK.findall(text))
    if cjk:
        # Blank the CJK characters out so the letter pass does not glue them
        # (they are "letters" to \w) onto neighbouring Latin words.
        text = _CJK.sub(" ", text)
    tokens = cjk
    for word in _LETTERS.findall(text):
        if len(word) > _MAX_WORD_CHARS:
            tokens += 1
            continue
        latin = word.isascii() or _NOT_LATIN.search(word) is None
        piece = _LATIN_PIECE if latin else _OTHER_PIECE
        tokens += 1 + (len(word) - 1) // piece
    for number in _DIGITS.findall(text):
        tokens += 1 if len(number) > _MAX_WORD_CHARS else 1 + (len(number) - 1) // _DIGIT_PIECE
    tokens += len(_ASCII_PUNCT.findall(text))
    for run in _NON_ASCII_OTHER.findall(text):
        tokens += _symbol_run(run)
    return tokens


def _symbol_run(run: str) -> int:
    """Tokens of a run of non-ASCII punctuation, symbols and invisible characters.

    Punctuation (``P*``) is split off one by one; control and format
    characters (``C*``) vanish; what is left between them is glued into one
    word, counted once.
    """
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
