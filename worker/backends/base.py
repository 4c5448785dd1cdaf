"""The interface every model backend implements: exact token lengths (``tokenize``), batches
(``run``), its limits (``info``); optional abilities are declared, never probed."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args, runtime_checkable

import numpy as np

Task = Literal["embed", "classify", "rerank", "sparse"]
"""``--task``: embed replies carry an embedding, classify and rerank scores, sparse (SPLADE)
the nonzero (token id, weight) pairs of the dense row ``run`` returns."""
TASKS: tuple[Task, ...] = get_args(Task)

Activation = Literal["none", "sigmoid", "softmax"]
"""A scoring model's activation over its logits (``none``: regression, or logits by design)."""


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """What the worker and the queue's config hash need to know about a model."""

    name: str  # 'sim', 'hf', or a plugin's own name
    model: str  # id or path, for the config hash and logs
    task: Task
    max_input_tokens: int  # the longest sequence the model accepts, special tokens included
    padded: bool = True  # a batch costs rows x longest; False for varlen (ragged) kernels
    dim: int | None = None  # embedding size, or number of scores
    device: str = "cpu"
    dtype: str = "float32"
    tokenizer: str | None = None  # a tokenizer.json producers may load for exact estimates
    pairs: bool = False  # takes (text, text_pair) inputs (cross-encoders)
    normalized: bool = False  # unit-length embeddings (a chunked input's mean re-normalised)
    labels: tuple[str, ...] = ()  # a classifier's name for each score, in order
    raw_vectors: bool = False
    """``run`` returns embeddings before L2 normalisation, so the worker normalises per
    request. False: a ``normalize: false`` request on a ``normalized`` queue is refused."""
    activation: Activation = "none"
    """What turns a row's logits (what ``run`` returns) into a reply's default scores; a
    request with ``raw_scores: true`` gets the logits."""
    prompts: Mapping[str, str] = field(default_factory=dict)  # name -> the text it prepends
    default_prompt_name: str | None = None  # the prompt of a request that names none
    token_dim: int | None = None
    """Size of each token's vector for ``output: tokens`` (``run`` returns ``length x
    token_dim`` flattened); None: such a request is refused."""
    pooling: str | None = None  # ``mean``, ``cls``, ``mean+max``...; the gateway's ``/info``
    extra: dict[str, Any] = field(default_factory=dict)  # facts for logs and the config hash

    @property
    def embeds(self) -> bool:
        """Whether replies carry an embedding (else scores)."""
        return self.task == "embed"


@dataclass(slots=True)
class TextInput:
    """One input sequence, or a (query, passage) pair for a cross-encoder; not frozen, as it
    is made per request on the hot path (docs/decisions/0024-per-request-records-not-frozen.md)."""

    text: str
    text_pair: str | None = None
    prompt: str = ""
    """A resolved prompt put before ``text``, tokenized with it so its tokens are costed;
    separate so pooling with ``include_prompt: false`` can tell where it ends."""
    tokens: bool = False  # answer its token embeddings (``BackendInfo.token_dim``), not pooled


class Encoding(Protocol):
    """A tokenized input; only its length matters to the worker. It may carry ``truncated``
    (bool); without it the worker re-tokenizes an input at the limit to tell."""

    @property
    def length(self) -> int:
        """Tokens this sequence occupies, special tokens included."""
        ...


class Tokenizer(Protocol):
    """What tokenizes as a backend does."""

    def tokenize(self, inputs: Sequence[TextInput], max_length: int | None) -> list[Encoding]:
        """Tokenize inputs, truncated to ``max_length`` when given (in a thread, on read-ahead
        batches); ``ValueError`` only for inputs the backend cannot take at all."""
        ...


@runtime_checkable
class Backend(Tokenizer, Protocol):
    """A model the worker can feed batches to."""

    info: BackendInfo

    def run(self, batch: Sequence[Encoding]) -> list[np.ndarray]:
        """One float32 1-D array per row, in order; :class:`~tokenq.shared.errors.DeviceOutOfMemory`
        (or the framework's OOM) when it does not fit: the worker splits it and retries."""
        ...

    def close(self) -> None:
        """Release the device (called once, at exit)."""
        ...


@runtime_checkable
class Windowing(Protocol):
    """The optional capability behind the ``chunk`` policy: split an over-long input."""

    def windows(self, encoding: Encoding, max_length: int, overlap: int) -> list[Encoding]:
        """Overlapping windows of at most ``max_length`` tokens, special tokens put back;
        ``ValueError`` for an input that cannot be split (a pair, say)."""
        ...


@runtime_checkable
class TokenizerSource(Protocol):
    """The optional capability behind ``--tokenize-processes``: a (GIL-holding) tokenizer
    copied into child processes, keeping the event loop and device thread free."""

    def tokenizer_factory(self) -> Callable[[], Tokenizer]:
        """A picklable callable that builds an equal tokenizer in another process; its
        encodings must pickle too, and be what :meth:`Backend.run` takes."""
        ...


@runtime_checkable
class WeightsIdentity(Protocol):
    """The optional capability that names the model's weights in the result cache's key
    (without it: the model's name and facts only). Asked only when the cache is on."""

    def weights_identity(self) -> str:
        """A digest of the model's weights, or its revision."""
        ...


def windowing_of(backend: Backend) -> Windowing | None:
    return backend if isinstance(backend, Windowing) else None


def tokenizer_source_of(backend: Backend) -> TokenizerSource | None:
    return backend if isinstance(backend, TokenizerSource) else None


def weights_identity_of(backend: Backend) -> str:
    return backend.weights_identity() if isinstance(backend, WeightsIdentity) else ""
