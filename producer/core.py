"""What a producer decides, for both clients: no I/O, no redis, no asyncio.

Everything a producer decides about a request lives here, in the manner of
httpx's ``BaseClient``: merging settings, checking what the caller passed,
making request ids, building stream fields, choosing reply keys, laying out
the enqueue script's arguments, turning reply bytes into a :class:`Result`
or an exception, and sizing each blocking wait. What the queue's config
hash lets it refuse early lives in :mod:`tokenq.producer.config`. Its
decisions take the time as an argument (``now_ms``, ``now_s``; only a
:class:`Deadline` reads the monotonic clock), so tests can drive it
directly.

The order of the commands that carry these decisions out (read the config,
enqueue, wait, retry) is :mod:`tokenq.producer.calls`; the redis-py glue
that keeps each command within its caller's :class:`Deadline` is
:mod:`tokenq.producer.connection`.
"""

from __future__ import annotations

import array
import copy
import inspect
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pydantic

from tokenq.producer.config import (
    DEFAULT_CONFIG_TTL_S,
    ESTIMATOR_MODES,
    ConfigCache,
    EstimatorMode,
    PairEstimate,
    model_facts,
)
from tokenq.producer.options import SubmitOptions, worker_options
from tokenq.producer.shards import ShardChooser, shard_count
from tokenq.shared import keys, lua, wire
from tokenq.shared.cli import plural
from tokenq.shared.errors import (
    BadRequest,
    BrokerOutOfMemory,
    BrokerUnavailable,
    DecodeError,
    ErrorCode,
    NotReplicated,
    QueueFull,
    RemoteError,
    TokenqError,
    remote_error,
)
from tokenq.shared.queue_config import QueueConfig
from tokenq.shared.redis_url import redact
from tokenq.shared.request_options import (
    NO_OPTIONS,
    ModelFacts,
    RequestOptions,
    parse_options,
    prompt_of,
)
from tokenq.shared.settings import MAX_SECONDS, ClientSettings, describe_errors

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("tokenq.producer")

Estimator = Callable[[str], int] | Callable[[str, str | None], int]
"""Token estimator: ``f(text)`` or ``f(text, text_pair)`` -> estimated tokens.

An estimator with an ``exact = True`` attribute is trusted as exact: inputs
are compared with the queue's limit without the heuristic's safety margin.
"""

EstimatorChoice = EstimatorMode | Estimator | None
"""What a client's ``estimator=`` takes: ``"auto"`` (the default; None means
the same), ``"heuristic"``, ``"exact"``, or a callable."""

TextItem = str | tuple[str, str]
"""One input of a batch: a text, or a ``(text, text_pair)`` pair for rerankers."""

ENQUEUE_SCRIPT = lua.load("tokenq.producer", "enqueue.lua")
"""Source of the atomic backpressure script (see enqueue.lua for its contract)."""

PEEK_SCRIPT = lua.load("tokenq.producer", "peek_replies.lua")
"""Source of the script that reads a caller's own reply keys without removing anything."""

BAD_REPLY = ErrorCode.BAD_REPLY.value
"""Error code of a :class:`RemoteError` raised for a reply that does not decode."""

BLOCK_FLOOR_S = 0.01
"""Shortest blocking wait; a timeout of 0 would block forever, which tokenq never does."""

BACKOFF_BASE_S = 0.02
BACKOFF_CAP_S = 0.5
"""Outages are retried with exponential backoff between these (by redis-py and by the calls)."""

DEADLINE_GRACE_S = 0.2
"""How far past the caller's deadline one Redis command may run before it is cut off.

A blocking read that blocks for exactly the caller's remaining time must get its
``nil`` back before the socket gives up on it (else a healthy Redis would be
reported as unreachable), so every socket wait is the remaining time plus
this. It is also the most a command started at the deadline may take.
"""


def backoff_s(failures: int) -> float:
    """The pause after the ``failures``-th outage in a row that redis-py's retries gave up on."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**failures)


class ReplyTimeout(TokenqError, TimeoutError):
    """No reply came before the caller's timeout (Redis itself was reachable).

    A builtin ``TimeoutError``, so ``except TimeoutError`` catches it. The
    request may still be running; its reply lands on its reply key later and
    expires there, and ``Client.result(id)`` can still fetch it.
    """

    def __init__(self, request_ids: Sequence[str], waited_s: float, why: str | None = None) -> None:
        shown = ", ".join(request_ids[:5])
        more = f" and {len(request_ids) - 5} more" if len(request_ids) > 5 else ""
        super().__init__(
            f"no reply after {waited_s:.2f}s for {plural(len(request_ids), 'request')}: "
            f"{shown}{more}"
            + (f"; {why}" if why else "")
        )
        self.request_ids = tuple(request_ids)
        self.waited_s = waited_s
        self.why = why
        """What the client saw when it gave up (no live worker serves the queue), if anything."""


UNCONFIRMED_WARN_EVERY_S = 60.0
"""The warning for requests a durable enqueue wrote unconfirmed is logged at most this
often per client (the rest at DEBUG, every one counted): a replica down for an hour
must not write a line per request."""


class Unconfirmed:
    """How many requests durable enqueues wrote that too few replicas confirmed in time.

    One per client, shared by its core and every lane (thread-safe), read as
    ``Client.unreplicated`` (the gateway's ``tokenq_serve_unreplicated_requests``).
    It also spaces the warning the infer calls log (:data:`UNCONFIRMED_WARN_EVERY_S`).
    """

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._warned_at = -math.inf

    def add(self, n: int, now_s: float) -> bool:
        """Count ``n`` more; whether a warning is due (monotonic ``now_s``)."""
        with self._lock:
            self.count += n
            due = now_s - self._warned_at >= UNCONFIRMED_WARN_EVERY_S
            if due:
                self._warned_at = now_s
            return due


@dataclass(frozen=True, slots=True)
class Result:
    """A worker's successful answer to one request.

    ``embedding`` is an ``array.array('f')`` (no numpy needed;
    ``numpy.frombuffer(result.embedding, numpy.float32)`` views it without a
    copy) for embedding models; ``scores`` is set for classifiers and
    rerankers. ``tokens`` is the exact token count the worker ran, when it
    says so.
    """

    id: str
    embedding: array.array | None  # typecode "f"; not subscriptable at runtime before 3.12
    dim: int | None
    scores: tuple[float, ...] | None
    tokens: int | None
    labels: tuple[str, ...] | None = None
    """A classifier's label for each score, in order, when the model names them."""
    sparse: tuple[tuple[int, float], ...] | None = None
    """A sparse (SPLADE, ``--task sparse``) model's nonzero (token id, weight) pairs, in
    increasing token id; ``dim`` is then the vocabulary's size."""
    token_embeddings: tuple[array.array, ...] | None = None
    """``output="tokens"``: one ``array('f')`` of ``dim`` values per token, in order."""

    def __repr__(self) -> str:
        """A short summary: a 384-float vector printed whole buries everything else.

        ``Result(id='r1', dim=384, embedding=[0.0123, -0.04, 0.0781, … 384 values],
        tokens=7)``; a classifier's scores are shown with their labels.
        """
        def head(values: Sequence[Any], show: Callable[[Any], str] = "{:.4g}".format,
                 brackets: str = "[]") -> str:
            shown = ", ".join(show(value) for value in values[:3])
            more = f", … {len(values)} values" if len(values) > 3 else ""
            return f"{brackets[0]}{shown}{more}{brackets[1]}"

        parts = [f"id={self.id!r}"]
        if self.embedding is not None:
            dim = self.dim if self.dim is not None else len(self.embedding)
            parts += [f"dim={dim}", f"embedding={head(self.embedding)}"]
        if self.scores is not None:
            if self.labels is not None and len(self.labels) == len(self.scores):
                pairs = [f"{label!r}: {score:.4g}"
                         for label, score in zip(self.labels, self.scores, strict=True)]
                parts.append(f"scores={head(pairs, str, '{}')}")
            else:
                parts.append(f"scores={head(self.scores)}")
        if self.token_embeddings is not None:
            parts.append(f"token_embeddings=[{len(self.token_embeddings)} x {self.dim}]")
        if self.sparse is not None:
            parts.append(f"sparse={head(self.sparse, lambda p: f'{p[0]}: {p[1]:.4g}', '{}')}")
        parts.append(f"tokens={self.tokens}")
        return f"Result({', '.join(parts)})"


@dataclass(frozen=True, slots=True)
class Prepared:
    """One validated request, ready for the enqueue script."""

    id: str
    reply_to: str
    fields: dict[str, str | bytes]


Outcome = Result | RemoteError


@dataclass(frozen=True, slots=True)
class _Shared:
    """The parts of a request that one call's options decide for all its requests."""

    reply_to: str | None
    timeout_ms: int | None
    opts: Mapping[str, Any]
    priority: int
    prompt: str = ""
    """The prompt the worker will put before each text, as far as the config says."""
    truncate: bool | None = None
    """The request's ``truncate`` option, which decides what the early length check does."""


@dataclass(frozen=True, slots=True)
class Deadline:
    """When one call of a client gives up, and how it treats a Redis that is down.

    ``at`` is on the ``time.monotonic()`` clock. With ``persist`` a command
    that fails because Redis is unreachable is tried again, with backoff,
    until ``at`` (``infer``, ``infer_many``: the caller gave that time to
    get an answer, and a retried enqueue is deduplicated by the script; the
    blocking loops of every wait retry the same way by themselves); without it
    redis-py's ``retries`` are all it gets (``submit``, admin calls). Either
    way no retry or backoff starts after ``at``, and no command runs more
    than :data:`DEADLINE_GRACE_S` past it.
    """

    at: float
    persist: bool = False

    @classmethod
    def after(cls, seconds: float, *, persist: bool = False) -> Deadline:
        return cls(time.monotonic() + seconds, persist)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def left(self) -> float:
        """The time left, never negative: how long a wait for something else may last."""
        return max(0.0, self.remaining())

    def cap(self, seconds: float) -> float:
        """``seconds`` cut short to end by the deadline (a backoff that must not outlast it)."""
        return max(0.0, min(seconds, self.remaining()))


def make_settings(settings: ClientSettings | None, **overrides: Any) -> ClientSettings:
    """Settings from ``TOKENQ_*`` (or ``settings``), with non-None keyword overrides on top.

    Invalid values (a bad queue name, a negative limit) raise
    :class:`BadRequest` naming the setting, before any connection is made.
    """
    given = {name: value for name, value in overrides.items() if value is not None}
    try:
        if settings is None:
            return ClientSettings(**given)
        return ClientSettings.model_validate({**settings.model_dump(), **given})
    except pydantic.ValidationError as exc:
        problems = "; ".join(describe_errors(exc, ClientSettings, flags=False))
        raise BadRequest(f"invalid client settings: {problems}") from None


def redact_url(url: str) -> str:
    """The Redis URL with any password masked, for error messages and logs."""
    return redact(url)


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


def _check_timeout(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise BadRequest(
            f"{name} must be a positive number of seconds, at most {MAX_SECONDS:,} "
            f"(about 31 years), got {value!r}"
        )
    return float(value)


def config_cache(estimator: EstimatorChoice, config_ttl_s: float) -> ConfigCache:
    """The config cache for a client's ``estimator=`` and ``config_ttl_s=`` arguments."""
    if isinstance(config_ttl_s, bool) or not isinstance(config_ttl_s, (int, float)):
        raise BadRequest(f"config_ttl_s must be a number of seconds, got {config_ttl_s!r}")
    if not math.isfinite(config_ttl_s) or config_ttl_s < 0:
        raise BadRequest(f"config_ttl_s must be a finite number >= 0, got {config_ttl_s!r}")
    if estimator is None:
        return ConfigCache("auto", ttl_s=float(config_ttl_s))
    if isinstance(estimator, str):
        if estimator not in ESTIMATOR_MODES:
            raise BadRequest(
                f"estimator must be one of {', '.join(map(repr, ESTIMATOR_MODES))} "
                f"or a callable, got {estimator!r}"
            )
        return ConfigCache(estimator, ttl_s=float(config_ttl_s))  # type: ignore[arg-type]
    if not callable(estimator):
        raise BadRequest(f"estimator must be a mode name or a callable, got {estimator!r}")
    exact = getattr(estimator, "exact", False) is True
    return ConfigCache(
        "custom", custom=_pair_aware(estimator), custom_exact=exact, ttl_s=float(config_ttl_s)
    )



def _utf8_size(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (checked valid before): an ASCII text is not encoded."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


_UUID4_CLEAR = ~((0xC000 << 48) | (0xF000 << 64))
_UUID4_SET = (0x8000 << 48) | (4 << 76)


def _uuid4_hex() -> str:
    """``uuid.uuid4().hex``, digit for digit (RFC 4122 variant and version 4 bits), without
    the UUID object: it is made once per request (issue 25), where the object cost
    half the id's time."""
    return "%032x" % (int.from_bytes(os.urandom(16), "big") & _UUID4_CLEAR | _UUID4_SET)

class ClientCore:
    """Decisions the sync and async clients share; holds no connection."""

    def __init__(
        self,
        settings: ClientSettings,
        estimator: EstimatorChoice = None,
        config_ttl_s: float = DEFAULT_CONFIG_TTL_S,
        refuse_early: bool = True,
    ) -> None:
        self.settings = settings
        self.refuse_early = refuse_early
        self._facts_of: tuple[QueueConfig | None, ModelFacts] | None = None
        self.queue = settings.queue_ref
        self.stream_key = keys.requests(self.queue)
        self.dedupe_ttl_ms = int(self.settings.dedupe_ttl_s * 1000)
        self.config_key = keys.config(self.queue)
        self.workers_key = keys.workers(self.queue)
        self.url = redact_url(settings.redis_url)
        self.config_cache = config_cache(estimator, config_ttl_s)
        # The config cache changes from whichever caller reads the hash and
        # from the thread that loads a tokenizer; this makes each change whole.
        self._config_lock = threading.Lock()
        self._config_warned = False
        self.shard: int | None = None
        """The shard this core writes to; None for the plain queue ``{q}``."""
        self.chooser = ShardChooser(settings.shard_choice)
        self.unconfirmed_requests = Unconfirmed()
        self._lanes: dict[int | None, ClientCore] = {None: self}

    # ------------------------------------------------------------------ ids

    def new_id(self) -> str:
        """A fresh request (or batch, or client) id: 32 hex digits of uuid4.

        On a shard they follow its number (``3.<hex>``, :func:`keys.id_on_shard`),
        so the id alone leads any process to its reply key.
        """
        return keys.id_on_shard(self.shard, _uuid4_hex())

    # --------------------------------------------------------------- shards

    def shards(self) -> int:
        """The queue's shard count as this client knows it (see :mod:`.shards`)."""
        return shard_count(self.settings.shards, self.config_cache.current().config,
                           self.queue.name)

    def lane(self, shard: int | None) -> ClientCore:
        """The core that writes to ``shard`` (None: the plain ``{q}``), made once.

        A lane shares everything with this core but the keys it writes: the
        config cache, the tokenizer, the settings, the shard choice.
        """
        made = self._lanes.get(shard)
        if made is None:
            made = copy.copy(self)
            made.shard = shard
            made.queue = keys.QueueRef(self.queue.name, self.queue.prefix, shard)
            made.stream_key = keys.requests(made.queue)
            made.workers_key = keys.workers(made.queue)
            made._facts_of = None
            made = self._lanes.setdefault(shard, made)
        return made

    def shard_of_id(self, request_id: str, retired: Collection[int] = ()) -> int | None:
        """The shard whose reply namespace ``request_id``'s reply lands in; None: ``{q}``.

        An id ``k.<unique>`` names shard ``k`` only where the queue has one:
        one of its K shards now, or one of the ``retired`` shards (it had it,
        and answers its requests there while it drains). Anywhere else it is
        a plain id of ``{q}``: on a queue of one shard ``7.order-42`` is just
        an id a producer in another language chose (docs/PROTOCOL.md, "K = 1").
        """
        shard = keys.shard_in_id(request_id)
        if shard is None:
            return None
        count = self.shards()
        return shard if (count > 1 and shard < count) or shard in retired else None

    def shards_beyond(self, request_ids: Sequence[str]) -> list[int]:
        """The shards ids name that the queue does not have now: were they retired?"""
        count = self.shards()
        named = {keys.shard_in_id(request_id) for request_id in request_ids}
        return sorted(k for k in named if k is not None and (count == 1 or k >= count))

    def lanes(self) -> list[ClientCore]:
        """Every stream the queue's workers read: the shards, then the plain ``{q}``."""
        count = self.shards()
        if count == 1:
            return [self]
        return [*(self.lane(k) for k in range(count)), self]

    def reply_key(self, reply_id: str) -> str:
        """The list a request's reply (or a batch's, or a client's) lands on."""
        return keys.reply(self.queue, reply_id)

    @staticmethod
    def check_ids(request_ids: Sequence[str]) -> None:
        """BadRequest unless ``request_ids`` is a sequence of ids the protocol allows."""
        if isinstance(request_ids, str):
            raise BadRequest("request_ids must be a sequence of ids, not a single string")
        for request_id in request_ids:
            try:
                wire.validate_id(request_id, "request id")
            except DecodeError as exc:
                raise BadRequest(f"{exc}: {request_id!r}") from None

    def reply_keys(
        self, request_ids: Sequence[str], retired: Collection[int] = ()
    ) -> dict[int | None, dict[str, str]]:
        """Reply key -> request id for ids the caller wants to fetch, checked first, by the
        shard each id's reply is on (:meth:`shard_of_id`; None: the plain queue)."""
        self.check_ids(request_ids)
        by_shard: dict[int | None, dict[str, str]] = {}
        for request_id in request_ids:
            lane = self.lane(self.shard_of_id(request_id, retired))
            by_shard.setdefault(lane.shard, {})[lane.reply_key(request_id)] = request_id
        return by_shard

    # ------------------------------------------------------------- requests

    def timeout(self, timeout_s: float | None) -> float:
        """The caller's wait in seconds, defaulting to the configured one."""
        if timeout_s is None:
            return self.settings.timeout_s
        return _check_timeout(timeout_s, "timeout_s")

    def deadline(self) -> Deadline:
        """The deadline of a call without a ``timeout_s`` of its own: ``settings.timeout_s``."""
        return Deadline.after(self.settings.timeout_s)

    def unreachable(self, error: BaseException) -> BrokerUnavailable:
        """The error for Redis not answering a command (after every retry it was given)."""
        return BrokerUnavailable(f"Redis at {self.url} is unreachable: {error}")

    @staticmethod
    def infer_deadline(
        remaining_s: float, deadline_s: float | None, deadline_ms: int | None
    ) -> tuple[float | None, int | None]:
        """An infer call's deadline: the caller's own, else the rest of its timeout.

        Nobody waits for the answer after the timeout, so no worker should
        spend device time on it later. (A timeout longer than the protocol's
        largest ``timeout_ms`` is sent as that largest value.)
        """
        if deadline_s is None and deadline_ms is None:
            ceiling = wire.MAX_TIMEOUT_MS / 1000
            return min(max(remaining_s, 0.001), ceiling), None
        return deadline_s, deadline_ms

    def timeout_ms(
        self, deadline_s: float | None, deadline_ms: int | None, now_ms: int
    ) -> int | None:
        """The relative ``timeout_ms`` field from a relative or an absolute deadline.

        ``timeout_ms`` counts from the entry's stream id, which Redis stamps
        with its own clock, so no producer's clock skew reaches the workers.
        An absolute ``deadline_ms`` is turned into one with the caller's own
        clock (``now_ms``), the only place that clock is used.
        """
        if deadline_s is not None and deadline_ms is not None:
            raise BadRequest("give deadline_s (relative) or deadline_ms (absolute), not both")
        limit = wire.MAX_TIMEOUT_MS
        if deadline_s is not None:
            seconds = _check_timeout(deadline_s, "deadline_s")
            if seconds * 1000 > limit:
                raise BadRequest(
                    f"deadline_s {deadline_s!r} is out of range: at most {limit // 1000} s "
                    "(30 days)"
                )
            return max(1, math.ceil(seconds * 1000))
        if deadline_ms is None:
            return None
        if isinstance(deadline_ms, bool) or not isinstance(deadline_ms, int):
            raise BadRequest(
                f"deadline_ms must be an integer (epoch milliseconds), "
                f"got {type(deadline_ms).__name__}"
            )
        if deadline_ms <= now_ms:
            raise BadRequest(
                f"deadline_ms {deadline_ms} has already passed (now is {now_ms} epoch ms)"
            )
        if deadline_ms - now_ms > limit:
            raise BadRequest(
                f"deadline_ms {deadline_ms} is out of range: at most {limit} ms (30 days) "
                f"after now ({now_ms} epoch ms)"
            )
        return deadline_ms - now_ms

    def prepare(
        self,
        item: object,
        *,
        now_ms: int,
        text_pair: object = None,
        index: int | None = None,
        **options: Unpack[SubmitOptions],
    ) -> Prepared:
        """Validate one input and build its stream fields.

        ``item`` is a text, or (in batches) a ``(text, text_pair)`` tuple.
        ``index`` names the item's position in a batch in error messages.
        ``options`` are the caller's (:class:`~tokenq.producer.options.SubmitOptions`);
        ``reply_to`` defaults to the request's own reply key.
        """
        return self._prepare(item, text_pair, index, self._shared(options, now_ms))

    def _shared(self, options: SubmitOptions, now_ms: int) -> _Shared:
        """What the options make of every request of one call (checked once per call)."""
        reply_to = options.get("reply_to")
        opts = self._opts(options)
        checked = self._worker_options(opts)
        return _Shared(
            reply_to=None if reply_to is None else self._reply_to(reply_to),
            timeout_ms=self.timeout_ms(options.get("deadline_s"), options.get("deadline_ms"),
                                       now_ms),
            opts=opts,
            priority=wire.validate_priority(options.get("priority")),
            prompt=prompt_of(checked, self._facts()),
            truncate=checked.truncate,
        )

    def _facts(self) -> ModelFacts:
        config = self.config_cache.current().config
        if self._facts_of is None or self._facts_of[0] is not config:
            self._facts_of = (config, model_facts(config))
        return self._facts_of[1]

    def _worker_options(self, opts: Mapping[str, Any]) -> RequestOptions:
        """The request options as the worker will read them, checked against the config.

        A value the worker would refuse is a BadRequest here when ``refuse_early``
        (the config may be stale, so without it the worker decides alone).
        """
        try:
            return parse_options(opts, self._facts())
        except ValueError as exc:
            if self.refuse_early:
                raise BadRequest(f"opts: {exc}; nothing was written") from None
            return NO_OPTIONS

    def _prepare(
        self, item: object, text_pair: object, index: int | None, shared: _Shared,
        unique: str | None = None,
    ) -> Prepared:
        where = "text" if index is None else f"texts[{index}]"
        if isinstance(item, tuple) and index is not None:
            if len(item) != 2:
                raise BadRequest(f"{where} must be a string or a (text, text_pair) tuple")
            item, text_pair = item
        text = self._text(item, where)
        pair = None if text_pair is None else self._text(text_pair, f"{where} text_pair")
        size = _utf8_size(text) + (0 if pair is None else _utf8_size(pair))
        limit = self.settings.max_request_bytes
        if size > limit:
            raise BadRequest(f"{where} is {size} bytes of UTF-8, over the limit of {limit} bytes")
        chars = len(text) + (0 if pair is None else len(pair))
        estimating = self.config_cache.current().for_length(chars)
        estimating.ensure_exact(self.queue.name)
        tokens = self._tokens(estimating.estimate, shared.prompt + text, pair, where)
        if self.refuse_early:
            estimating.check(self.queue.name, tokens=tokens, has_pair=pair is not None,
                             where=where, truncate=shared.truncate)

        request_id = self.new_id() if unique is None else keys.id_on_shard(self.shard, unique)
        target = self.reply_key(request_id) if shared.reply_to is None else shared.reply_to
        request = wire.Request(
            id=request_id,
            text=text,
            tokens=tokens,
            reply_to=target,
            timeout_ms=shared.timeout_ms,
            text_pair=pair,
            opts=shared.opts,
            priority=shared.priority,
        )
        try:
            fields = wire.encode_request(request)
        except DecodeError as exc:
            raise BadRequest(str(exc)) from None
        except (TypeError, ValueError, OverflowError) as exc:
            # msgpack cannot encode something in opts (an int past 64 bits overflows)
            raise BadRequest(f"opts cannot be encoded as msgpack: {exc}") from None
        return Prepared(id=request_id, reply_to=target, fields=fields)

    def prepare_many(
        self, texts: Iterable[TextItem], *, now_ms: int, unique: Sequence[str] | None = None,
        **options: Unpack[SubmitOptions],
    ) -> list[Prepared]:
        """Validate a whole batch before anything is written (all or nothing).

        ``unique``: each request's id (before its shard prefix) instead of a
        fresh one, so a caller retrying a call names the same requests and the
        enqueue's dedupe writes them once (the gateway's ``Idempotency-Key``).
        """
        if isinstance(texts, (str, bytes)):
            raise BadRequest(
                "texts must be a sequence of strings, not a single string "
                "(use submit/infer for one text)"
            )
        try:
            items = list(texts)
        except TypeError:
            raise BadRequest(
                f"texts must be a sequence of strings, got {type(texts).__name__}"
            ) from None
        if not items:
            return []
        shared = self._shared(options, now_ms)
        if unique is None:
            return [self._prepare(item, None, i, shared) for i, item in enumerate(items)]
        if len(unique) != len(items):
            raise BadRequest(f"{len(unique)} ids for {len(items)} texts")
        self.check_ids(unique)
        return [self._prepare(item, None, i, shared, unique[i]) for i, item in enumerate(items)]

    def _text(self, value: object, where: str) -> str:
        """``value`` if the worker would take it as a text (the wire's own check)."""
        try:
            return wire.validate_text(value, where, self.settings.max_request_bytes)
        except DecodeError as exc:
            raise BadRequest(str(exc)) from None

    @staticmethod
    def _tokens(
        estimate: Callable[[str, str | None], int], text: str, pair: str | None, where: str
    ) -> int:
        tokens = estimate(text, pair)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise BadRequest(
                f"the token estimator returned {tokens!r} for {where}; "
                "it must return a non-negative int"
            )
        if tokens > wire.MAX_TOKENS:
            raise BadRequest(
                f"the token estimator returned {tokens} for {where}, over the protocol's "
                f"limit of {wire.MAX_TOKENS} tokens; nothing was written"
            )
        return tokens

    @staticmethod
    def _reply_to(value: object) -> str:
        if not isinstance(value, str) or not 0 < len(value) <= wire.MAX_REPLY_TO_CHARS:
            raise BadRequest(f"reply_to must be a key name of 1-{wire.MAX_REPLY_TO_CHARS} chars")
        return value

    @staticmethod
    def _opts(options: SubmitOptions) -> Mapping[str, Any]:
        """The request's ``opts`` map: the caller's ``opts``, plus the worker options it named."""
        opts = options.get("opts")
        if opts is None:
            opts = {}
        elif not isinstance(opts, Mapping) or not all(isinstance(k, str) for k in opts):
            raise BadRequest("opts must be a mapping with string keys")
        named = worker_options(options)
        if not named:
            return opts
        twice = sorted(named.keys() & opts.keys())
        if twice:
            raise BadRequest(f"{twice[0]} is given both as a keyword and in opts")
        return {**opts, **named}

    # -------------------------------------------------------------- enqueue

    def script_keys(self, batch: Sequence[Prepared]) -> list[str]:
        """KEYS for enqueue.lua: the stream, one dedupe key per entry (when on), then on a
        shard its retired marker (a retired shard refuses: :mod:`.shards`)."""
        seen = [keys.seen(self.queue, p.id) for p in batch] if self.dedupe_ttl_ms > 0 else []
        retired = [] if self.shard is None else [keys.retired(self.queue)]
        return [self.stream_key, *seen, *retired]

    def script_args(self, batch: Sequence[Prepared]) -> list[str | bytes | int]:
        """ARGV for enqueue.lua: max_len, n, dedupe TTL, then each entry's fields."""
        args: list[str | bytes | int] = [
            self.settings.max_queue_length, len(batch), self.dedupe_ttl_ms
        ]
        append, extend = args.append, args.extend  # bound once: per entry below
        for prepared in batch:
            fields = prepared.fields
            append(len(fields))
            extend(itertools.chain.from_iterable(fields.items()))
        return args

    def queue_full(self, message: str, n: int) -> QueueFull | None:
        """The :class:`QueueFull` for the script's refusal ``message``, or None if it is not one.

        The script names how many of the ``n`` entries were new (entries it
        had already seen do not count); older scripts did not, hence ``n``.
        """
        full = lua.parse_queue_full(message)
        if full is None:
            return None
        return QueueFull(
            f"queue {self.queue.name!r} holds {full.length} of at most {full.limit} requests; "
            f"{full.adding or n} more would not fit, so nothing was written"
        )

    def not_replicated(
        self, batch: Sequence[Prepared], confirmed: int, waited_ms: int
    ) -> NotReplicated:
        """The :class:`NotReplicated` for a durable enqueue too few replicas confirmed."""
        wanted = self.settings.durable_replicas
        return NotReplicated(
            f"{plural(len(batch), 'request')} written to {self.url} for queue "
            f"{self.queue.name!r}, but {confirmed} of {wanted} replicas confirmed within "
            f"{waited_ms} ms: they are queued, and would be lost if the primary failed now",
            tuple(prepared.id for prepared in batch),
        )

    def unconfirmed(self, missed: NotReplicated, *, awaited: bool) -> None:
        """Count a durable enqueue's unconfirmed requests; log it when the call waits on.

        A call that raises ``missed`` (a submit) tells its caller; one that
        waits for the replies anyway (``awaited``) logs it instead, as a
        warning at most once a minute.
        """
        due = self.unconfirmed_requests.add(len(missed.request_ids), time.monotonic())
        if awaited:
            log.log(logging.WARNING if due else logging.DEBUG,
                    "%s; waiting for their replies as usual", missed)

    def broker_full(self, n: int) -> BrokerOutOfMemory:
        """The :class:`BrokerOutOfMemory` for Redis refusing the script at its ``maxmemory``.

        Redis denies a script for lack of memory only before its first write,
        so, as with the length limit, nothing of the batch was written.
        """
        return BrokerOutOfMemory(
            f"Redis at {self.url} is out of memory (maxmemory) and refused {plural(n, 'request')} "
            f"for queue {self.queue.name!r}; nothing was written"
        )

    # -------------------------------------------------------------- replies

    def block_s(self, remaining_s: float) -> float:
        """How long one blocking read may block: under the socket timeout and the caller's deadline.

        A blocking read that outlives the socket timeout would be reported as a dead
        connection, so each wait is at most half the socket timeout and the
        caller loops until its own deadline.
        """
        ceiling = self.settings.socket_timeout_s / 2
        return max(BLOCK_FLOOR_S, min(remaining_s, ceiling))

    # --------------------------------------------------------------- config

    def config_due(self, now_s: float) -> bool:
        """Whether the next enqueue should read the config hash first (monotonic ``now_s``)."""
        return self.config_cache.due(now_s)

    def take_config(self, raw: Mapping[bytes, bytes], now_s: float) -> str | None:
        """Adopt a fresh HGETALL of the config hash (read at monotonic ``now_s``).

        Returns the path of a tokenizer.json to load (with
        :func:`tokenq.producer.tokenizer.load_estimator`) and hand to
        :meth:`take_tokenizer` before the next request, or None.
        """
        with self._config_lock:
            return self.config_cache.take(self.decode_config(raw), now_s)

    def take_tokenizer(self, path: str, loaded: PairEstimate | str | BaseException) -> None:
        """Adopt the result of loading ``path``: an estimator, or why (or how) it failed."""
        if isinstance(loaded, BaseException):
            loaded = f"cannot load {path}: {loaded}"
        with self._config_lock:
            self.config_cache.take_tokenizer(path, loaded)

    def config_unreadable(self, error: Exception, now_s: float) -> None:
        """Carry on without early checks when Redis refuses the read (an ACL, a wrong type).

        A producer's minimal ACL need not allow reading the config hash
        (docs/PROTOCOL.md), so this is a warning, once, not a failure: the
        worker still checks every request.
        """
        level = logging.DEBUG if self._config_warned else logging.WARNING
        log.log(
            level, "cannot read %s (%s); enqueueing without early checks", self.config_key, error
        )
        self._config_warned = True
        with self._config_lock:
            self.config_cache.take(None, now_s)

    @staticmethod
    def decode_config(raw: Mapping[bytes, bytes]) -> dict[str, str]:
        """The config hash as text (undecodable bytes replaced, never an exception)."""
        return {
            k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()
        }

    @staticmethod
    def decode(raw: bytes) -> wire.Reply | None:
        """A reply map, or None (logged) when it does not decode or names no id."""
        try:
            return wire.decode_reply(raw)
        except DecodeError as exc:
            log.warning("dropping a reply that does not decode: %s", exc)
            return None

    @staticmethod
    def outcome(reply: wire.Reply) -> Outcome:
        """A :class:`Result`, or the :class:`RemoteError` an error reply stands for."""
        if not reply.ok:
            error = reply.error or wire.ErrorInfo(code="", message="")
            return remote_error(error.code, error.message, reply.id)
        embedding = None
        if reply.embedding is not None:
            embedding = array.array("f")
            embedding.frombytes(reply.embedding)
            if sys.byteorder == "big":
                embedding.byteswap()
        return Result(
            id=reply.id,
            embedding=embedding,
            dim=reply.dim,
            scores=reply.scores,
            tokens=reply.tokens,
            labels=reply.labels,
            sparse=tuple(reply.sparse_pairs()) if reply.sparse_indices is not None else None,
            token_embeddings=None if reply.token_embeddings is None else tuple(
                array.array("f", vector) for vector in reply.token_vectors()),
        )

    @staticmethod
    def undecodable(request_id: str, raw: bytes) -> RemoteError:
        """The error for a reply on a request's own key that does not decode."""
        try:
            wire.decode_reply(raw)
        except DecodeError as exc:
            return RemoteError(BAD_REPLY, str(exc), request_id)
        return RemoteError(BAD_REPLY, "reply names another request", request_id)

    def own_key_reply(
        self, wanted: dict[str, str], key: str, raw: bytes, outcomes: dict[str, Any]
    ) -> None:
        """Record the reply read from one request's own reply key (``wanted``: key -> id)."""
        request_id = wanted.pop(key)
        reply = self.decode(raw)
        if reply is None or reply.id != request_id:
            outcomes[request_id] = self.undecodable(request_id, raw)
        else:
            outcomes[request_id] = self.outcome(reply)

    def shared_key_reply(self, pending: set[str], raw: bytes, outcomes: dict[str, Any]) -> None:
        """Record one reply read from a key many requests share (``pending``: ids still due).

        A reply that does not decode (logged) or names no pending id (a
        duplicate, or one for nobody) is dropped.
        """
        reply = self.decode(raw)
        if reply is None or reply.id not in pending:
            return
        pending.discard(reply.id)
        outcomes[reply.id] = self.outcome(reply)

    def missing(
        self,
        ids: Sequence[str],
        outcomes: dict[str, Any],
        waited_s: float,
        unreachable: BaseException | None,
        why: str | None = None,
    ) -> None:
        """Record a timeout (or Redis being down) for every request still unanswered."""
        if not ids:
            return
        if unreachable is not None:
            error: Exception = BrokerUnavailable(
                f"Redis at {self.url} was unreachable until the {waited_s:.2f}s "
                f"timeout: {unreachable}"
            )
        else:
            error = ReplyTimeout(list(ids), waited_s, why)
        for request_id in ids:
            outcomes[request_id] = error

    def alive_keys(self, names: Sequence[bytes | str]) -> list[str]:
        """The liveness keys of the workers the workers hash names."""
        return [
            keys.worker_alive(self.queue, name.decode() if isinstance(name, bytes) else name)
            for name in names
        ]

    def no_live_worker(self) -> str:
        """What a timeout says when no worker of the queue is alive."""
        name = self.queue.name
        return (
            f"no live worker serves queue {name!r} (no liveness key is set: none started, or "
            f"all stopped or died); start one, e.g. tokenq worker --queue {name}"
        )

    @staticmethod
    def settle(
        ids: Sequence[str],
        outcomes: Mapping[str, Outcome | Exception],
        return_exceptions: bool,
    ) -> list[Any]:
        """Outcomes in input order; raise the first error unless ``return_exceptions``."""
        ordered = [outcomes[i] for i in ids]
        if not return_exceptions:
            for item in ordered:
                if isinstance(item, Exception):
                    raise item
        return ordered

