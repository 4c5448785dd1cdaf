"""Exact token counts with the queue's own tokenizer, when the producer can load one.

Why: the heuristic in :mod:`tokenq.producer.estimate` is off by up to a
third on ordinary prose (docs/ESTIMATES.md), so it can refuse an over-long
input only past a wide margin. Workers publish the path of their
``tokenizer.json`` in the queue's config hash; a producer on the same
machine (or with the same files mounted) and with the ``tokenizers``
package installed counts exactly what the worker will count, and can then
refuse exactly what the worker would refuse.

``tokenizers`` is optional and imported only here, only when a load is
attempted, so ``import tokenq.producer`` stays cheap. It is a small Rust
wheel; it does not pull in torch, transformers or numpy.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

MAX_TOKENIZER_BYTES = 256 * 1024 * 1024
"""Largest tokenizer.json the producer will read. The path comes from Redis;
it must not be able to make a web process parse a file of any size."""


class TokenizerEstimator:
    """Counts tokens exactly as a Hugging Face fast tokenizer does, special tokens included.

    A pair is encoded as a pair (``[CLS] a [SEP] b [SEP]`` for BERT), as the
    worker encodes it. ``exact = True`` tells the client to compare its count
    with the queue's limit without a safety margin; any estimator callable
    may carry that attribute.

    Build one with :meth:`from_file` to pass as ``estimator=`` when the
    producer has its own copy of the model's tokenizer.json (the path a
    worker publishes is a path on the worker's machine).
    """

    exact: ClassVar[bool] = True

    def __init__(self, tokenizer: Any, source: str) -> None:
        # tokenizer.json files often carry the training setup, e.g.
        # all-MiniLM-L6-v2's ships truncation and padding to 128 tokens: left
        # on, every count would be 128. The worker tokenizes without either.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self.source = source

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TokenizerEstimator:
        """Load a tokenizer.json; ImportError without ``tokenizers``, OSError if unreadable."""
        source = os.fspath(path)
        if not os.path.isfile(source):
            raise FileNotFoundError(f"{source} is not a file")
        size = os.path.getsize(source)
        if size > MAX_TOKENIZER_BYTES:
            raise OSError(f"{source} is {size} bytes, over {MAX_TOKENIZER_BYTES}")
        from tokenizers import Tokenizer  # optional; see the module docstring

        try:
            tokenizer = Tokenizer.from_file(source)
        except Exception as exc:  # the Rust side raises a bare Exception
            raise OSError(f"{source} is not a readable tokenizer.json: {exc}") from exc
        return cls(tokenizer, source)

    @property
    def tokenizer(self) -> Any:
        """The loaded ``tokenizers.Tokenizer`` (no truncation, no padding): the gateway's
        ``/tokenize`` and ``/decode`` answer with it."""
        return self._tokenizer

    def __call__(self, text: str, text_pair: str | None = None) -> int:
        """Token count of ``text`` (with ``text_pair``), special tokens included."""
        return len(self._tokenizer.encode(text, text_pair, add_special_tokens=True))

    def __repr__(self) -> str:
        return f"TokenizerEstimator({self.source!r})"


def load_estimator(path: str) -> TokenizerEstimator | str:
    """The exact estimator for ``path``, or why it cannot be had (never raises).

    The clients call this when a queue's config names a tokenizer; a string
    answer makes them fall back to the heuristic.
    """
    try:
        return TokenizerEstimator.from_file(path)
    except ImportError:
        return "the tokenizers package is not installed (pip install tokenizers)"
    except OSError as exc:
        return f"cannot load {path}: {exc}"
