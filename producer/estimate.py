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

How it counts, fast: no Python code runs per word, only per distinct word
length (a ``Counter`` over lengths, in C), except that a text with letters of
non-Latin scripts sorts its words into Latin and other in Python. ASCII text is counted on its
bytes (``translate`` and ``split``); text of ASCII, CJK and punctuation
likewise once the CJK and punctuation are counted and blanked; any other
text is first mapped to a string of one-letter character classes (one
``str.translate`` through a cached table) and counted on that. So an English
1,500-token passage costs about 80 us, a Chinese-English text of 3,000
characters about 50 us, and a text off those paths about 40 ns a character
(docs/ESTIMATES.md). The rules themselves are
checked word by word against these shortcuts in the tests. A caller whose
model tokenizes very differently (a SentencePiece model, a byte-level BPE)
plugs its own estimator into the client.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable

SPECIAL_TOKENS = 2
"""``[CLS]`` and ``[SEP]`` around a single text."""

SPECIAL_TOKENS_PAIR = 3
"""``[CLS] a [SEP] b [SEP]`` for a query/passage pair."""

_CJK_RANGES = (
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
)
_CJK = re.compile(f"[{_CJK_RANGES}]")
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
    if text.isascii():  # the common case: no CJK, marks or non-ASCII symbols to look for
        return _count_ascii(text.encode("ascii"))
    if _BEYOND_ONE_EACH.search(text) is None:
        # ASCII plus characters that are one token each and split words (CJK,
        # punctuation): count those, blank them, and count the rest as ASCII.
        data = text.encode("utf-8")
        ascii_bytes = len(data.translate(None, _HIGH_BYTES))
        return len(text) - ascii_bytes + _count_ascii(data.translate(_HIGH_TO_SPACE))
    return _count_classes(text.translate(_CLASSES))


class _Classes(dict[int, str]):
    """Code point -> its one-letter class under the rules, computed once per character.

    ``c`` CJK; ``a`` a letter (or mark) of the Latin range, ``o`` of another
    script, ``D`` such a letter that is also a decimal digit (Devanagari,
    Thai: the rules count it as both); ``0`` a digit; ``p`` punctuation (one
    token each); ``s`` a symbol (glued runs count once); ``x`` a control or
    format character (dropped: it ends words but not a glued run); `` ``
    anything else (spaces, ``_``). Bounded, so hostile text cannot grow it
    without end; past the bound a character is classified each time.
    """

    LIMIT = 1 << 16

    def __missing__(self, code: int) -> str:
        kind = _classify(chr(code))
        if len(self) < self.LIMIT:
            self[code] = kind
        return kind


def _classify(char: str) -> str:
    if _CJK.match(char):
        return "c"
    letter = _LETTERS.match(char) is not None
    digit = _DIGITS.match(char) is not None
    if letter:
        latin = _NOT_LATIN.match(char) is None
        return "D" if digit and not latin else "a" if latin else "o"
    if digit:
        return "0"
    if _ASCII_PUNCT.match(char):
        return "p"
    if _NON_ASCII_OTHER.match(char):
        kind = unicodedata.category(char)[0]
        return "p" if kind == "P" else "x" if kind == "C" else "s"
    return " "


_CLASSES = _Classes()


def _runs_of(keep: dict[str, str]) -> bytes:
    """A ``bytes.translate`` table over class letters: ``keep`` mapped, the rest spaces."""
    table = bytearray(b" " * 256)
    for kind, mark in keep.items():
        table[ord(kind)] = ord(mark)
    return bytes(table)


_LETTER_RUNS = _runs_of({"a": "a", "o": "o", "D": "o"})
_DIGIT_RUNS = _runs_of({"0": "0", "D": "0"})
_GLUED_RUNS = _runs_of({"s": "s", "x": "x"})


def _count_classes(classes: str) -> int:
    """:func:`_count` of a text from its class string (see :class:`_Classes`)."""
    kinds = classes.encode("ascii")
    words = kinds.translate(_LETTER_RUNS).split()
    if b"o" in kinds or b"D" in kinds:
        other = [word for word in words if b"o" in word]
        latin = [word for word in words if b"o" not in word]
        letters = _pieces(latin, _LATIN_PIECE) + _pieces(other, _OTHER_PIECE)
    else:
        letters = _pieces(words, _LATIN_PIECE)
    return (
        kinds.count(b"c")
        + letters
        + _pieces(kinds.translate(_DIGIT_RUNS).split(), _DIGIT_PIECE)
        + kinds.count(b"p")
        + len(kinds.translate(_GLUED_RUNS, b"x").split())
    )


def _only(keep: bytes, mark: int) -> bytes:
    """A ``bytes.translate`` table: ``keep`` become ``mark``, every other byte a space."""
    table = bytearray(b" " * 256)
    for byte in keep:
        table[byte] = mark
    return bytes(table)


def _one_token_punctuation() -> str:
    """Non-ASCII punctuation (``P*``) of the common blocks, as a character-class body.

    Each such character is split off as one token and ends any word it
    touches, exactly like a CJK character, so texts of ASCII, CJK and these
    take the fast path of :func:`_count`.
    """
    blocks = [(0x00A0, 0x00FF), (0x2000, 0x206F), (0x3000, 0x303F), (0xFE30, 0xFE4F),
              (0xFF00, 0xFFEF)]
    chars = [
        chr(code) for low, high in blocks for code in range(low, high + 1)
        if unicodedata.category(chr(code)).startswith("P") and _NON_ASCII_OTHER.match(chr(code))
    ]
    return "".join(re.escape(char) for char in chars)


_BEYOND_ONE_EACH = re.compile(f"[^\x00-\x7f{_CJK_RANGES}{_one_token_punctuation()}]")
"""A character outside ASCII, CJK and one-token punctuation (the fast paths' domain)."""
_HIGH_BYTES = bytes(range(0x80, 0x100))
_HIGH_TO_SPACE = bytes(range(0x80)) + b" " * 0x80

_ASCII_LETTERS = bytes(range(ord("a"), ord("z") + 1)) + bytes(range(ord("A"), ord("Z") + 1))
_ONLY_LETTERS = _only(_ASCII_LETTERS, ord("a"))
_ONLY_DIGITS = _only(b"0123456789", ord("0"))
_PUNCTUATION = bytes(c for c in range(0x21, 0x7f) if _ASCII_PUNCT.match(chr(c)))


def _count_ascii(data: bytes) -> int:
    """:func:`_count` of an ASCII text, by byte translation instead of regular expressions.

    The same rules (letters, digits, ASCII punctuation are all there is), at
    a tenth of the cost: ``translate`` and ``split`` find the runs in C.
    """
    return (
        _pieces(data.translate(_ONLY_LETTERS).split(), _LATIN_PIECE)
        + _pieces(data.translate(_ONLY_DIGITS).split(), _DIGIT_PIECE)
        + len(data) - len(data.translate(None, _PUNCTUATION))
    )


def _pieces(words: Iterable[str | bytes], piece: int) -> int:
    """Tokens of words that split into a first piece and one per further ``piece`` characters.

    A word over :data:`_MAX_WORD_CHARS` is one ``[UNK]``. Counted per distinct
    length (``Counter`` runs in C), so the cost does not grow with the words.
    """
    return sum(
        count * (1 if length > _MAX_WORD_CHARS else 1 + (length - 1) // piece)
        for length, count in Counter(map(len, words)).items()
    )

