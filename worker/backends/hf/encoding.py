"""Token-level pieces of the Hugging Face backend that need neither torch nor a model.

:class:`HFEncoding` is what ``HFBackend.tokenize`` hands the worker: the ids
and nothing else it does not need, so the read-ahead buffer stays small.
:class:`PromptLengths` measures prompts the way sentence-transformers does.
The window arithmetic of the 'chunk' policy lives in
:mod:`tokenq.worker.backends.chunks`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HFEncoding:
    """One tokenized input, special tokens included, ready to be padded into a batch."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...] | None = None
    """Segment ids of a (text, text_pair) input; None means all zeros (one sequence)."""
    prompt_length: int = 0
    """Leading tokens that are the prompt, the special tokens before it included
    (sentence-transformers' prompt length). A model whose Pooling has
    ``include_prompt: false`` pools without them; a window repeats them."""
    tokens: bool = False
    """Answer the last hidden state of every token, not the pooled vector (``output: tokens``)."""
    truncated: bool | None = False
    """The tokenizer cut the input to ``max_length``; None where it cannot tell (a slow one)."""

    @property
    def length(self) -> int:
        """Tokens this sequence occupies, special tokens included."""
        return len(self.ids)

    @property
    def is_pair(self) -> bool:
        return self.type_ids is not None


class PromptLengths:
    """sentence-transformers' prompt length, one measurement per prompt text.

    ``measure(prompt)`` gives the ids of the prompt tokenized alone, special
    tokens included; its length counts, less one when the last id is a
    special token (the [SEP] or EOS a template closes a sequence with), as
    ``Transformer._get_prompt_length`` computes it. Prompts are request
    data, so the cache keeps only the ``size`` most recently used.
    """

    def __init__(
        self, measure: Callable[[str], list[int]], special_ids: set[int], size: int = 1024
    ) -> None:
        self._measure = measure
        self._special_ids = frozenset(special_ids)
        self._size = size
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, prompt: str) -> int:
        """The prompt's length in tokens (0 for no prompt)."""
        if not prompt:
            return 0
        with self._lock:
            if prompt in self._cache:
                self._cache.move_to_end(prompt)
                return self._cache[prompt]
        ids = self._measure(prompt)
        length = len(ids) - (1 if ids and ids[-1] in self._special_ids else 0)
        with self._lock:
            self._cache[prompt] = length
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return length
