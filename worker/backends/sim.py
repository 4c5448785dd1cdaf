"""A simulated GPU (``--backend sim``): exact tokens (a CJK character, ``\\w`` run or mark each,
plus BERT's specials), time and memory (OOM past capacity), vectors per :func:`expected_vector`."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from tokenq.shared.errors import ConfigError, DeviceOutOfMemory
from tokenq.worker.backends.base import BackendInfo, Encoding, TextInput
from tokenq.worker.backends.chunks import combine_chunks, sliding_windows

SIM_FAIL_MARKER = "<<tokenq-sim-fail>>"  # its batch raises ValueError
SIM_HANG_MARKER = "<<tokenq-sim-hang>>"  # its batch sleeps ``hang_s`` seconds first
SIM_NAN_MARKER = "<<tokenq-sim-nan>>"  # its vector is all NaN (the rest of its batch is fine)

SPECIAL_TOKENS = 2  # [CLS] text [SEP]
PAIR_SPECIAL_TOKENS = 3  # [CLS] text [SEP] text_pair [SEP]

# Scripts written without spaces between words: one character, one token.
_CJK = (
    "\u1100-\u11ff\u3040-\u309f\u30a0-\u30ff\u3130-\u318f\u31f0-\u31ff"  # Jamo, kana
    "\u3400-\u4dbf\u4e00-\u9fff"  # CJK unified ideographs and extension A
    "\ua960-\ua97f\uac00-\ud7af\ud7b0-\ud7ff"  # Hangul
    "\uf900-\ufaff\uff66-\uff9f"  # CJK compatibility ideographs, halfwidth katakana
    "\U00020000-\U0003134f"  # CJK extensions B-G and the compatibility supplement
)
_TOKEN = re.compile(rf"[{_CJK}]|(?:(?![{_CJK}])\w)+|[^\w\s]")


_IDEOGRAPH_RE = re.compile(rf"[{_CJK}]")
_WORD, _IDEOGRAPH, _SPACE, _MARK = 0, 1, 2, 3  # character classes, as _TOKEN sees them
_SCAN_FROM_CHARS = 256  # texts this long are tokenized by _ScannedTokens, shorter by the regex


def _class_of(char: str) -> int:
    if _IDEOGRAPH_RE.match(char):
        return _IDEOGRAPH
    if char.isalnum() or char == "_":
        return _WORD
    return _SPACE if char.isspace() else _MARK


@functools.cache
def _bmp_classes() -> np.ndarray:
    """The class of every character of the Basic Multilingual Plane (built once)."""
    return np.fromiter((_class_of(chr(code)) for code in range(0x10000)), np.uint8, 0x10000)


@dataclass(frozen=True, slots=True)
class _MatchedTokens:
    """Tokens as the reference regex finds them: cheapest for short texts."""

    tokens: list[str]

    @property
    def count(self) -> int:
        return len(self.tokens)

    def canonical(self, first: int, last: int) -> bytes:
        """Tokens ``first`` to ``last - 1`` as bytes of those tokens alone: their characters
        (UTF-32), then where each starts among them (uint32)."""
        run = self.tokens[first:last]
        starts = itertools.accumulate(map(len, run[:-1]), initial=0) if run else ()
        chars = "".join(run).encode("utf-32-le", "surrogatepass")
        return _framed(chars, np.fromiter(starts, "<u4").tobytes())


@dataclass(frozen=True, slots=True)
class _ScannedTokens:
    """Tokens found by classifying every code point at once (numpy): for long texts the regex
    holds the GIL far longer."""

    codes: np.ndarray
    classes: np.ndarray
    starts: np.ndarray  # index of the first character of each token, ascending

    @classmethod
    def of(cls, text: str) -> _ScannedTokens:
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        astral = codes > 0xFFFF
        classes = _bmp_classes()[np.where(astral, 0, codes)]
        for index in np.flatnonzero(astral):
            classes[index] = _class_of(chr(codes[index]))
        word = classes == _WORD
        follows_word = np.empty_like(word)
        follows_word[:1] = False
        follows_word[1:] = word[:-1]
        begins = (classes == _IDEOGRAPH) | (classes == _MARK) | (word & ~follows_word)
        return cls(codes, classes, np.flatnonzero(begins))

    @property
    def count(self) -> int:
        return len(self.starts)

    def canonical(self, first: int, last: int) -> bytes:
        if first >= last:
            return _framed(b"", b"")
        begin = int(self.starts[first])
        end = int(self.starts[last]) if last < len(self.starts) else len(self.codes)
        spaces = np.cumsum(self.classes[begin:end] == _SPACE)
        kept = self.codes[begin:end][self.classes[begin:end] != _SPACE]
        starts = self.starts[first:last] - begin
        return _framed(kept.tobytes(), (starts - spaces[starts]).astype("<u4").tobytes())


_Tokens = _MatchedTokens | _ScannedTokens


def _framed(chars: bytes, starts: bytes) -> bytes:
    return len(chars).to_bytes(8, "little") + chars + starts


def _tokens_of(text: str) -> _Tokens:
    if len(text) >= _SCAN_FROM_CHARS:
        return _ScannedTokens.of(text)
    return _MatchedTokens(_TOKEN.findall(text))


@dataclass(frozen=True, slots=True)
class SimEncoding:
    """One tokenized input: its length (specials included) and which tokens it kept."""

    length: int
    text: str
    kept: tuple[int, int]  # text's content tokens kept[0] to kept[1] - 1 (truncated, a window)
    pair_text: str | None
    pair_kept: int  # how many of pair_text's content tokens were kept (0 without a pair)
    digest: bytes = field(repr=False)  # the kept tokens' hash, the vector's seed
    fail: bool = False  # the input carried a marker: SIM_FAIL_MARKER, _NAN_, _HANG_
    nan: bool = False
    hang: bool = False
    truncated: bool = False

    @property
    def tokens(self) -> tuple[str, ...]:  # content tokens of ``text`` this sequence holds
        return tuple(split_tokens(self.text)[self.kept[0]:self.kept[1]])

    @property
    def pair_tokens(self) -> tuple[str, ...] | None:
        if self.pair_text is None:
            return None
        return tuple(split_tokens(self.pair_text)[: self.pair_kept])


def split_tokens(text: str) -> list[str]:
    """The sim's content tokens of a text (the reference regex), no specials or truncation."""
    return _TOKEN.findall(text)


def count_tokens(text: str, text_pair: str | None = None) -> int:
    """Untruncated length of an input, special tokens included (a producer's exact estimate)."""
    if text_pair is None:
        return _tokens_of(text).count + SPECIAL_TOKENS
    return _tokens_of(text).count + _tokens_of(text_pair).count + PAIR_SPECIAL_TOKENS


def _truncated_pair_lengths(first: int, second: int, room: int) -> tuple[int, int]:
    """Content tokens each side of a pair keeps within ``room``: Hugging Face's
    ``longest_first`` in closed form (trim the longer side, the second on a tie)."""
    if first + second <= room:
        return first, second
    shorter = min(first, second)
    if room - shorter >= shorter:
        # The longer side shrinks to what is left; the shorter one is untouched.
        return (shorter, room - shorter) if first <= second else (room - shorter, shorter)
    # Both sides shrink to about half; ties take from the second side first.
    return (room + 1) // 2, room // 2


def encode(text: str, text_pair: str | None = None, max_length: int | None = None) -> SimEncoding:
    """Tokenize one input the way :class:`SimBackend` does (pure; used by tests too)."""
    tokens = _tokens_of(text)
    pair = None if text_pair is None else _tokens_of(text_pair)
    specials = SPECIAL_TOKENS if pair is None else PAIR_SPECIAL_TOKENS
    keep, keep_pair = tokens.count, 0 if pair is None else pair.count
    if max_length is not None:
        room = max_length - specials
        if room < 0:
            raise ValueError(
                f"max_length {max_length} is shorter than the {specials} special tokens"
            )
        if pair is None:
            keep = min(keep, room)
        else:
            keep, keep_pair = _truncated_pair_lengths(keep, keep_pair, room)
    sides = [tokens.canonical(0, keep)]
    if pair is not None:
        sides.append(pair.canonical(0, keep_pair))
    texts = (text,) if text_pair is None else (text, text_pair)
    return SimEncoding(
        length=keep + keep_pair + specials, text=text, kept=(0, keep), pair_text=text_pair,
        pair_kept=keep_pair, digest=_digest(sides), fail=any(SIM_FAIL_MARKER in t for t in texts),
        nan=any(SIM_NAN_MARKER in t for t in texts), hang=any(SIM_HANG_MARKER in t for t in texts),
        truncated=keep + keep_pair < tokens.count + (0 if pair is None else pair.count),
    )


def _digest(canonical_sides: Iterable[bytes]) -> bytes:
    """blake2b over each side's canonical tokens, length-prefixed: a pair is not its text."""
    digest = hashlib.blake2b(digest_size=32, person=b"tokenq-sim2")
    for raw in canonical_sides:
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)
    return digest.digest()


def vector_of(encoding: SimEncoding, dim: int) -> np.ndarray:
    """The unit float32 vector of an encoding: its digest through SHAKE-256 (unlike numpy's
    RNG, the same everywhere)."""
    stream = hashlib.shake_256(encoding.digest).digest(4 * dim)
    values = np.frombuffer(stream, dtype="<u4").astype(np.float64) / 2.0**31 - 1.0
    norm = float(np.linalg.norm(values))
    if norm == 0.0:  # astronomically unlikely; keep the unit-norm promise anyway
        values[0], norm = 1.0, 1.0
    return (values / norm).astype(np.float32)


def expected_vector(
    text: str, dim: int, max_input_tokens: int | None = None, text_pair: str | None = None
) -> np.ndarray:
    """What the sim backend answers for this input (pure: a test checks any reply with it)."""
    return vector_of(encode(text, text_pair, max_input_tokens), dim)


def expected_chunked_vector(text: str, dim: int, max_input_tokens: int, overlap: int) -> np.ndarray:
    """What the 'chunk' policy answers for ``text`` on the sim backend."""
    windows = _windows(encode(text), max_input_tokens, overlap)
    if len(windows) == 1:
        return vector_of(windows[0], dim)
    vectors = [vector_of(window, dim) for window in windows]
    return combine_chunks(vectors, [window.length for window in windows], normalize=True)


def _windows(encoding: SimEncoding, max_length: int, overlap: int) -> list[SimEncoding]:
    if encoding.pair_text is not None:
        raise ValueError("a (text, text_pair) input cannot be chunked")
    if encoding.length <= max_length:
        return [encoding]
    # The hf backend's window rule over content tokens, so both backends chunk alike.
    tokens = _tokens_of(encoding.text)
    begin, end = encoding.kept
    parts = sliding_windows(range(begin, end), 0, 0, max_length - SPECIAL_TOKENS, overlap)
    return [
        dataclasses.replace(
            encoding, length=len(part) + SPECIAL_TOKENS, kept=(part[0], part[-1] + 1),
            digest=_digest([tokens.canonical(part[0], part[-1] + 1)]),
        )
        for part in parts
    ]


class SimTokenizer:
    """The sim's tokenizer alone: what :meth:`SimBackend.tokenize` runs, in any process."""

    def __init__(self) -> None:
        _bmp_classes()  # built now, not on the first request's path

    @staticmethod
    def tokenize(inputs: Sequence[TextInput], max_length: int | None) -> list[Encoding]:
        return [encode(item.prompt + item.text, item.text_pair, max_length) for item in inputs]


class SimBackend(SimTokenizer):
    """A simulated encoder on a simulated device; see the module docstring."""

    def __init__(
        self, *, dim: int = 32, max_input_tokens: int = 2048, batch_ms: float = 0.5,
        token_us: float = 0.05, bytes_per_token: int = 4096, capacity_bytes: int = 1 << 30,
        ragged: bool = False, pairs: bool = False, hang_s: float = 0.0,
    ) -> None:
        """The ``sim_*`` settings; ``pairs`` claims a cross-encoder's ``info.pairs``, for tests."""
        if dim < 1 or max_input_tokens <= SPECIAL_TOKENS:
            raise ConfigError(
                f"sim needs dim >= 1 and max_input_tokens > {SPECIAL_TOKENS} (its special "
                f"tokens), got dim={dim} and max_input_tokens={max_input_tokens}"
            )
        self.info = BackendInfo(
            name="sim", model="sim", task="embed", max_input_tokens=max_input_tokens,
            padded=not ragged, dim=dim, pairs=pairs, normalized=True,
        )
        self.batch_ms, self.token_us, self.hang_s = batch_ms, token_us, hang_s
        self.bytes_per_token, self.capacity_bytes = bytes_per_token, capacity_bytes
        self._lock = threading.Lock()  # counters of batches run or refused, read by others
        self.batches = self.rows = self.oom_events = self.failures = self.peak_memory_bytes = 0
        self.busy_s = 0.0
        self.closed = False
        self._oversleep_s = 0.0
        super().__init__()

    def tokenizer_factory(self) -> Callable[[], SimTokenizer]:  # Python: it holds the GIL
        return SimTokenizer

    def windows(self, encoding: SimEncoding, max_length: int, overlap: int) -> list[SimEncoding]:
        if max_length > self.info.max_input_tokens:
            raise ValueError(
                f"window length {max_length} exceeds the model's {self.info.max_input_tokens}"
            )
        return _windows(encoding, max_length, overlap)

    def cost(self, batch: Sequence[SimEncoding]) -> int:
        """Tokens the simulated device pays for a batch (what memory and time follow)."""
        lengths = [encoding.length for encoding in batch]
        return len(lengths) * max(lengths, default=0) if self.info.padded else sum(lengths)

    def run(self, batch: Sequence[Encoding]) -> list[np.ndarray]:
        """Sleep the modelled time, return one unit vector per row; DeviceOutOfMemory before
        spending time, ValueError for a poisoned batch or an over-long row."""
        if self.closed:
            raise RuntimeError("sim backend is closed")
        for encoding in batch:
            if not isinstance(encoding, SimEncoding):
                raise TypeError(f"sim backend got a {type(encoding).__name__}, not a SimEncoding")
            if encoding.length > self.info.max_input_tokens:
                raise ValueError(
                    f"a row of {encoding.length} tokens exceeds the model's "
                    f"max_input_tokens {self.info.max_input_tokens}"
                )
        rows = cast("Sequence[SimEncoding]", batch)
        if not rows:
            return []
        cost = self.cost(rows)
        memory = cost * self.bytes_per_token
        if memory > self.capacity_bytes:
            with self._lock:
                self.oom_events += 1
            raise DeviceOutOfMemory(
                f"sim: batch of {len(rows)} rows needs {memory} bytes "
                f"({cost} tokens), device capacity is {self.capacity_bytes} bytes"
            )
        if any(encoding.fail for encoding in rows):
            with self._lock:
                self.failures += 1
            raise ValueError(f"sim: batch holds an input marked {SIM_FAIL_MARKER!r}")
        if self.hang_s > 0 and any(encoding.hang for encoding in rows):
            time.sleep(self.hang_s)  # a device that stopped answering
        seconds = (self.batch_ms * 1e3 + self.token_us * cost) / 1e6
        started = time.perf_counter()
        dim = self.info.dim or 1
        outputs = [
            np.full(dim, np.nan, dtype=np.float32) if encoding.nan else vector_of(encoding, dim)
            for encoding in rows
        ]
        self._hold(started + seconds)
        with self._lock:
            self.batches += 1
            self.rows += len(rows)
            self.peak_memory_bytes = max(self.peak_memory_bytes, memory)
            self.busy_s += seconds
        return outputs

    def _hold(self, until: float) -> None:
        """Sleep until ``until``, less the running mean of the wake-up lateness no GPU adds."""
        remaining = until - time.perf_counter()
        if remaining <= 0:
            return
        time.sleep(max(0.0, remaining - self._oversleep_s))
        late = time.perf_counter() - until
        self._oversleep_s = max(0.0, min(0.002, self._oversleep_s + 0.1 * late))

    def close(self) -> None:  # later runs raise, as with a freed device
        self.closed = True


def build_sim_backend(settings: Any) -> SimBackend:
    """The sim backend from the ``sim_*`` settings: ``sim_<name>`` is the keyword ``<name>``."""
    knobs = {
        name.removeprefix("sim_"): getattr(settings, name)
        for name in type(settings).model_fields if name.startswith("sim_")
    }
    return SimBackend(**knobs)
