"""Token-level pieces of the Hugging Face backend that need neither torch nor a model:
:class:`HFEncoding` (just the ids, to keep read-ahead small) and :class:`PromptLengths`.
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
    """Leading tokens that are the prompt, specials before it included; pooling with
    ``include_prompt: false`` leaves them out, and a window repeats them."""
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

    The prompt's ids tokenized alone, less one when the last is a special token (as
    ``Transformer._get_prompt_length``). Keeps the ``size`` most recently used.
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
