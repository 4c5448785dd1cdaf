"""``--backend null_backend:factory``: a backend that costs nothing, to measure tokenq itself.

With no model and no tokenizer worth the name, whatever time a request
takes end to end is tokenq's: the producer's enqueue, Redis, the worker's
read, decode, pack and publish, the reply's trip back. The overhead suite
runs workers with it (``PYTHONPATH=scripts/bench``).

Its "tokenizer" counts spaces (one token per word plus two specials, so
lengths still vary and the packer still has work to do), and ``run`` returns
a shared zero vector for every row without any computation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenq.worker.backends.base import BackendInfo, TextInput

DIM = 8


@dataclass(frozen=True, slots=True)
class NullEncoding:
    """Only the length: the one thing the worker reads."""

    length: int


class NullBackend:
    """Zeros for every row, at once; see the module docstring."""

    def __init__(self, max_input_tokens: int = 512) -> None:
        self.info = BackendInfo(
            name="null", model="null", task="embed", max_input_tokens=max_input_tokens,
            padded=True, dim=DIM,
        )
        self._zeros = np.zeros(DIM, dtype=np.float32)

    def tokenize(self, inputs: Sequence[TextInput], max_length: int | None) -> list[NullEncoding]:
        limit = max_length or 1 << 30
        return [NullEncoding(min(limit, item.text.count(" ") + 3)) for item in inputs]

    def run(self, batch: Sequence[NullEncoding]) -> list[np.ndarray]:
        return [self._zeros] * len(batch)

    def close(self) -> None:
        """Nothing to release."""


def factory(settings: Any) -> NullBackend:
    """The worker's plugin hook (settings are not needed)."""
    del settings
    return NullBackend()
