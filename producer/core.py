"""What a producer decides, for both clients: no I/O, no redis, no asyncio.

:class:`ClientCore` is the one object the clients and
:mod:`tokenq.producer.calls` talk to, in the manner of httpx's
``BaseClient``; each of its concerns has its own module, owning its state:

* :mod:`.lanes` — request ids, and the streams (shards) a client writes to;
  all that differs per shard is one :class:`~.lanes.Lane` record;
* :mod:`.config_state` — the client's copy of the queue's config hash
  (what :mod:`.config` lets it refuse early, and the tokenizer it counts with);
* :mod:`.prepare` — checking a call's arguments and building its requests;
* :mod:`.replies` — reply bytes into a :class:`Result` or an exception;
* :mod:`.deadline` — the caller's :class:`Deadline` and each wait's length.

What stays here is what joins them: the enqueue script's arguments, the
error text that names the Redis URL and the queue, and the durable
enqueue's count of unconfirmed requests. A core writes to one lane; its
:meth:`ClientCore.lane` views share everything else with it. Decisions take
the time as an argument (``now_ms``, ``now_s``; only a :class:`Deadline`
reads the monotonic clock), so tests can drive a core directly.

The order of the commands that carry these decisions out (read the config,
enqueue, wait, retry) is :mod:`tokenq.producer.calls`; the redis-py glue
that keeps each command within its caller's :class:`Deadline` is
:mod:`tokenq.producer.redis_deadlines`.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pydantic

from tokenq.producer import replies
from tokenq.producer.call_options import SubmitOptions
from tokenq.producer.config import DEFAULT_CONFIG_TTL_S, PairEstimate
from tokenq.producer.config_state import (
    ConfigState,
    Estimator,
    EstimatorChoice,
    config_cache,
    decode_config,
)
from tokenq.producer.deadline import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    BLOCK_FLOOR_S,
    DEADLINE_GRACE_S,
    Deadline,
    backoff_s,
    block_s,
    check_seconds,
)
from tokenq.producer.lanes import Lane, Lanes, check_ids
from tokenq.producer.prepare import Prepared, Preparer, TextItem, infer_deadline
from tokenq.producer.replies import BAD_REPLY, Outcome, ReplyTimeout, Result
from tokenq.producer.shards import ShardChooser
from tokenq.shared import keys, lua_scripts
from tokenq.shared.errors import (
    BadRequest,
    BrokerOutOfMemory,
    BrokerUnavailable,
    NotReplicated,
    QueueFull,
)
from tokenq.shared.redis_url import redact
from tokenq.shared.settings import ClientSettings, describe_errors
from tokenq.shared.text import plural

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "BACKOFF_BASE_S", "BACKOFF_CAP_S", "BAD_REPLY", "BLOCK_FLOOR_S", "DEADLINE_GRACE_S",
    "ENQUEUE_SCRIPT", "PEEK_SCRIPT", "ClientCore", "Deadline", "Estimator", "EstimatorChoice",
    "Outcome", "Prepared", "ReplyTimeout", "Result", "TextItem", "Unconfirmed", "backoff_s",
    "make_settings", "redact_url",
]

log = logging.getLogger("tokenq.producer")

ENQUEUE_SCRIPT = lua_scripts.load("tokenq.producer", "enqueue.lua")
"""Source of the atomic backpressure script (see enqueue.lua for its contract)."""

PEEK_SCRIPT = lua_scripts.load("tokenq.producer", "peek_replies.lua")
"""Source of the script that reads a caller's own reply keys without removing anything."""

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


def make_settings(settings: ClientSettings | None, **overrides: Any) -> ClientSettings:
    """Settings from ``TOKENQ_*`` (or ``settings``), with non-None keyword overrides on top.

    Invalid values (a bad queue name, a negative limit) raise
    :class:`BadRequest` naming the setting (its ``param`` the first one at
    fault), before any connection is made.
    """
    given = {name: value for name, value in overrides.items() if value is not None}
    try:
        if settings is None:
            return ClientSettings(**given)
        return ClientSettings.model_validate({**settings.model_dump(), **given})
    except pydantic.ValidationError as exc:
        problems = "; ".join(describe_errors(exc, ClientSettings, flags=False))
        where = exc.errors()[0]["loc"] if exc.errors() else ()
        param = str(where[0]) if where else "settings"
        raise BadRequest(f"invalid client settings: {problems}", param=param) from None


def redact_url(url: str) -> str:
    """The Redis URL with any password masked, for error messages and logs."""
    return redact(url)


@dataclass(eq=False)
class _Client:
    """What every lane of one client shares: all of a core's state but its :class:`Lane`."""

    settings: ClientSettings
    url: str
    config: ConfigState
    lanes: Lanes
    preparer: Preparer
    chooser: ShardChooser
    unconfirmed: Unconfirmed
    views: dict[int | None, ClientCore] = field(default_factory=dict)
    """The core of each lane, made once (:meth:`ClientCore.lane`)."""


class ClientCore:
    """Decisions the sync and async clients share, for one lane; holds no connection.

    Its state is the client's (:class:`_Client`, shared by all its lanes)
    and its :class:`Lane` (the shard it writes to): nothing else, so a lane's
    core is made by naming its lane, never by copying a core.
    """

    __slots__ = ("_client", "_lane")

    def __init__(
        self,
        settings: ClientSettings,
        estimator: EstimatorChoice = None,
        config_ttl_s: float = DEFAULT_CONFIG_TTL_S,
        refuse_early: bool = True,
    ) -> None:
        queue = settings.queue_ref
        config = ConfigState(config_cache(estimator, config_ttl_s), keys.config(queue))
        lanes = Lanes(queue, settings.shards, config.config)
        self._client = _Client(
            settings=settings,
            url=redact_url(settings.redis_url),
            config=config,
            lanes=lanes,
            preparer=Preparer(settings, config, refuse_early),
            chooser=ShardChooser(settings.shard_choice),
            unconfirmed=Unconfirmed(),
        )
        self._lane = lanes.lane(None)
        self._client.views[None] = self

    @classmethod
    def _on(cls, client: _Client, lane: Lane) -> ClientCore:
        """The core of ``lane``: the client's state, and that lane's."""
        core = cls.__new__(cls)
        core._client = client
        core._lane = lane
        return core

    # ------------------------------------------------------------ the client's

    @property
    def settings(self) -> ClientSettings:
        return self._client.settings

    @property
    def url(self) -> str:
        """The Redis URL, password masked (error text and logs)."""
        return self._client.url

    @property
    def chooser(self) -> ShardChooser:
        """Which shard the client's next call takes (shared by its lanes)."""
        return self._client.chooser

    @property
    def unconfirmed_requests(self) -> Unconfirmed:
        return self._client.unconfirmed

    @property
    def config_key(self) -> str:
        return self._client.config.key

    @property
    def dedupe_ttl_ms(self) -> int:
        return int(self._client.settings.dedupe_ttl_s * 1000)

    # ---------------------------------------------------------------- the lane's

    @property
    def shard(self) -> int | None:
        """The shard this core writes to; None for the plain queue ``{q}``."""
        return self._lane.shard

    @property
    def queue(self) -> keys.QueueRef:
        return self._lane.queue

    @property
    def stream_key(self) -> str:
        return self._lane.stream_key

    @property
    def workers_key(self) -> str:
        return self._lane.workers_key

    def new_id(self) -> str:
        """A fresh request (or batch, or client) id on this core's shard (:meth:`Lane.new_id`)."""
        return self._lane.new_id()

    def reply_key(self, reply_id: str) -> str:
        """The list a request's reply (or a batch's, or a client's) lands on."""
        return self._lane.reply_key(reply_id)

    # --------------------------------------------------------------- shards

    def shards(self) -> int:
        """The queue's shard count as this client knows it (see :mod:`.shards`)."""
        return self._client.lanes.count()

    def lane(self, shard: int | None) -> ClientCore:
        """The core that writes to ``shard`` (None: the plain ``{q}``), made once."""
        views = self._client.views
        made = views.get(shard)
        if made is None:
            made = views.setdefault(shard, self._on(self._client, self._client.lanes.lane(shard)))
        return made

    def lanes(self) -> list[ClientCore]:
        """Every stream the queue's workers read: the shards, then the plain ``{q}``."""
        return [self.lane(lane.shard) for lane in self._client.lanes.every()]

    def shard_of_id(self, request_id: str, retired: Collection[int] = ()) -> int | None:
        """The shard whose reply namespace ``request_id``'s reply lands in (:class:`Lanes`)."""
        return self._client.lanes.shard_of_id(request_id, retired)

    def shards_beyond(self, request_ids: Sequence[str]) -> list[int]:
        """The shards ids name that the queue does not have now: were they retired?"""
        return self._client.lanes.shards_beyond(request_ids)

    def reply_keys(
        self, request_ids: Sequence[str], retired: Collection[int] = ()
    ) -> dict[int | None, dict[str, str]]:
        """Reply key -> request id by shard, for ids the caller wants to fetch (:class:`Lanes`)."""
        return self._client.lanes.reply_keys(request_ids, retired)

    check_ids = staticmethod(check_ids)

    # ------------------------------------------------------------- requests

    def timeout(self, timeout_s: float | None) -> float:
        """The caller's wait in seconds, defaulting to the configured one."""
        if timeout_s is None:
            return self.settings.timeout_s
        return check_seconds(timeout_s, "timeout_s")

    def deadline(self) -> Deadline:
        """The deadline of a call without a ``timeout_s`` of its own: ``settings.timeout_s``."""
        return Deadline.after(self.settings.timeout_s)

    infer_deadline = staticmethod(infer_deadline)

    def prepare(
        self, item: object, *, now_ms: int, text_pair: object = None, index: int | None = None,
        **options: Unpack[SubmitOptions],
    ) -> Prepared:
        """One request written through this core's lane (:meth:`Preparer.prepare`)."""
        return self._client.preparer.prepare(
            self._lane, item, now_ms=now_ms, text_pair=text_pair, index=index, **options)

    def prepare_many(
        self, texts: Iterable[TextItem], *, now_ms: int, unique: Sequence[str] | None = None,
        **options: Unpack[SubmitOptions],
    ) -> list[Prepared]:
        """A batch written through this core's lane, all or nothing
        (:meth:`Preparer.prepare_many`)."""
        return self._client.preparer.prepare_many(
            self._lane, texts, now_ms=now_ms, unique=unique, **options)

    # -------------------------------------------------------------- enqueue

    def script_keys(self, batch: Sequence[Prepared]) -> list[str]:
        """KEYS for enqueue.lua: the stream, the seen keys (when dedupe is on), then on a
        shard its retired marker (a retired shard refuses: :mod:`.shards`).

        A batch of fresh ids gets one seen key for the call (:func:`keys.seen_call`),
        since only a retry of this very call can send them again; ids the
        caller named get one each (:attr:`Prepared.named`). One key instead of
        one per request is most of what redis-server spends on an enqueue
        (docs/decisions/0021-one-seen-key-per-call.md).
        """
        queue = self.queue
        if self.dedupe_ttl_ms <= 0:
            seen: list[str] = []
        elif _per_entry(batch):
            seen = [keys.seen(queue, p.id) for p in batch]
        else:
            seen = [keys.seen_call(queue, [p.id for p in batch])]
        retired = [] if self.shard is None else [keys.retired(queue)]
        return [self.stream_key, *seen, *retired]

    def script_args(self, batch: Sequence[Prepared]) -> list[str | bytes | int]:
        """ARGV for enqueue.lua: max_len, n, the dedupe TTL (``call:<ms>`` with one seen key
        for the call), then each entry's fields."""
        ttl_ms = self.dedupe_ttl_ms
        dedupe: str | int = ttl_ms if ttl_ms <= 0 or _per_entry(batch) else f"call:{ttl_ms}"
        args: list[str | bytes | int] = [self.settings.max_queue_length, len(batch), dedupe]
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
        full = lua_scripts.parse_queue_full(message)
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

    def unreachable(self, error: BaseException) -> BrokerUnavailable:
        """The error for Redis not answering a command (after every retry it was given)."""
        return BrokerUnavailable(f"Redis at {self.url} is unreachable: {error}")

    # --------------------------------------------------------------- config

    def config_due(self, now_s: float) -> bool:
        """Whether the next enqueue should read the config hash first (monotonic ``now_s``)."""
        return self._client.config.due(now_s)

    def take_config(self, raw: Mapping[bytes, bytes], now_s: float) -> str | None:
        """Adopt a fresh HGETALL of the config hash; a tokenizer path to load, or None
        (:meth:`ConfigState.take`)."""
        return self._client.config.take(raw, now_s)

    def take_tokenizer(self, path: str, loaded: PairEstimate | str | BaseException) -> None:
        """Adopt the result of loading ``path``: an estimator, or why (or how) it failed."""
        self._client.config.take_tokenizer(path, loaded)

    def config_unreadable(self, error: Exception, now_s: float) -> None:
        """Carry on without early checks when Redis refuses the read
        (:meth:`ConfigState.unreadable`)."""
        self._client.config.unreadable(error, now_s)

    decode_config = staticmethod(decode_config)

    # -------------------------------------------------------------- replies

    def block_s(self, remaining_s: float) -> float:
        """How long one blocking read may block (:func:`.deadline.block_s`)."""
        return block_s(remaining_s, self.settings.socket_timeout_s)

    decode = staticmethod(replies.decode)
    outcome = staticmethod(replies.outcome)
    undecodable = staticmethod(replies.undecodable)
    own_key_reply = staticmethod(replies.own_key_reply)
    shared_key_reply = staticmethod(replies.shared_key_reply)
    settle = staticmethod(replies.settle)

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


def _per_entry(batch: Sequence[Prepared]) -> bool:
    """Whether ``batch`` is remembered by one seen key per request: some id is the caller's."""
    return any(prepared.named for prepared in batch)
