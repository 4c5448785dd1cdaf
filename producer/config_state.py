"""A client's copy of its queue's config hash, shared by every lane and caller of the client.

:mod:`tokenq.producer.config` holds the rules (what a config lets a producer
refuse, which estimate it counts with); :class:`ConfigState` holds one
client's state around them: the :class:`ConfigCache` built from its
``estimator=`` and ``config_ttl_s=`` arguments, the lock that makes each
change whole (the cache changes from whichever caller reads the hash and
from the thread that loads a tokenizer), whether the client already warned
that it may not read the hash, and the model facts of the config in use.
No I/O: the calls read the hash and load tokenizer files, and hand over
what they got with the time.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Callable, Mapping

from tokenq.producer.config import (
    ESTIMATOR_MODES,
    ConfigCache,
    Estimating,
    EstimatorMode,
    PairEstimate,
    model_facts,
)
from tokenq.shared.errors import BadRequest
from tokenq.shared.queue_config import QueueConfig
from tokenq.shared.request_options import ModelFacts

log = logging.getLogger("tokenq.producer")

Estimator = Callable[[str], int] | Callable[[str, str | None], int]
"""Token estimator: ``f(text)`` or ``f(text, text_pair)`` -> estimated tokens.

An estimator with an ``exact = True`` attribute is trusted as exact: inputs
are compared with the queue's limit without the heuristic's safety margin.
"""

EstimatorChoice = EstimatorMode | Estimator | None
"""What a client's ``estimator=`` takes: ``"auto"`` (the default; None means
the same), ``"heuristic"``, ``"exact"``, or a callable."""


def _pair_aware(estimator: Estimator) -> Callable[[str, str | None], int]:
    """Wrap ``estimator`` so it can always be called as ``f(text, text_pair)``.

    A one-argument estimator is called once per text and the sums added: it
    cannot know about the pair's extra separator, and one token hardly matters.
    """
    try:
        params = inspect.signature(estimator).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return lambda text, pair: estimator(text)  # type: ignore[call-arg]
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params):
        return estimator  # type: ignore[return-value]

    def one_at_a_time(text: str, pair: str | None) -> int:
        total = estimator(text)  # type: ignore[call-arg]
        return total if pair is None else total + estimator(pair)  # type: ignore[call-arg]

    return one_at_a_time


def config_cache(estimator: EstimatorChoice, config_ttl_s: float) -> ConfigCache:
    """The config cache for a client's ``estimator=`` and ``config_ttl_s=`` arguments."""
    if isinstance(config_ttl_s, bool) or not isinstance(config_ttl_s, (int, float)):
        raise BadRequest(f"config_ttl_s must be a number of seconds, got {config_ttl_s!r}",
                         param="config_ttl_s")
    if not math.isfinite(config_ttl_s) or config_ttl_s < 0:
        raise BadRequest(f"config_ttl_s must be a finite number >= 0, got {config_ttl_s!r}",
                         param="config_ttl_s")
    if estimator is None:
        return ConfigCache("auto", ttl_s=float(config_ttl_s))
    if isinstance(estimator, str):
        if estimator not in ESTIMATOR_MODES:
            raise BadRequest(
                f"estimator must be one of {', '.join(map(repr, ESTIMATOR_MODES))} "
                f"or a callable, got {estimator!r}",
                param="estimator",
            )
        return ConfigCache(estimator, ttl_s=float(config_ttl_s))  # type: ignore[arg-type]
    if not callable(estimator):
        raise BadRequest(f"estimator must be a mode name or a callable, got {estimator!r}",
                         param="estimator")
    exact = getattr(estimator, "exact", False) is True
    return ConfigCache(
        "custom", custom=_pair_aware(estimator), custom_exact=exact, ttl_s=float(config_ttl_s)
    )


def decode_config(raw: Mapping[bytes, bytes]) -> dict[str, str]:
    """The config hash as text (undecodable bytes replaced, never an exception)."""
    return {
        k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()
    }


class ConfigState:
    """One client's config cache, changed whole under a lock (see the module)."""

    def __init__(self, cache: ConfigCache, config_key: str) -> None:
        self.cache = cache
        self.key = config_key
        """The config hash's key, named in the warning when it cannot be read."""
        self._lock = threading.Lock()
        self._warned = False
        self._facts_of: tuple[QueueConfig | None, ModelFacts] | None = None

    def due(self, now_s: float) -> bool:
        """Whether the next enqueue should read the config hash first (monotonic ``now_s``)."""
        return self.cache.due(now_s)

    def current(self) -> Estimating:
        """The view a request is estimated and checked with."""
        return self.cache.current()

    def config(self) -> QueueConfig | None:
        """The config hash last read (None: none, or none readable)."""
        return self.cache.current().config

    def facts(self) -> ModelFacts:
        """What the config says of the model, made once per config read."""
        config = self.config()
        made = self._facts_of
        if made is None or made[0] is not config:
            made = self._facts_of = (config, model_facts(config))
        return made[1]

    def take(self, raw: Mapping[bytes, bytes], now_s: float) -> str | None:
        """Adopt a fresh HGETALL of the config hash (read at monotonic ``now_s``).

        Returns the path of a tokenizer.json to load (with
        :func:`tokenq.producer.tokenizer.load_estimator`) and hand to
        :meth:`take_tokenizer` before the next request, or None.
        """
        with self._lock:
            return self.cache.take(decode_config(raw), now_s)

    def take_tokenizer(self, path: str, loaded: PairEstimate | str | BaseException) -> None:
        """Adopt the result of loading ``path``: an estimator, or why (or how) it failed."""
        if isinstance(loaded, BaseException):
            loaded = f"cannot load {path}: {loaded}"
        with self._lock:
            self.cache.take_tokenizer(path, loaded)

    def unreadable(self, error: Exception, now_s: float) -> None:
        """Carry on without early checks when Redis refuses the read (an ACL, a wrong type).

        A producer's minimal ACL need not allow reading the config hash
        (docs/PROTOCOL.md), so this is a warning, once, not a failure: the
        worker still checks every request.
        """
        level = logging.DEBUG if self._warned else logging.WARNING
        log.log(level, "cannot read %s (%s); enqueueing without early checks", self.key, error)
        self._warned = True
        with self._lock:
            self.cache.take(None, now_s)
