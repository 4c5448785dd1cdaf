"""A fast, dependency-free token count by BERT WordPiece's rules (docs/ESTIMATES.md): CJK and
punctuation one a character; a word one plus one per further 7 letters (3 in other scripts, 4
digits); a glued symbol run one; with no Python per character (``bytes.translate`` views)."""

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
# Combining marks (accents written apart, vowel points and signs) are not \w, yet belong to
# the word they sit in.
_MARKS = (
    "\u0300-\u036f\u0483-\u0489\u0591-\u05c7\u0610-\u061a\u064b-\u065f"
    "\u0900-\u0dff\u0e00-\u0eff\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f")
_LETTERS = re.compile(rf"(?:[^\W\d_]|[{_MARKS}])+")
_DIGITS = re.compile(r"\d+")
_ASCII_PUNCT = re.compile(r"[!-/:-@\[-`{-~]")  # BERT calls every one of these punctuation
# Neither a word character, a space nor a mark: punctuation, symbols, control and format.
_NON_ASCII_OTHER = re.compile(rf"[^\w\s\x00-\x7f{_MARKS}]+")
_MAX_WORD_CHARS = 100
"""WordPiece's ``max_input_chars_per_word``: a longer word becomes one ``[UNK]``."""

_LATIN_PIECE = 7
# Latin up to Extended-B plus combining accents: accented Latin splits like ASCII.
_NOT_LATIN = re.compile("[^\u0000-\u024f\u0300-\u036f]")
_OTHER_PIECE = 3
_DIGIT_PIECE = 4


def estimate_tokens(text: str, text_pair: str | None = None) -> int:
    """Estimated token count of ``text`` (and ``text_pair``), special tokens included."""
    total = _count(text)
    if text_pair is None:
        return total + SPECIAL_TOKENS
    return total + _count(text_pair) + SPECIAL_TOKENS_PAIR


def _count(text: str) -> int:
    """Tokens of one text without special tokens."""
    if text.isascii():  # the common case: no CJK, marks or non-ASCII symbols to look for
        return _count_ascii(text.encode("ascii"))
    data = text.encode("utf-8", "surrogatepass")  # a lone surrogate is a character too
    if len(data) > 2 * len(text):  # mostly CJK: searched as it is
        return _count_standing_in(text, text)
    # Deleting the rest of ASCII leaves its punctuation and every non-ASCII character whole: a
    # much shorter text to search.
    chars = data.translate(None, _NOT_ONE_EACH).decode("utf-8", "surrogatepass")
    if _BEYOND_ONE_EACH.search(chars) is None:  # ASCII plus CJK and punctuation
        return _tally(data, _TEXT_VIEWS, len(chars))
    return _count_standing_in(text, chars)


class _Views(NamedTuple):
    """``bytes.translate`` tables mapping the bytes of one kind to a letter and every other
    byte to a space, so that a run of that letter is a word of that kind."""

    latin: bytes  # Latin letters to a: letters of other scripts end a run here
    scripts: bytes  # Latin letters to a, letters of other scripts to o: whole words
    digits: bytes  # digits to a (the letter _run_tokens counts runs of)
    not_digits: bytes  # every byte but the digits: deleting them says if there is a number
    glued: bytes  # symbols to s (glued runs count once)
    invisible: bytes  # deleted before finding glued runs: control and format characters


def _table(kinds: dict[bytes, bytes]) -> bytes:
    """A ``bytes.translate`` table: each byte of a key to its value, every other to a space."""
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

# Stand-ins for the classes ASCII has no example of: control characters, which the rules
# count as spaces (a text holding one takes the class path instead).
_OTHER_LETTER = "\x01"
_SYMBOL = "\x02"
_INVISIBLE = "\x03"
_STAND_INS = {
    "a": "a", "0": "0", " ": " ", "p": "!", "c": "!",
    "o": _OTHER_LETTER, "s": _SYMBOL, "x": _INVISIBLE,
}
"""ASCII stand-in of each class of :class:`_Classes` but ``D`` (a letter that is also a
digit, which no control character can stand in for in the digit view)."""
_CONTROL_STAND_INS = (_OTHER_LETTER, _SYMBOL, _INVISIBLE)

_TEXT_VIEWS = _Views(
    latin=_table({_ASCII_LETTERS: b"a"}),
    scripts=_table({_ASCII_LETTERS: b"a", _OTHER_LETTER.encode(): b"o"}),
    digits=_table({b"0123456789": b"a"}),
    not_digits=bytes(set(range(256)) - set(b"0123456789")),
    glued=_table({_SYMBOL.encode(): b"s"}),
    invisible=_INVISIBLE.encode())
"""Views of a text's UTF-8 bytes whose characters are ASCII, one token each
(CJK, punctuation) or ASCII stand-ins."""

_CLASS_VIEWS = _Views(
    latin=_table({b"a": b"a"}),
    scripts=_table({b"a": b"a", b"oD": b"o"}),
    digits=_table({b"0D": b"a"}),
    not_digits=bytes(set(range(256)) - set(b"0D")),
    glued=_table({b"s": b"s"}),
    invisible=b"x")
"""Views of a class string (see :class:`_Classes`)."""

_MAX_STAND_INS = 32
"""Most distinct characters a text may have replaced by stand-ins (two passes each); past
it, the class path, which costs as much at about 50 (docs/ESTIMATES.md)."""


def _count_standing_in(text: str, haystack: str) -> int:
    """:func:`_count` of a text that may hold characters the byte views cannot see as they are:
    each distinct one (found in ``haystack``, every non-ASCII character of the text) is replaced
    all through by the ASCII stand-in of its class; what is left outside ASCII (CJK,
    punctuation) counts one token a character, like its ``?``."""
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
        text.encode("ascii", "replace"), other=_OTHER_LETTER in used, symbols=_SYMBOL in used)


def _count_ascii(data: bytes, *, other: bool = False, symbols: bool = False) -> int:
    """:func:`_count` of a text as ASCII bytes, stand-ins included (see :func:`_tally`)."""
    one_each = len(data.translate(None, _NOT_ONE_EACH))  # punctuation, and "?" for CJK
    return _tally(data, _TEXT_VIEWS, one_each, other=other, symbols=symbols)


def _count_classes(text: str) -> int:
    """:func:`_count` of any text, through its class string (see :class:`_Classes`)."""
    kinds = text.translate(_CLASSES).encode("ascii")
    return _tally(
        kinds, _CLASS_VIEWS, kinds.count(b"c") + kinds.count(b"p"),
        other=b"o" in kinds or b"D" in kinds, symbols=b"s" in kinds)


def _tally(
    data: bytes, views: _Views, one_each: int, *, other: bool = False, symbols: bool = False,
) -> int:
    """Tokens of a text given as ``data`` in the alphabet of ``views``; ``one_each``: its
    one-token characters; ``other``, ``symbols``: whether their passes are needed."""
    tokens = one_each + _run_tokens(data.translate(views.latin), _LATIN_PIECE)
    # Most texts have no number (one deletion says so); numbers are counted joined.
    if data.translate(None, views.not_digits):
        tokens += _run_tokens(b" ".join(data.translate(views.digits).split()), _DIGIT_PIECE)
    if other:
        tokens += _other_script_tokens(data.translate(views.scripts))
    if symbols:
        tokens += len(data.translate(views.glued, views.invisible).split())
    return tokens


_TOO_LONG = b"a" * (_MAX_WORD_CHARS + 1)


def _run_tokens(runs: bytes, piece: int) -> int:
    """Tokens of the runs of ``a`` in ``runs`` as words of ceil(n / ``piece``) tokens: the
    groups of ``piece`` letters deleted plus the runs left (no Python per word). A text with
    a word over the WordPiece limit is counted word by word instead."""
    if _TOO_LONG in runs:
        return _pieces(runs.split(), piece)
    rest = runs.replace(b"a" * piece, b"")
    groups = (len(runs) - len(rest)) // piece
    return groups + rest.count(b"a ") + rest.endswith(b"a")  # ends: measured faster than starts


_FEW_OTHER_LETTERS = 16
"""Up to this many letters of other scripts, their words are found from each letter;
past it, by splitting the text into words."""


def _other_script_tokens(scripts: bytes) -> int:
    """What words holding letters of non-Latin scripts (``o``; Latin ``a``) add to the Latin
    count: a token per 3 characters of the whole word, less what its Latin fragments got."""
    if scripts.count(b"o") > _FEW_OTHER_LETTERS:
        words = [word for word in scripts.split() if _O in word]
    else:
        words = list(_words_around(scripts, b"o"))
    joined = b" ".join(words)
    return (
        _run_tokens(joined.translate(_WHOLE_WORDS), _OTHER_PIECE)
        - _run_tokens(joined.translate(_LATIN_FRAGMENTS), _LATIN_PIECE))


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
    """Tokens of words of one piece and one per further ``piece`` characters, one ``[UNK]``
    past :data:`_MAX_WORD_CHARS`."""
    return sum(
        1 if length > _MAX_WORD_CHARS else 1 + (length - 1) // piece
        for length in map(len, words))


class _Classes(dict[int, str]):
    """Code point -> its one-letter class, computed once per character (bounded). ``c`` CJK; ``a`` a
    Latin letter (or mark), ``o`` another script's, ``D`` one that is also a digit; ``0`` a digit;
    ``p`` punctuation; ``s`` a symbol; ``x`` a control or format character; `` `` anything else."""

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
    """Non-ASCII punctuation (``P*``) of the common blocks, as a character-class body: one
    token each that ends any word it touches, like a CJK character."""
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
