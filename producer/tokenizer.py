"""Exact token counts with the queue's own tokenizer.json, when the optional ``tokenizers``
package (imported only then) can load it."""

from __future__ import annotations

import os
from typing import Any, ClassVar

MAX_TOKENIZER_BYTES = 256 * 1024 * 1024
"""Largest tokenizer.json the producer reads: the path comes from Redis."""


class TokenizerEstimator:
    """Counts tokens exactly as a Hugging Face fast tokenizer does, special tokens included (a
    pair as a pair, as the worker does), so the client compares without a margin. Pass one made
    with :meth:`from_file` as ``estimator=`` when the producer has its own copy of the file."""

    exact: ClassVar[bool] = True

    def __init__(self, tokenizer: Any, source: str) -> None:
        # A tokenizer.json may carry its training's truncation and padding (all-MiniLM-L6-v2:
        # 128 tokens); the worker tokenizes without either.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        """The loaded ``tokenizers.Tokenizer`` (the gateway's ``/tokenize`` and ``/decode``)."""
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

    def __call__(self, text: str, text_pair: str | None = None) -> int:
        """Token count of ``text`` (with ``text_pair``), special tokens included."""
        return len(self.tokenizer.encode(text, text_pair, add_special_tokens=True))

    def __repr__(self) -> str:
        return f"TokenizerEstimator({self.source!r})"


def load_estimator(path: str) -> TokenizerEstimator | str:
    """The exact estimator for ``path``, or why it cannot be had (never raises)."""
    try:
        return TokenizerEstimator.from_file(path)
    except ImportError:
        return "the tokenizers package is not installed (pip install tokenizers)"
    except OSError as exc:
        return f"cannot load {path}: {exc}"
