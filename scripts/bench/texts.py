"""The inputs every suite sends: real text from scripts/data/sample.jsonl, cut to length.

Why cut real text rather than repeat one word: the sim backend tokenizes
English words and CJK characters differently, and so does a real tokenizer;
a benchmark over ``"word word word"`` would hide that. Why cut it to exact
sim lengths: the seed scenario is defined by lengths (~1,500-token passages,
~20-token queries), and a test of a batcher must know them exactly. Joining
the sim's own tokens with single spaces gives a text whose sim length is
exactly what was asked for (each token stays one token).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tokenq.worker.backends.sim import SPECIAL_TOKENS, count_tokens, split_tokens

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "sample.jsonl"


@cache
def sample_texts() -> tuple[str, ...]:
    """The 300 lines of English and Chinese text shipped with the repository."""
    with SAMPLE.open(encoding="utf-8") as handle:
        return tuple(json.loads(line)["text"] for line in handle if line.strip())


@cache
def _token_stream() -> tuple[str, ...]:
    """Every sim token of the sample, in order (about 33k)."""
    return tuple(token for text in sample_texts() for token in split_tokens(text))


def text_of_length(rng: random.Random, length: int) -> str:
    """A slice of the sample whose sim length (specials included) is exactly ``length``."""
    stream = _token_stream()
    content = length - SPECIAL_TOKENS
    start = rng.randrange(len(stream))
    tokens = [stream[(start + i) % len(stream)] for i in range(content)]
    text = " ".join(tokens)
    assert count_tokens(text) == length, (length, count_tokens(text))
    return text


@dataclass(frozen=True, slots=True)
class Mix:
    """A list of requests with their exact sim lengths (the order they are sent in)."""

    texts: list[str]
    lengths: list[int]

    @property
    def longest(self) -> int:
        return max(self.lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


SEED_PASSAGES = (1350, 1650)
"""The seed mix's passage lengths (sim tokens), lowest and highest."""
SEED_QUERIES = (12, 28)
"""Its query lengths."""


def seed_mix(n: int, seed: int = 6, passages: tuple[int, int] = SEED_PASSAGES) -> Mix:
    """Half ~1,500-token passages (1,350-1,650), half ~20-token queries (12-28), shuffled.

    The spread keeps the lengths realistic (no two passages need be alike)
    while the longest passage stays known: that fixes the largest safe
    fixed batch count. ``passages`` sets other passage lengths (a real
    model reads only its own maximum of each).
    """
    rng = random.Random(seed)
    lengths = [
        rng.randint(*passages) if i < n // 2 else rng.randint(*SEED_QUERIES) for i in range(n)
    ]
    rng.shuffle(lengths)
    return Mix([text_of_length(rng, length) for length in lengths], lengths)


def uniform_mix(n: int, low: int, high: int, seed: int = 7) -> Mix:
    """``n`` requests of lengths uniform in ``[low, high]`` (scale and latency suites)."""
    rng = random.Random(seed)
    lengths = [rng.randint(low, high) for _ in range(n)]
    return Mix([text_of_length(rng, length) for length in lengths], lengths)


def real_texts(n: int) -> list[str]:
    """``n`` sample lines (repeated in a shuffled order): mixed lengths, English and Chinese."""
    rng = random.Random(8)
    lines = list(sample_texts())
    out: list[str] = []
    while len(out) < n:
        rng.shuffle(lines)
        out += lines
    return out[:n]
