"""What a queue's config hash lets a producer refuse before it enqueues, how it counts tokens,
and the client's copy of the hash; no I/O and no clock (docs/ESTIMATES.md)."""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from tokenq.producer.estimate import estimate_tokens
from tokenq.shared.errors import BadRequest, ErrorCode
from tokenq.shared.queue_config import QueueConfig, model_facts, parse_config
from tokenq.shared.request_options import ModelFacts

log = logging.getLogger("tokenq.producer")

HEURISTIC_MARGIN = 1.5
"""The heuristic estimate must exceed the limit by this factor before the producer refuses:
it overestimates ordinary English by at most 1.33x (docs/ESTIMATES.md)."""

AUTO_EXACT_MAX_CHARS = 50_000
"""With ``estimator="auto"``, longer inputs get the heuristic even with a tokenizer loaded:
an exact count costs the caller about 1.4 s per MiB (docs/ESTIMATES.md)."""

DEFAULT_CONFIG_TTL_S = 30.0
"""How long a read of the config hash is trusted before the next enqueue re-reads it."""

EstimatorMode = Literal["auto", "heuristic", "exact"]
ESTIMATOR_MODES: tuple[EstimatorMode, ...] = ("auto", "heuristic", "exact")
PairEstimate = Callable[[str, str | None], int]
Estimator = Callable[[str], int] | Callable[[str, str | None], int]
"""Token estimator: ``f(text)`` or ``f(text, text_pair)``; one with ``exact = True`` is
compared with the queue's limit without the heuristic's margin."""

EstimatorChoice = EstimatorMode | Estimator | None
"""A client's ``estimator=``: a mode (None: ``"auto"``) or a callable."""


class InputTooLong(BadRequest):
    """An input is over the queue's ``max_input_tokens`` and the queue rejects such input (the
    worker would answer ``too_long``); nothing was written. ``exact``: whether ``tokens`` is the
    queue tokenizer's count or the heuristic's."""

    code = ErrorCode.TOO_LONG.value

    def __init__(
        self, where: str, tokens: int, limit: int, queue: str, exact: bool, param: str = "text",
        why: str = "policy reject",
    ) -> None:
        size = f"{tokens} tokens" if exact else (
            f"an estimated {tokens} tokens (heuristic; refused only past "
            f"{HEURISTIC_MARGIN:g}x the limit)")
        super().__init__(
            f"{where} is {size}, over the limit of {limit} tokens of queue {queue!r} "
            f"(max_input_tokens, {why}); nothing was written",
            param=param,
        )
        self.tokens = tokens
        self.limit = limit
        self.queue = queue
        self.exact = exact


@dataclass(frozen=True, slots=True)
class Estimating:
    """One consistent view for a request: how to count, whether exactly, what to check."""

    estimate: PairEstimate
    exact: bool
    config: QueueConfig | None
    exact_problem: str | None = None
    """Why there is no exact count, when ``estimator="exact"`` asked for one."""
    exact_max_chars: int | None = None
    """Longer inputs are estimated with the heuristic (:data:`AUTO_EXACT_MAX_CHARS`)."""

    def for_length(self, chars: int) -> Estimating:
        if self.exact_max_chars is None or chars <= self.exact_max_chars:
            return self
        return Estimating(estimate_tokens, False, self.config)

    def check(
        self, queue: str, *, tokens: int, has_pair: bool, where: str,
        truncate: bool | None = None, param: str = "text",
    ) -> None:
        """Refuse a pair when ``pairs=0``, and past ``max_input_tokens`` under ``policy=reject``;
        ``truncate``, the request's own option, overrides the queue's policy (but ``chunk``)."""
        config = self.config
        if config is None:
            return
        if has_pair and config.pairs is False:
            model = f"model {config.model!r}" if config.model else "model"
            raise BadRequest(
                f"{where} has a text_pair, but queue {queue!r} serves a {model} that takes "
                "single texts (its config says pairs=0); nothing was written",
                param="text_pair",
            )
        limit = config.max_input_tokens
        policy = config.policy
        if truncate is not None and policy != "chunk":
            policy = "truncate" if truncate else "reject"
        if policy != "reject" or limit is None:
            return
        ceiling = limit if self.exact else math.floor(limit * HEURISTIC_MARGIN)
        if tokens > ceiling:
            why = "the request asked truncate: false" if truncate is False else "policy reject"
            raise InputTooLong(where, tokens, limit, queue, self.exact, param, why)


class ConfigCache:
    """One client's copy of the config hash, the estimator it selects (``mode``: the client's
    ``estimator``, ``custom`` for a callable) and when to read again; tokenizer loads are kept per
    path, success or failure. Changed under a lock (by callers and the tokenizer loader)."""

    def __init__(
        self, estimator: EstimatorChoice = None, ttl_s: float = DEFAULT_CONFIG_TTL_S, key: str = ""
    ) -> None:
        """The client's ``estimator=`` and ``config_ttl_s=``; ``key``: the config hash's, named
        when it cannot be read."""
        if (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float))
                or not math.isfinite(ttl_s) or ttl_s < 0):
            raise BadRequest(f"config_ttl_s must be a number of seconds, finite and >= 0, got "
                             f"{ttl_s!r}", param="config_ttl_s")
        chosen = "auto" if estimator is None else estimator
        self.mode: EstimatorMode | Literal["custom"] = "custom"
        self.custom: PairEstimate | None = None
        if isinstance(chosen, str) and chosen in ESTIMATOR_MODES:
            self.mode = chosen  # type: ignore[assignment]
        elif isinstance(chosen, str) or not callable(chosen):
            modes = ", ".join(map(repr, ESTIMATOR_MODES))
            raise BadRequest(f"estimator must be one of {modes} (a mode name) or a callable, got "
                             f"{estimator!r}", param="estimator")
        else:
            self.custom = _pair_aware(chosen)
        self.custom_exact = getattr(estimator, "exact", False) is True
        self.ttl_s = float(ttl_s)
        self.key = key
        self._read_at: float | None = None
        self._pending_at: float | None = None
        self._loaded: dict[str, PairEstimate | str] = {}
        self._view: Estimating | None = None
        self._lock = threading.Lock()
        self._warned = False
        self._facts_of: tuple[QueueConfig | None, ModelFacts] | None = None

    def due(self, now_s: float) -> bool:
        """Whether the next enqueue should read the config hash first."""
        return self._read_at is None or now_s - self._read_at >= self.ttl_s

    def take(self, fields: Mapping[str, str] | None, now_s: float) -> str | None:
        """Adopt a fresh read (None: unreadable); the path of a tokenizer to load, or None. Until
        :meth:`take_tokenizer` has it the read does not count (:meth:`due` stays true): a load cut
        short by a cancelled caller is redone by the next one."""
        config = parse_config(fields or {})
        path = config.tokenizer if config is not None else None
        with self._lock:
            if self.mode in ("auto", "exact") and path is not None and path not in self._loaded:
                self._view = self._select(config, None)
                self._pending_at = now_s
                return path
            self._view = self._select(config, self._loaded.get(path) if path else None)
            self._read_at = now_s
            return None

    def take_tokenizer(self, path: str, loaded: PairEstimate | str | BaseException) -> None:
        """Adopt the result of loading ``path``: an estimator, or why it failed."""
        if isinstance(loaded, BaseException):
            loaded = f"cannot load {path}: {loaded}"
        if isinstance(loaded, str):
            log.debug("tokenizer %s named by the queue config is unusable (%s); "
                      "using the heuristic estimate", path, loaded)
        with self._lock:
            self._loaded[path] = loaded
            view = self._view
            if view is not None and view.config is not None and view.config.tokenizer == path:
                self._view = self._select(view.config, loaded)
                if self._pending_at is not None:
                    self._read_at, self._pending_at = self._pending_at, None

    def unreadable(self, error: Exception, now_s: float) -> None:
        """Carry on without early checks when Redis refuses the read (a producer's minimal ACL
        need not allow it: docs/PROTOCOL.md); warned once."""
        level = logging.DEBUG if self._warned else logging.WARNING
        log.log(level, "cannot read %s (%s); enqueueing without early checks", self.key, error)
        self._warned = True
        self.take(None, now_s)

    def current(self) -> Estimating:
        """The view a request is estimated and checked with."""
        if self._view is None:
            self._view = self._select(None, None)
        return self._view

    def config(self) -> QueueConfig | None:
        """The config hash last read (None: none readable)."""
        return self.current().config

    def facts(self) -> ModelFacts:
        """What the config says of the model, made once per read."""
        config = self.config()
        made = self._facts_of
        if made is None or made[0] is not config:
            made = self._facts_of = (config, model_facts(config))
        return made[1]

    def _select(self, config: QueueConfig | None, loaded: PairEstimate | str | None) -> Estimating:
        if self.custom is not None:
            return Estimating(self.custom, self.custom_exact, config)
        if self.mode != "heuristic" and loaded is not None and not isinstance(loaded, str):
            cap = AUTO_EXACT_MAX_CHARS if self.mode == "auto" else None
            return Estimating(loaded, True, config, exact_max_chars=cap)
        problem = None
        if self.mode == "exact":
            if config is None:
                problem = "its config hash is missing (no worker has started yet)"
            elif config.tokenizer is None:
                problem = "its config names no tokenizer"
            else:
                problem = loaded if isinstance(loaded, str) else "the tokenizer is not loaded yet"
        return Estimating(estimate_tokens, False, config, problem)


def _pair_aware(estimator: Estimator) -> PairEstimate:
    """``estimator`` callable as ``f(text, text_pair)``; a one-argument one counts each text
    (it cannot know the pair's extra separator)."""
    try:
        params = inspect.signature(estimator).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return lambda text, pair: estimator(text)  # type: ignore[call-arg]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params):
        return estimator  # type: ignore[return-value]

    def one_at_a_time(text: str, pair: str | None) -> int:
        total = estimator(text)  # type: ignore[call-arg]
        return total if pair is None else total + estimator(pair)  # type: ignore[call-arg]

    return one_at_a_time

