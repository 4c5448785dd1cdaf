"""Token-level pieces of the Hugging Face backend that need neither torch nor a model.

:class:`HFEncoding` is what ``HFBackend.tokenize`` hands the worker: the ids
and nothing else it does not need, so the read-ahead buffer stays small.
The window arithmetic of the 'chunk' policy lives in
:mod:`tokenq.worker.pipeline.chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HFEncoding:
    """One tokenized input, special tokens included, ready to be padded into a batch."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...] | None = None
    """Segment ids of a (text, text_pair) input; None means all zeros (one sequence)."""

    @property
    def length(self) -> int:
        """Tokens this sequence occupies, special tokens included."""
        return len(self.ids)

    @property
    def is_pair(self) -> bool:
        return self.type_ids is not None
