"""A fast, dependency-free guess of how many tokens a text will cost.

Why a guess at all: the producer runs in a web backend that must not load a
tokenizer (no torch, no transformers, no 500 MB of vocabulary per process),
yet the worker wants a token count with every request so it can read "about
four budgets of estimated tokens ahead" without tokenizing what it may never
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

How it counts, fast: no Python code runs per character, nor per word but,
in a text with letters of non-Latin scripts, to find the words that hold
them. Each view of a text (its Latin letters, its digits) is one
``bytes.translate`` of its bytes (UTF-8, or one ``?`` a character when it
is mostly CJK), and words are counted by deleting every group of 7 letters
(4 digits) with ``bytes.replace`` and counting the groups deleted and the
words left with ``bytes.count``; deleting the rest of ASCII leaves the
one-token characters (punctuation, CJK). Characters no byte table can see
as they are (an ``ã``, a ``〇``, an emoji) are looked for in that short
remainder, not in the text, and each distinct one is replaced all through
the text by an ASCII stand-in of its class (``str.replace``). A text with
more than 32 distinct ones (Russian, Greek, Hindi prose) is instead mapped
to a string of one-letter classes first (one ``str.translate`` through a
cached table, the slowest path). On the benchmark's seed mix this costs a
quarter of what counting word lengths did, and a ``〇`` beside Chinese no
longer makes a text five times dearer (docs/ESTIMATES.md). The rules
themselves are checked word by word against every path in the tests. A
caller whose model tokenizes very differently (a SentencePiece model, a
byte-level BPE) plugs its own estimator into the client.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence
from typing import NamedTuple

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
    data = text.encode("utf-8", "surrogatepass")  # a lone surrogate is a character too
    if len(data) > 2 * len(text):
        # Mostly CJK: searched as it is, and counted one byte a character
        # rather than three.
        return _count_standing_in(text, text)
    # Deleting the rest of ASCII leaves its punctuation and every non-ASCII
    # character whole: a much shorter text to search than the text itself.
    chars = data.translate(None, _NOT_ONE_EACH).decode("utf-8", "surrogatepass")
    if _BEYOND_ONE_EACH.search(chars) is None:  # ASCII plus CJK and punctuation
        return _tally(data, _TEXT_VIEWS, len(chars))
    return _count_standing_in(text, chars)


class _Views(NamedTuple):
    """``bytes.translate`` tables that turn one alphabet into the runs the rules count.

    Each table maps the bytes of its kind to one letter and every other byte
    to a space, so that a run of that letter is a word of that kind.
    """

    latin: bytes
    """Latin letters to ``a``: letters of other scripts end a run here."""
    scripts: bytes
    """Latin letters to ``a``, letters of other scripts to ``o``: whole words."""
    digits: bytes
    """Digits to ``a`` (the letter :func:`_run_tokens` counts runs of)."""
    not_digits: bytes
    """Every byte but the digits': deleting them says whether there is a number at all."""
    glued: bytes
    """Symbols to ``s`` (glued runs count once)."""
    invisible: bytes
    """What to delete before finding glued runs: control and format characters."""


def _table(kinds: dict[bytes, bytes]) -> bytes:
    """A ``bytes.translate`` table: each byte of a key becomes its value, every other a space."""
    table = bytearray(b" " * 256)
    for keys, value in kinds.items():
        for byte in keys:
            table[byte] = value[0]
    return bytes(table)


_PUNCTUATION = bytes(c for c in range(0x21, 0x7f) if _ASCII_PUNCT.match(chr(c)))
_NOT_ONE_EACH = bytes(c for c in range(0x80) if c not in _PUNCTUATION)
"""Deleted from a text's UTF-8, these leave what costs one token per character
(ASCII punctuation) and the non-ASCII characters whole."""
_ASCII_LETTERS = bytes(range(ord("a"), ord("z") + 1)) + bytes(range(ord("A"), ord("Z") + 1))

# Stand-ins for the classes of characters that ASCII has no example of. They
# are control characters, which the rules count as spaces, so a text holding
# one already cannot use them (it takes the class path instead).
_OTHER_LETTER = "\x01"
_SYMBOL = "\x02"
_INVISIBLE = "\x03"
_STAND_INS = {
    "a": "a", "0": "0", " ": " ", "p": "!", "c": "!",
    "o": _OTHER_LETTER, "s": _SYMBOL, "x": _INVISIBLE,
}
"""ASCII stand-in of each class of :class:`_Classes` but ``D``, a letter that is
also a digit: its stand-in would have to be a digit in the digit view, which
every text shares and where control characters are spaces."""
_CONTROL_STAND_INS = (_OTHER_LETTER, _SYMBOL, _INVISIBLE)

_TEXT_VIEWS = _Views(
    latin=_table({_ASCII_LETTERS: b"a"}),
    scripts=_table({_ASCII_LETTERS: b"a", _OTHER_LETTER.encode(): b"o"}),
    digits=_table({b"0123456789": b"a"}),
    not_digits=bytes(set(range(256)) - set(b"0123456789")),
    glued=_table({_SYMBOL.encode(): b"s"}),
    invisible=_INVISIBLE.encode(),
)
"""Views of a text's UTF-8 bytes whose characters are ASCII, one token each
(CJK, punctuation) or ASCII stand-ins."""

_CLASS_VIEWS = _Views(
    latin=_table({b"a": b"a"}),
    scripts=_table({b"a": b"a", b"oD": b"o"}),
    digits=_table({b"0D": b"a"}),
    not_digits=bytes(set(range(256)) - set(b"0D")),
    glued=_table({b"s": b"s"}),
    invisible=b"x",
)
"""Views of a class string (see :class:`_Classes`)."""

_MAX_STAND_INS = 32
"""Most distinct characters a text may have replaced by stand-ins; past it, the
class path. Each costs about two passes over the text, so stand-ins cost as
much as the class string at about 50 distinct characters of 6,000 (measured
on Cyrillic words); at 32, French, Portuguese and Vietnamese prose come out
4-6x cheaper than through the class string, and a text past the bound (Russian,
Greek, Hindi prose) pays about a third more than the class path alone for
having looked."""


def _count_standing_in(text: str, haystack: str) -> int:
    """:func:`_count` of a text that may hold characters the byte views cannot see as they are.

    ``haystack`` holds every non-ASCII character of ``text`` (it is the text,
    or just those and ASCII punctuation). Each distinct character outside
    ASCII, CJK and one-token punctuation is replaced, all through the text,
    by the ASCII stand-in of its class, and what is left outside ASCII
    counts one token a character, like the ``?`` it is encoded as. Few
    distinct ones (an accented name, a ``〇`` in Chinese) make a few
    ``str.replace`` passes, far cheaper than classifying every character.
    They are all found, in ``haystack`` (which shrinks as they go), before
    any is replaced, so a text with too many pays for finding them only.
    """
    stand_ins: dict[str, str] = {}
    found = _BEYOND_ONE_EACH.search(haystack)
    while found is not None:
        char = found.group()
        stand_in = _STAND_INS.get(_CLASSES[ord(char)])
        if stand_in is None or len(stand_ins) == _MAX_STAND_INS:
            return _count_classes(text)
        stand_ins[char] = stand_in
        haystack = haystack.replace(char, "")
        found = _BEYOND_ONE_EACH.search(haystack, found.start())
    used = set(stand_ins.values())
    if not used.isdisjoint(_CONTROL_STAND_INS) and any(c in text for c in _CONTROL_STAND_INS):
        return _count_classes(text)  # the text holds one itself, which the views would misread
    for char, stand_in in stand_ins.items():
        text = text.replace(char, stand_in)
    return _count_ascii(
        text.encode("ascii", "replace"), other=_OTHER_LETTER in used, symbols=_SYMBOL in used,
    )


def _count_ascii(data: bytes, *, other: bool = False, symbols: bool = False) -> int:
    """:func:`_count` of a text as ASCII bytes, stand-ins included (see :func:`_tally`)."""
    one_each = len(data.translate(None, _NOT_ONE_EACH))  # punctuation, and "?" for CJK
    return _tally(data, _TEXT_VIEWS, one_each, other=other, symbols=symbols)


def _count_classes(text: str) -> int:
    """:func:`_count` of any text, through its class string (see :class:`_Classes`)."""
    kinds = text.translate(_CLASSES).encode("ascii")
    return _tally(
        kinds, _CLASS_VIEWS, kinds.count(b"c") + kinds.count(b"p"),
        other=b"o" in kinds or b"D" in kinds, symbols=b"s" in kinds,
    )


def _tally(
    data: bytes, views: _Views, one_each: int, *, other: bool = False, symbols: bool = False,
) -> int:
    """Tokens of a text given as ``data`` in the alphabet of ``views``.

    ``one_each`` is the number of characters that are one token each (CJK,
    punctuation); ``other`` says whether there are letters of non-Latin
    scripts, ``symbols`` whether there are symbols, so that a text without
    them skips their passes.
    """
    tokens = one_each + _run_tokens(data.translate(views.latin), _LATIN_PIECE)
    # Numbers are sparse: most texts have none (one deletion says so), and the
    # rest are joined first and counted on a short string.
    if data.translate(None, views.not_digits):
        tokens += _run_tokens(b" ".join(data.translate(views.digits).split()), _DIGIT_PIECE)
    if other:
        tokens += _other_script_tokens(data.translate(views.scripts))
    if symbols:
        tokens += len(data.translate(views.glued, views.invisible).split())
    return tokens


_TOO_LONG = b"a" * (_MAX_WORD_CHARS + 1)


def _run_tokens(runs: bytes, piece: int) -> int:
    """Tokens of the runs of ``a`` in ``runs`` (every other byte a space) as words that
    split into a first piece and one per further ``piece`` characters.

    A word of n letters is ceil(n / piece) tokens. Deleting every group of
    ``piece`` letters (``bytes.replace``, left to right) leaves each word's
    remainder, so the groups deleted plus the runs left is the count: no
    Python per word, and no word objects (splitting into words and counting
    their lengths cost twice as much). A text with a word over the WordPiece
    limit (rare: a hash, a blob) is counted word by word instead.
    """
    if _TOO_LONG in runs:
        return _pieces(runs.split(), piece)
    rest = runs.replace(b"a" * piece, b"")
    groups = (len(runs) - len(rest)) // piece
    return groups + rest.count(b"a ") + rest.endswith(b"a")  # ends: measured faster than starts


_FEW_OTHER_LETTERS = 16
"""Up to this many letters of other scripts, their words are found from each
letter (Python per such word); past it, by splitting the text into words (C
per word of the text), cheaper once such words are many."""


def _other_script_tokens(scripts: bytes) -> int:
    """What words holding letters of non-Latin scripts add to the Latin count.

    ``scripts`` shows Latin letters as ``a`` and others as ``o``. Such a word
    costs one token per 3 characters, not 7, over its whole length, while
    the Latin count (which sees ``o`` as a space) counted its Latin
    fragments: this is the difference.
    """
    if scripts.count(b"o") > _FEW_OTHER_LETTERS:
        words = [word for word in scripts.split() if _O in word]
    else:
        words = list(_words_around(scripts, b"o"))
    joined = b" ".join(words)
    return (
        _run_tokens(joined.translate(_WHOLE_WORDS), _OTHER_PIECE)
        - _run_tokens(joined.translate(_LATIN_FRAGMENTS), _LATIN_PIECE)
    )


_O = ord("o")
"""An int, not ``b"o"``: ``int in bytes`` is a ``memchr``, ten times faster."""
_WHOLE_WORDS = _table({b"ao": b"a"})
_LATIN_FRAGMENTS = _table({b"a": b"a"})


def _words_around(runs: bytes, letter: bytes) -> Iterable[bytes]:
    """The space-separated words of ``runs`` that hold ``letter``, found from each one."""
    end = 0
    while (at := runs.find(letter, end)) >= 0:
        end = runs.find(b" ", at)
        if end < 0:
            end = len(runs)
        yield runs[runs.rfind(b" ", 0, at) + 1:end]


def _pieces(words: Sequence[bytes], piece: int) -> int:
    """Tokens of words that split into a first piece and one per further ``piece`` characters.

    A word over :data:`_MAX_WORD_CHARS` is one ``[UNK]``. Python per word, so
    only for the rare text with such a word (see :func:`_run_tokens`).
    """
    return sum(
        1 if length > _MAX_WORD_CHARS else 1 + (length - 1) // piece
        for length in map(len, words)
    )


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


def _one_token_punctuation() -> str:
    """Non-ASCII punctuation (``P*``) of the common blocks, as a character-class body.

    Each such character is split off as one token and ends any word it
    touches, exactly like a CJK character, so the byte tables need no stand-in
    for it.
    """
    blocks = [(0x00A0, 0x00FF), (0x2000, 0x206F), (0x3000, 0x303F), (0xFE30, 0xFE4F),
              (0xFF00, 0xFFEF)]
    chars = [
        chr(code) for low, high in blocks for code in range(low, high + 1)
        if unicodedata.category(chr(code)).startswith("P") and _NON_ASCII_OTHER.match(chr(code))
    ]
    return "".join(re.escape(char) for char in chars)


_BEYOND_ONE_EACH = re.compile(f"[^\x00-\x7f{_CJK_RANGES}{_one_token_punctuation()}]")
"""A character outside ASCII, CJK and one-token punctuation: one the byte tables
cannot count as it is."""
