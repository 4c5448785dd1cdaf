"""Tokenize only the prefix of a long text that the model reads, as tokenizing it whole and
truncating would (docs/decisions/0088-prefix-tokenization.md)."""

from __future__ import annotations

import collections
import json
import re
from typing import Any

from tokenizers import Encoding, Tokenizer

_WHITESPACE = " \t\n\r\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000"
"""Whitespace to every family tested: BERT's (space, tab, newline, Zs) and Unicode's."""
_RUN_START = re.compile(f"(?<![{_WHITESPACE}])[{_WHITESPACE}]")
"""The first character of a whitespace run: a cut here leaves the last word whole."""
_SPACE = re.compile(f"[{_WHITESPACE}]")

_LOCAL_NORMALIZERS = frozenset({
    "BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Strip",
    "Prepend", "Sequence",
})
"""Normalizers that map a character the same way whatever follows its whitespace run."""
_LOCAL_PRE_TOKENIZERS = frozenset({
    "BertPreTokenizer", "Whitespace", "WhitespaceSplit", "ByteLevel", "Metaspace",
    "Punctuation", "Digits", "UnicodeScripts", "CharDelimiterSplit", "Sequence",
})
"""Pre-tokenizers that never join characters across the start of a whitespace run."""
_PER_WORD_MODELS = frozenset({"WordPiece", "BPE", "Unigram", "WordLevel"})


def cuttable(tokenizer: Tokenizer) -> bool:
    """Whether a text cut where a whitespace run starts gives, before the cut, the tokens
    the whole text gives there: a local normalizer, a pre-tokenizer that splits at
    whitespace, a model that reads one word at a time, no added token holding whitespace.
    Anything else (a SentencePiece charsmap, a custom split pattern) is read whole."""
    spec = json.loads(tokenizer.to_str())
    return (
        not any(_SPACE.search(token["content"]) for token in spec.get("added_tokens") or [])
        and _known(spec.get("normalizer"), _LOCAL_NORMALIZERS, "normalizers")
        and spec.get("pre_tokenizer") is not None
        and _known(spec["pre_tokenizer"], _LOCAL_PRE_TOKENIZERS, "pretokenizers")
        and spec["model"].get("type") in _PER_WORD_MODELS
    )


def _known(part: dict[str, Any] | None, allowed: frozenset[str], nested: str) -> bool:
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        return all(_known(step, allowed, nested) for step in part.get(nested, []))
    if kind == "ByteLevel" and not part.get("use_regex", True):
        return False  # then it splits nowhere: the whole text is one word
    if kind == "Metaspace" and not part.get("split", True):
        return False
    if kind == "CharDelimiterSplit" and part.get("delimiter") not in (" ", "\t", "\n"):
        return False
    return kind in allowed


LEARNED_FROM = 32
"""Whole texts read (of at least ``MIN_TOKENS_SEEN`` tokens) before their characters per
token size the first prefix."""
MIN_TOKENS_SEEN = 16
MARGIN = 1.25
"""The first prefix holds the 95th percentile of characters per token seen, a quarter more."""


class PrefixTokenizer:
    """Encodes single texts truncated to ``max_length``, reading a prefix that grows fourfold
    until its tokens overflow the window or it is the text. The first prefix holds
    ``first_chars_per_token`` characters a token of the window until the texts read say how
    many their tokens take (never more). Not thread-safe."""

    def __init__(self, tokenizer: Tokenizer, truncation_side: str = "right",
                 first_chars_per_token: float = 8) -> None:
        self._tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self._side = truncation_side
        self._cuttable = truncation_side == "right" and cuttable(tokenizer)
        self._most_chars_per_token = first_chars_per_token
        self._chars_per_token = first_chars_per_token
        self._seen: collections.deque[float] = collections.deque(maxlen=256)
        """Characters per token of the last whole texts read."""
        self._max_length: int | None = None

    def encode(self, texts: list[Any], max_length: int | None) -> tuple[list[Encoding], list[bool]]:
        """Each text's encoding and whether truncation cut it (``None``: no truncation);
        (text, text_pair) tuples are read whole, truncated 'longest_first'."""
        self._set_truncation(max_length)
        if max_length is None or not self._cuttable or not isinstance(texts[0], str):
            encodings = self._tokenizer.encode_batch_fast(texts)
            return encodings, [bool(e.overflowing) for e in encodings]
        found: list[Encoding | None] = [None] * len(texts)
        cut = [False] * len(texts)
        limit = int(max_length * self._chars_per_token) + 1
        pending = list(range(len(texts)))
        seen, learned = self._seen, False
        while pending:
            pieces = [_prefix(texts[i], limit) for i in pending]
            unread = []
            read = self._tokenizer.encode_batch_fast(pieces)  # no offsets: never read
            for i, piece, encoding in zip(pending, pieces, read, strict=True):
                # Only a cut encoding overflows, and a cut one is max_length long: a shorter
                # one's overflow (a list built per call) is never asked for.
                tokens = len(encoding)
                overflowed = tokens >= max_length and bool(encoding.overflowing)
                if overflowed:
                    found[i], cut[i] = encoding, True
                elif len(piece) == len(texts[i]):
                    found[i] = encoding
                    if tokens >= MIN_TOKENS_SEEN:
                        seen.append(len(piece) / tokens)
                        learned = True
                else:
                    unread.append(i)
            pending, limit = unread, limit * 4
        if learned:
            self._learn()
        return [e for e in found if e is not None], cut

    def _learn(self) -> None:
        """Size the next first prefix from the characters per token of the texts read."""
        if len(self._seen) >= LEARNED_FROM:
            high = sorted(self._seen)[int(len(self._seen) * 0.95)]
            self._chars_per_token = min(self._most_chars_per_token, max(1.0, high * MARGIN))

    def _set_truncation(self, max_length: int | None) -> None:
        if max_length == self._max_length:
            return
        if max_length is None:
            self._tokenizer.no_truncation()
        else:
            self._tokenizer.enable_truncation(max_length, strategy="longest_first",
                                              direction=self._side)
        self._max_length = max_length


def _prefix(text: str, chars: int) -> str:
    """``text`` up to the first whitespace run that starts at or after ``chars``."""
    if len(text) <= chars:
        return text
    run = _RUN_START.search(text, chars)
    return text if run is None else text[: run.start()]
