"""What a queue's config hash lets a producer decide before it enqueues anything.

Every early refusal, and the choice between the exact and the heuristic
token estimate, lives here. Workers write ``keys.config(q)`` at start
(``max_input_tokens``, ``policy``, ``pairs``, ``tokenizer``, ...); the
clients read it at most once per ``config_ttl_s`` and hand it to a
:class:`ConfigCache`, so an enqueue stays one round trip. Like the rest of
the core this module does no I/O and reads no clock: the clients pass the
time, fetch the hash and load tokenizer files themselves (the async client
in a thread).

The rules:

* No config hash (no worker has started yet), or one the producer may not
  read: nothing is refused.
* ``pairs=0``: a request with a ``text_pair`` is refused; the worker would
  answer ``bad_request``.
* ``policy=reject`` with ``max_input_tokens``: an input over the limit is
  refused with :class:`InputTooLong` when the producer can tell. With an
  exact count (the queue's own tokenizer) that is ``tokens > limit``, the
  worker's own test. With the heuristic it is ``tokens > limit *
  HEURISTIC_MARGIN``: the heuristic overestimates some texts (by up to a
  third on the demo corpus), and refusing a request the worker would have
  run is worse than letting a borderline one through, which the worker
  answers with ``too_long`` a moment later.
* ``truncate`` and ``chunk`` accept input of any length, so nothing is
  refused for length.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from tokenq.producer.estimate import estimate_tokens
from tokenq.shared.errors import BadRequest, ConfigError, ErrorCode
from tokenq.shared.queue_config import QueueConfig
from tokenq.shared.queue_config import model_facts as model_facts  # its one home is shared

log = logging.getLogger("tokenq.producer")

HEURISTIC_MARGIN = 1.5
"""The heuristic estimate must exceed the limit by this factor before the producer refuses.

Measured against all-MiniLM-L6-v2's tokenizer the heuristic overestimates
ordinary English by at most 1.33x (a short text; long ones at most 1.2x,
docs/ESTIMATES.md); 1.5 leaves room for text unlike the corpus. Texts made
almost only of long common words can still be overestimated more, which is
why an exact tokenizer is preferred whenever the producer can load one.
"""

AUTO_EXACT_MAX_CHARS = 50_000
"""With ``estimator="auto"``, longer inputs get the heuristic even when a tokenizer is loaded.

An exact count costs the caller's thread (the event loop, for AsyncClient)
about 1.4 s per MiB of text against the heuristic's 0.2 s (30 ms for
50,000 characters). 50,000 characters is about 10,000 tokens of English,
past most models' limits: under ``reject`` the margin still refuses such an
input for any limit up to about 7,000 tokens, and the worker's own check
catches the rest. ``estimator="exact"`` counts everything exactly.
"""

DEFAULT_CONFIG_TTL_S = 30.0
"""How long a read of the config hash is trusted before the next enqueue re-reads it."""

EstimatorMode = Literal["auto", "heuristic", "exact"]
ESTIMATOR_MODES: tuple[EstimatorMode, ...] = ("auto", "heuristic", "exact")

PairEstimate = Callable[[str, str | None], int]


class InputTooLong(BadRequest):
    """An input is over the queue's ``max_input_tokens`` and the queue rejects such input.

    Raised before enqueueing, so nothing was written. The worker would have
    answered ``too_long`` (``code``). ``exact`` says whether ``tokens`` is
    the queue tokenizer's count or the heuristic's estimate.
    """

    code = ErrorCode.TOO_LONG.value

    def __init__(
        self, where: str, tokens: int, limit: int, queue: str, exact: bool, param: str = "text",
        why: str = "policy reject",
    ) -> None:
        if exact:
            size = f"{tokens} tokens"
        else:
            size = (
                f"an estimated {tokens} tokens (heuristic; refused only past "
                f"{HEURISTIC_MARGIN:g}x the limit)"
            )
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
    """Inputs longer than this are estimated with the heuristic (see AUTO_EXACT_MAX_CHARS)."""

    def for_length(self, chars: int) -> Estimating:
        """This view, or the heuristic one for an input too long to count exactly here."""
        if self.exact_max_chars is None or chars <= self.exact_max_chars:
            return self
        return Estimating(estimate_tokens, False, self.config)

    def ensure_exact(self, queue: str) -> None:
        """Raise :class:`ConfigError` when ``estimator="exact"`` cannot be honoured."""
        if self.exact_problem is not None:
            raise ConfigError(
                f"estimator='exact' but queue {queue!r} gives no tokenizer the producer can "
                f"load: {self.exact_problem}; nothing was written"
            )

    def check(
        self, queue: str, *, tokens: int, has_pair: bool, where: str,
        truncate: bool | None = None, param: str = "text",
    ) -> None:
        """Refuse what the worker would refuse, when the producer can tell (see the module).

        ``truncate`` is the request's own option, which overrides the queue's
        policy: true is never refused for length, false is on a truncate queue.
        ``param`` names the argument the input came in (``text``, ``texts``).
        """
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


@dataclass
class ConfigCache:
    """The last config read, the estimator it selects, and when to read again.

    ``mode`` is the client's ``estimator`` choice: ``auto`` counts exactly
    when the config names a tokenizer the producer can load and falls back
    to the heuristic otherwise; ``heuristic`` never loads one; ``exact``
    refuses to enqueue without one. A caller's own estimator (``custom``)
    is exact only if it says so with an ``exact = True`` attribute.
    Tokenizer loads are remembered per path (success or failure), so a
    refresh never reloads a file and a bad path is tried once.
    """

    mode: EstimatorMode | Literal["custom"]
    custom: PairEstimate | None = None
    custom_exact: bool = False
    ttl_s: float = DEFAULT_CONFIG_TTL_S
    _read_at: float | None = field(default=None, init=False)
    _pending_at: float | None = field(default=None, init=False)
    _loaded: dict[str, PairEstimate | str] = field(default_factory=dict, init=False)
    _view: Estimating | None = field(default=None, init=False)

    def due(self, now_s: float) -> bool:
        """Whether the next enqueue should read the config hash first."""
        return self._read_at is None or now_s - self._read_at >= self.ttl_s

    def take(self, fields: Mapping[str, str] | None, now_s: float) -> str | None:
        """Adopt a fresh read (None: unreadable, treated as missing).

        Returns the path of a tokenizer the client should load and hand to
        :meth:`take_tokenizer` before the next request, or None. Until it
        does, the read does not count (:meth:`due` stays true), so a load
        cut short by a cancelled caller is redone by the next one.
        """
        config = QueueConfig.parse(fields or {})
        path = config.tokenizer if config is not None else None
        wants_tokenizer = self.mode in ("auto", "exact") and path is not None
        if wants_tokenizer and path not in self._loaded:
            self._view = self._select(config, None)
            self._pending_at = now_s
            return path
        self._view = self._select(config, self._loaded.get(path) if path else None)
        self._read_at = now_s
        return None

    def take_tokenizer(self, path: str, loaded: PairEstimate | str) -> None:
        """Adopt the result of loading ``path``: an estimator, or why it failed."""
        self._loaded[path] = loaded
        if isinstance(loaded, str):
            log.debug(
                "tokenizer %s named by the queue config is unusable (%s); "
                "using the heuristic estimate",
                path,
                loaded,
            )
        view = self._view
        if view is not None and view.config is not None and view.config.tokenizer == path:
            self._view = self._select(view.config, loaded)
            if self._pending_at is not None:
                self._read_at, self._pending_at = self._pending_at, None

    def current(self) -> Estimating:
        """The view a request is estimated and checked with."""
        if self._view is None:
            self._view = self._select(None, None)
        return self._view

    def _select(self, config: QueueConfig | None, loaded: PairEstimate | str | None) -> Estimating:
        if self.mode == "custom" and self.custom is not None:
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
