"""Per-request options (the request's ``opts`` map): the worker's one home for them.

docs/PROTOCOL.md reserves ``opts`` for options that change what one request
gets (a prompt, a dimension, normalisation...). This version defines none,
and unknown keys are ignored, as the protocol promises, so an old worker
serves a newer producer.

Adding an option is an edit here: a field of :class:`RequestOptions`, its
check in :meth:`RequestOptions.parse` (raise ``ValueError`` naming the key:
the request is answered ``bad_request``), and its effect in
:meth:`RequestOptions.apply` (or where the pipeline reads ``job.options``).
On the producer side the matching edit is the keyword in
``tokenq.producer``'s request options.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """The options one request asked for, checked."""

    @classmethod
    def parse(cls, opts: Mapping[str, Any]) -> RequestOptions:
        """The options in ``opts``; ``ValueError`` for a known key with a bad value."""
        return NO_OPTIONS

    def apply(self, result: np.ndarray) -> np.ndarray:
        """The model's output for this request as the options shape it."""
        return result


NO_OPTIONS = RequestOptions()
