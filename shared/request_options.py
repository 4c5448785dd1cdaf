"""Per-request options (a request's ``opts`` map, docs/PROTOCOL.md "Request options"): their
checks, one home for the worker and the producer. Unknown keys are ignored."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

MAX_PROMPT_CHARS = 4096
"""Longest literal ``prompt`` a request may carry."""
MAX_DIMENSIONS = 65_536
"""Most ``dimensions`` a request may ask for, whatever the model (checked where it is unknown)."""


class WorkerOptions(TypedDict, total=False):
    """The per-request options: keyword arguments of every enqueueing call, sent in ``opts``.
    A new one is added here and checked in :func:`parse_options`."""

    prompt_name: str | None
    """One of the model's named prompts, put before the text."""
    prompt: str | None
    """Literal text put before the text ("" for none, overriding the model's default)."""
    dimensions: int | None
    """Keep the embedding's first ``dimensions`` values (Matryoshka truncation)."""
    normalize: bool | None
    """Unit-length embedding or not; by default what the model does."""
    truncate: bool | None
    """True: cut an over-long input; False: refuse or chunk it; None: the queue's policy."""
    raw_scores: bool | None
    """A classifier's or reranker's logits, without the model's activation."""
    output: str | None
    """``"tokens"``: one vector per token, not pooled (TEI's ``/embed_all``)."""
    cache: bool | None
    """False: computed afresh, neither answered from nor written to the result cache."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What option checks need to know about the queue's model (None: unknown, the worker
    checks): :func:`tokenq.shared.queue_config.model_facts`."""

    embeds: bool | None = None
    """True: replies carry embeddings; False: scores."""
    dim: int | None = None
    normalized: bool | None = None
    raw_vectors: bool | None = None
    """The worker can answer ``normalize: false``."""
    prompts: Mapping[str, str] | None = None
    default_prompt_name: str | None = None
    sparse: bool | None = None
    """A sparse (SPLADE) model's weights, which take no output option."""
    token_dim: int | None = None
    can_output_tokens: bool | None = None
    """The queue's backend answers ``output: tokens``."""


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """The options one request asked for, checked; a field left None takes the default."""

    prompt: str | None = None
    """The prompt text ``prompt`` or ``prompt_name`` gives; None: the model's default."""
    dimensions: int | None = None
    normalize: bool | None = None
    truncate: bool | None = None
    raw_scores: bool = False
    output_tokens: bool = False
    """The row is the token embeddings, flattened (tokens x token_dim)."""
    cache: bool = True

    @property
    def shapes_output(self) -> bool:
        """Whether a result must be re-shaped from the model's default answer."""
        return (self.dimensions is not None or self.normalize is not None or self.raw_scores
                or self.output_tokens)


NO_OPTIONS = RequestOptions()


class OptionError(ValueError):
    """An option the model refuses; ``param`` names the ``opts`` key at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


_KNOWN: frozenset[str] = WorkerOptions.__optional_keys__


def parse_options(opts: Mapping[str, Any], facts: ModelFacts) -> RequestOptions:
    """The options in ``opts``, checked against the model; :class:`OptionError` names a bad one."""
    if not any(key in opts for key in _KNOWN):
        return NO_OPTIONS
    prompt = _prompt(opts, facts)
    dimensions = _dimensions(opts.get("dimensions"), facts)
    normalize = _flag(opts, "normalize")
    if normalize is not None:
        _embedding_only("normalize", facts)
        if normalize is False and facts.normalized and facts.raw_vectors is False:
            raise OptionError("normalize", "normalize false: this queue's backend only answers "
                              "unit-length embeddings")
    raw_scores = _flag(opts, "raw_scores")
    if raw_scores is not None and (facts.sparse or facts.embeds):
        kind = "is sparse" if facts.sparse else "embeds"
        raise OptionError(
            "raw_scores", f"raw_scores applies to classifiers and rerankers; this model {kind}")
    output_tokens = _output_tokens(opts.get("output"), facts)
    if output_tokens and (dimensions is not None or normalize is not None):
        raise OptionError("output", "output tokens takes no dimensions or normalize (raw token "
                          "vectors)")
    return RequestOptions(prompt, dimensions, normalize, _flag(opts, "truncate"), bool(raw_scores),
                          output_tokens, _flag(opts, "cache") is not False)


def default_prompt(facts: ModelFacts) -> str:
    """The prompt a request that names none gets ("" when the model has no default)."""
    if facts.default_prompt_name is None or not facts.prompts:
        return ""
    return facts.prompts.get(facts.default_prompt_name, "")


def prompt_of(options: RequestOptions, facts: ModelFacts) -> str:
    """The text this request's input is prefixed with."""
    return default_prompt(facts) if options.prompt is None else options.prompt


def _prompt(opts: Mapping[str, Any], facts: ModelFacts) -> str | None:
    name, text = opts.get("prompt_name"), opts.get("prompt")
    if name is not None and text is not None:
        raise OptionError("prompt_name", "give prompt_name or prompt, not both")
    if text is not None:
        if not isinstance(text, str):
            raise OptionError("prompt", f"prompt must be a string, got {type(text).__name__}")
        if len(text) > MAX_PROMPT_CHARS:
            raise OptionError("prompt",
                              f"prompt is {len(text)} characters, over {MAX_PROMPT_CHARS}")
        return text
    if name is None:
        return None
    if not isinstance(name, str):
        raise OptionError("prompt_name", f"prompt_name must be a string, got {type(name).__name__}")
    if facts.prompts is None:
        return None  # the producer, without the model's prompts: the worker decides
    if name not in facts.prompts:
        known = sorted(facts.prompts)
        have = f"its prompts are {known}" if known else "it has no named prompts"
        raise OptionError("prompt_name",
                          f"prompt_name {name!r} is not one of this model's prompts ({have})")
    return facts.prompts[name]


def _dimensions(value: object, facts: ModelFacts) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionError("dimensions",
                          f"dimensions must be an integer, got {type(value).__name__}")
    _embedding_only("dimensions", facts)
    if not 1 <= value <= MAX_DIMENSIONS:
        shown = f"{value}" if abs(value) < 10**12 else f"a {value.bit_length()}-bit integer"
        raise OptionError("dimensions",
                          f"dimensions must be from 1 to {MAX_DIMENSIONS}, got {shown}")
    if facts.dim is not None and value > facts.dim:
        raise OptionError("dimensions", f"dimensions {value} is more than the model's {facts.dim}")
    return value


OUTPUTS = ("tokens",)
"""The values ``output`` takes (absent: the model's pooled answer)."""


def _output_tokens(value: object, facts: ModelFacts) -> bool:
    if value is None:
        return False
    if value not in OUTPUTS:
        raise OptionError("output", f"output must be one of {list(OUTPUTS)}, got {value!r}")
    _embedding_only("output", facts)
    if facts.can_output_tokens is False:
        raise OptionError("output", "output tokens: this queue's backend does not answer token "
                          "embeddings")
    return True


def _flag(opts: Mapping[str, Any], name: str) -> bool | None:
    value = opts.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise OptionError(name, f"{name} must be true or false, got {type(value).__name__}")


def _embedding_only(name: str, facts: ModelFacts) -> None:
    if facts.sparse:
        raise OptionError(name,
                          f"{name} applies to dense embeddings; this model is sparse (SPLADE)")
    if facts.embeds is False:
        raise OptionError(name, f"{name} applies to embeddings; this model answers scores")
