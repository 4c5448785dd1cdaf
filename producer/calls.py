"""Every call of a producer written once for both clients, as a generator that yields each
:data:`Step` and is resumed with its answer or failure; the clients perform the steps. No I/O."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from tokenq.producer.call_options import RequestOptions, SubmitOptions, refuse_unknown
from tokenq.producer.deadline import Deadline, backoff_s, block_s, check_seconds
from tokenq.producer.lanes import Lane, check_ids
from tokenq.producer.prepare import Prepared, TextItem
from tokenq.producer.replies import (
    Outcome,
    ReplyTimeout,
    Result,
    own_key_reply,
    settle,
    shared_key_reply,
)
from tokenq.producer.shards import ShardRetired, is_retired, shard_for
from tokenq.shared import keys, lua_scripts, redis_text, wire
from tokenq.shared.errors import (
    BadRequest,
    BrokerOutOfMemory,
    BrokerUnavailable,
    NotReplicated,
    QueueFull,
    QuotaExceeded,
    TokenqError,
)
from tokenq.shared.failures import error_text
from tokenq.shared.text import plural

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from tokenq.producer.core import ClientCore

T = TypeVar("T")

ENQUEUE = "enqueue"  # enqueue.lua
PEEK = "peek_replies"  # peek_replies.lua
ENQUEUE_SEEN = "enqueue_seen"
"""enqueue.lua read-only: at ``maxmemory`` it still answers a batch written before."""
QUEUE_DEPTH = "queue_depth"  # queue_depth.lua: a lane's length over all its streams
SCRIPTS = (ENQUEUE, PEEK, ENQUEUE_SEEN, QUEUE_DEPTH)
"""The scripts a :class:`Send` may name, each called as a function of tokenq's library."""
DURABLE_ENQUEUE = "durable_enqueue"
"""The enqueue script, then ``WAIT replicas timeout_ms``, on one connection (WAIT counts that
connection's writes). Answer: the script's reply and how many replicas confirmed."""

LIVENESS_CHECK_S = 0.1
"""How long the check behind a timeout's "no live worker" may take past the caller's deadline."""

log = logging.getLogger("tokenq.producer")


class CommandFailed(Exception):
    """A Redis command failed (``error``: redis-py's exception); thrown into the call."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class Unreachable(CommandFailed):
    """No answer: refused, cut off, timed out, or BUSY (a script holds Redis; nothing ran)."""


class ErrorReply(CommandFailed):
    """Redis answered with an error reply (the script's QUEUEFULL, an ACL's NOPERM, ...)."""


class OutOfMemory(ErrorReply):
    """Redis refused a write at its ``maxmemory``; a script is refused before its first write."""


@dataclass(slots=True, eq=False)  # made per command: the cheapest to make
class Send:
    """Run a redis-py method, a :data:`SCRIPTS` name or :data:`DURABLE_ENQUEUE` by ``deadline``
    (monotonic) plus ``DEADLINE_GRACE_S``. Answer: the reply."""

    command: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    deadline: float


class Sleep(NamedTuple):
    seconds: float


class ShareConfigRead(NamedTuple):
    """Run :func:`read_config` (not strict), or join the read in flight, until ``deadline``;
    only the caller whose read it is sees its failure."""

    deadline: Deadline


class LoadTokenizer(NamedTuple):
    """Load ``path`` into the config cache once, off the caller's thread (or loop); wait
    until ``deadline``, then carry on with the heuristic."""

    path: str
    deadline: Deadline


class Listen(NamedTuple):
    """Have the client's listener of ``key`` keep the replies to ``ids``."""

    ids: tuple[str, ...]
    key: str


class Collect(NamedTuple):
    """Wait for the listener's replies to ``ids`` until ``deadline``. Answer: ``(outcomes,
    unreachable)``: those in by then and the listener's last outage (or None)."""

    ids: tuple[str, ...]
    deadline: Deadline


Step = Send | Sleep | ShareConfigRead | LoadTokenizer | Listen | Collect
"""What a call asks its client to do; answered None unless it says otherwise."""

Call = Generator[Step, Any, T]
"""A call in progress: yields steps, is sent their answers, returns the call's value."""
Outcomes = dict[str, Outcome | Exception]
Texts = tuple[str, str | None] | list[TextItem]
"""A call's inputs: one ``(text, text_pair)`` (submit, infer), or a batch's list."""


@dataclass(slots=True, eq=False)
class Done(Generic[T]):
    """What :func:`resume` returns once the call returned ``value``."""

    value: T


def resume(call: Call[T], answer: Any = None) -> Step | Done[T]:
    """The call's next step given the last one's ``answer`` (an Exception is thrown in), or Done.
    A :class:`CommandFailed` it does not handle reaches the caller as redis-py's exception."""
    try:
        return call.throw(answer) if isinstance(answer, Exception) else call.send(answer)
    except StopIteration as stop:
        return Done(stop.value)
    except CommandFailed as failed:
        error = failed.error
        raise error from error.__cause__


def execute(
    core: ClientCore, deadline: Deadline, name: str, *args: Any, **kwargs: Any
) -> Call[Any]:
    """One command; BrokerUnavailable when Redis stays unreachable. With ``deadline.persist`` an
    outage is tried again, with backoff, until the deadline (a retried enqueue is deduplicated by
    the script); without it redis-py's retries are all."""
    failures = 0
    while True:
        try:
            return (yield Send(name, args, kwargs, deadline.at))
        except Unreachable as down:
            failures += 1
            if deadline.persist:
                yield Sleep(deadline.cap(backoff_s(failures)))
            if not deadline.persist or deadline.remaining() <= 0:
                error = BrokerUnavailable(f"Redis at {core.url} is unreachable: {down.error}")
                raise error from down.error


def read_config(core: ClientCore, deadline: Deadline, *, strict: bool) -> Call[dict[str, str]]:
    """HGETALL the config hash into the cache, loading a tokenizer it newly names; not
    ``strict``, a refused read (an ACL) leaves the client without early checks."""
    try:
        raw = yield from execute(core, deadline, "hgetall", core.config.key)
    except ErrorReply as refused:
        if strict:
            raise
        core.config.unreadable(refused.error, time.monotonic())
        return {}
    fields = {redis_text.as_text(k): redis_text.as_text(v) for k, v in raw.items()}
    path = core.config.take(fields, time.monotonic())
    if path is not None:
        yield LoadTokenizer(path, deadline)
    return fields


def ensure_config(core: ClientCore, deadline: Deadline) -> Call[None]:
    """Before an enqueue: the cached config hash at most ``config_ttl_s`` old."""
    if core.config.due(time.monotonic()):
        yield ShareConfigRead(deadline)


def choose_shard(
    core: ClientCore, deadline: Deadline, reply_to: object = None, pin: str | None = None
) -> Call[Lane]:
    """The lane an enqueueing call writes to (``{q}`` unsharded): the shard a ``reply_to`` names,
    or the one a caller-chosen id ``pin`` hashes to, else the chooser's pick (``shortest``: after
    an XLEN per shard when its reading is stale; a refused XLEN leaves it round robin)."""
    lanes = core.lanes
    count = lanes.count()
    if count == 1:
        return lanes.home
    if isinstance(reply_to, str):
        pinned = keys.shard_of_reply_key(lanes.home.queue, count, reply_to)
        if pinned is not None:
            return lanes.lane(pinned)
    if pin is not None:
        return lanes.lane(shard_for(pin, count))
    chooser = core.chooser
    if chooser.lengths_due(count, time.monotonic()):
        lengths = []
        try:
            for shard in range(count):
                key = lanes.lane(shard).stream_key
                lengths.append(int((yield from execute(core, deadline, "xlen", key))))
        except ErrorReply as refused:
            log.debug("cannot read the shards' lengths (%s); choosing round robin", refused.error)
            lengths = []
        chooser.take_lengths(lengths, time.monotonic())
    return lanes.lane(chooser.pick(count))


def on_current_shard(
    core: ClientCore, deadline: Deadline, write: Callable[[Lane], Call[T]],
    reply_to: object = None, pin: str | None = None,
) -> Call[T]:
    """``write`` to the shard :func:`choose_shard` picks. One the workers retired (a stale count)
    the script refuses, writing nothing: the call re-reads the config and chooses again; only a
    count that still includes that shard reaches the caller, as :class:`ShardRetired`."""
    while True:
        lane = yield from choose_shard(core, deadline, reply_to, pin)
        try:
            return (yield from write(lane))
        except ShardRetired as retired:
            yield from read_config(core, deadline, strict=False)
            count = core.lanes.count()
            if count > 1 and retired.shard < count:  # a count of 1 is the plain {q} alone
                raise
            log.info("shard %d of queue %r is retired; choosing again among %d shards",
                     retired.shard, core.settings.queue, count)


def enqueue_arguments(
    core: ClientCore, lane: Lane, batch: Sequence[Prepared], tenant: str | None = None
) -> dict[str, Any]:
    """``keys`` and ``args`` of enqueue.lua for ``batch``: fresh ids share one seen key for
    the call, ids the caller named get one each (docs/decisions/0021-one-seen-key-per-call.md);
    a named tenant's stream is registered in the queue's tenants set."""
    queue = lane.queue
    ttl_ms = int(core.settings.dedupe_ttl_s * 1000)
    dedupe: str | int = ttl_ms
    if ttl_ms <= 0:
        seen: list[str] = []
    elif any(prepared.named for prepared in batch):
        seen = [keys.seen(queue, prepared.id) for prepared in batch]
    else:
        seen = [keys.seen_call(queue, [prepared.id for prepared in batch])]
        dedupe = f"call:{ttl_ms}"
    retired = [] if lane.shard is None else [keys.retired(queue)]
    args: list[str | bytes | int] = [core.settings.max_queue_length, len(batch), dedupe]
    for prepared in batch:
        fields = prepared.fields
        args.append(len(fields))
        for field in fields.items():  # measured faster than itertools.chain
            args += field
    if tenant is None or tenant == keys.DEFAULT_TENANT:
        return {"keys": [lane.stream_key, *seen, *retired], "args": args}
    return {"keys": [keys.tenant_requests(queue, tenant), *seen, *retired, keys.tenants(queue)],
            "args": args}


def tenant_of(options: Mapping[str, Any]) -> str | None:
    """The call's ``tenant`` checked (None: the default tenant's stream); BadRequest if bad."""
    tenant = options.get("tenant")
    try:
        return None if tenant is None else keys.check_tenant(tenant)
    except ValueError as exc:
        raise BadRequest(str(exc), param="tenant") from None


def enqueue(
    core: ClientCore, lane: Lane, batch: Sequence[Prepared], deadline: Deadline, *,
    awaited: bool = False, tenant: str | None = None,
) -> Call[None]:
    """Write ``batch`` with the enqueue script, all or nothing; QueueFull when it does not fit.
    A durable enqueue too few replicas confirmed is NotReplicated, or if ``awaited`` counted and
    logged (its replies are awaited: docs/decisions/0025-durable-enqueue-waits-on.md)."""
    if not batch:
        return
    settings = core.settings
    replicas = confirmed = settings.durable_replicas
    arguments = enqueue_arguments(core, lane, batch, tenant)
    try:
        # With ``persist`` a lost reply is retried with the same ids and seen keys, which the
        # script answers without adding anything.
        if not replicas:
            yield from execute(core, deadline, ENQUEUE, **arguments)
        else:
            wait_ms = max(1, min(settings.durable_timeout_ms, int(deadline.remaining() * 1000)))
            _, confirmed = yield from execute(
                core, deadline, DURABLE_ENQUEUE, **arguments, replicas=replicas, timeout_ms=wait_ms
            )
    except OutOfMemory:
        if replicas or not (yield from _written_before(core, arguments, deadline)):
            raise BrokerOutOfMemory(
                f"Redis at {core.url} is out of memory (maxmemory) and refused "
                f"{plural(len(batch), 'request')} for queue {settings.queue!r}; nothing was written"
            ) from None
    except ErrorReply as refused:
        message = str(refused.error)
        if lane.shard is not None and is_retired(message):
            raise ShardRetired(settings.queue, lane.shard) from None
        over = lua_scripts.parse_over_quota(message)
        if over is not None:
            raise over_quota(over, settings.queue, len(batch)) from None
        full = lua_scripts.parse_queue_full(message)
        if full is None:
            raise
        whose = "" if tenant is None else f" (tenant {tenant!r}'s stream)"
        raise QueueFull(  # an older script names no count of new entries
            f"queue {settings.queue!r}{whose} holds {full.length} of at most {full.limit} "
            f"requests; {full.adding or len(batch)} more would not fit, so nothing was written"
        ) from None
    if confirmed < replicas:
        missed = NotReplicated(
            f"{plural(len(batch), 'request')} written to {core.url} for queue "
            f"{settings.queue!r}, but {confirmed} of {replicas} replicas confirmed within "
            f"{wait_ms} ms: they are queued, and would be lost if the primary failed now",
            tuple(prepared.id for prepared in batch),
        )
        due = core.unconfirmed.add(len(batch), time.monotonic())
        if not awaited:
            raise missed
        log.log(logging.WARNING if due else logging.DEBUG,
                "%s; waiting for their replies as usual", missed)
    core.chooser.added(lane.shard, len(batch))


def over_quota(over: lua_scripts.OverQuotaReply, queue: str, entries: int) -> TokenqError:
    """The error for enqueue's ``OVERQUOTA``: QuotaExceeded, or BadRequest when one request
    alone is over a cap above 0 (no wait would make room for it; 0 pauses the tenant)."""
    where = f"tenant {over.tenant!r} of queue {queue!r}"
    if over.largest > over.cap > 0:
        return BadRequest(f"a request of {over.largest} tokens is over the quota of {where}, "
                          f"{over.cap} pending tokens: it can never be queued; nothing was "
                          "written", param="tenant")
    return QuotaExceeded(
        f"{where} holds {over.held} pending tokens of its quota of {over.cap}; "
        f"{plural(entries, 'request')} of {over.adding} more tokens would pass it, so nothing "
        "was written", over.tenant, over.cap)


def _written_before(core: ClientCore, arguments: dict[str, Any], deadline: Deadline) -> Call[bool]:
    """After Redis refused the enqueue for memory: whether an earlier try wrote the batch, as
    :data:`ENQUEUE_SEEN` answers from its seen keys (it fails for anything new)."""
    try:
        yield from execute(core, deadline, ENQUEUE_SEEN, **arguments)
    except ErrorReply:
        return False
    return True


def _poll(
    core: ClientCore, deadline: Deadline, pending: Sized,
    pop: Callable[[float, list[Any]], Call[None]], take: Callable[[Any], None], *,
    at_least_once: bool = False,
) -> Call[BaseException | None]:
    """Pop replies (each pop blocks under the socket timeout) and ``take`` each until none is
    ``pending`` or the deadline, backing off an outage; Redis's last outage, or None.
    ``at_least_once``: pop once even past the deadline (replies landed while waiting elsewhere)."""
    unreachable: BaseException | None = None
    failures = 0
    tried = not at_least_once
    while pending:
        remaining = deadline.remaining()
        if remaining <= 0 and tried:
            break
        tried = True
        popped: list[Any] = []
        try:
            yield from pop(block_s(remaining, core.settings.socket_timeout_s), popped)
            unreachable, failures = None, 0
        except Unreachable as down:
            unreachable, failures = down.error, failures + 1
        for item in popped:  # what a pop got counts even if a later command of it failed
            take(item)
        if failures and pending:
            yield Sleep(deadline.cap(backoff_s(failures)))
    return unreachable


def live_workers(core: ClientCore, lane: Lane, deadline: Deadline) -> Call[int]:
    """How many of the lane's workers are alive: named in its workers hash, liveness key set
    (it expires three heartbeats after a worker's last beat)."""
    names = yield from execute(core, deadline, "hkeys", lane.workers_key)
    if not names:
        return 0
    alive = [keys.worker_alive(lane.queue, redis_text.as_text(name)) for name in names]
    return int((yield from execute(core, deadline, "exists", *alive)))


def why_unanswered(core: ClientCore, lane: Lane) -> Call[str | None]:
    """After a wait that timed out: why, if no worker is alive; best effort (an ACL may not
    allow these reads: docs/SECURITY.md)."""
    try:
        alive = yield from live_workers(core, lane, Deadline.after(LIVENESS_CHECK_S))
    except Exception as exc:  # a timeout's message must not become another error
        log.debug("could not tell whether any worker is alive: %s", error_text(exc))
        return None
    name = core.settings.queue
    return None if alive else (
        f"no live worker serves queue {name!r} (no liveness key is set: none started, or "
        f"all stopped or died); start one, e.g. tokenq worker --queue {name}")


def _missing(
    core: ClientCore, lane: Lane, ids: Sequence[str], outcomes: Outcomes, started: float,
    unreachable: BaseException | None,
) -> Call[None]:
    """Record a timeout (or Redis being down) for every request of ``ids`` still unanswered."""
    if not ids:
        return
    waited_s = time.monotonic() - started
    if unreachable is not None:
        error: Exception = BrokerUnavailable(
            f"Redis at {core.url} was unreachable until the {waited_s:.2f}s timeout: {unreachable}"
        )
    else:
        error = ReplyTimeout(list(ids), waited_s, (yield from why_unanswered(core, lane)))
    for request_id in ids:
        outcomes[request_id] = error


_ROTATE = {"src": "LEFT", "dest": "RIGHT"}
"""``BLMOVE key key LEFT RIGHT``: waits like BLPOP, moves the head to the tail, removes nothing."""


def _forget(deadline: Deadline, command: str, *args: Any) -> Call[None]:
    """Remove replies already in hand (DEL, LTRIM); best effort, since each key expires anyway."""
    try:
        yield Send(command, args, {}, deadline.at)
    except Unreachable:
        log.debug("could not remove replies already read (%s); they expire", command)


def own_replies(
    core: ClientCore, wanted: dict[str, str], deadline: Deadline, *,
    at_least_once: bool = False, keep: bool = False,
) -> Call[tuple[Outcomes, BaseException | None]]:
    """Outcomes of replies on their own keys (``wanted``: key -> id, left holding those not
    answered) and Redis's last outage. Nothing is removed before it is in hand: peek_replies.lua,
    ``BLMOVE key key`` on the first, DEL at the end unless ``keep`` (docs/RELIABILITY.md)."""
    outcomes: Outcomes = {}
    read: list[str] = []

    def pop(block_s: float, popped: list[Any]) -> Call[None]:
        missing = list(wanted)
        got: list[tuple[str, bytes]] = []
        if len(missing) > 1:  # one key: BLMOVE answers at once if its reply is there
            found = yield Send(PEEK, (), {"keys": missing}, deadline.at)
            got = [(key, raw) for key, raw in zip(missing, found or (), strict=False) if raw]
        if not got:
            first = missing[0]
            raw = yield Send("blmove", (first, first, block_s), _ROTATE, deadline.at)
            got = [(first, raw)] if raw is not None else []
        popped += got

    def take(key_and_raw: tuple[str, bytes]) -> None:
        key, raw = key_and_raw
        own_key_reply(wanted, key, raw, outcomes)
        read.append(key)

    unreachable = yield from _poll(core, deadline, wanted, pop, take, at_least_once=at_least_once)
    if read and not keep:
        yield from _forget(deadline, "delete", *read)
    return outcomes, unreachable


def drain(
    core: ClientCore, reply_key: str, pending: set[str], deadline: Deadline
) -> Call[tuple[Outcomes, BaseException | None]]:
    """Outcomes of the ``pending`` ids (left holding those unanswered), whose replies land on
    ``reply_key``, and Redis's last outage: ``LRANGE``, then ``LTRIM`` what was read (workers
    only append); ``BLMOVE key key`` waits when empty."""
    outcomes: Outcomes = {}

    def pop(block_s: float, popped: list[Any]) -> Call[None]:
        landed = yield Send("lrange", (reply_key, 0, -1), {}, deadline.at)
        if not landed:
            arrived = yield Send("blmove", (reply_key, reply_key, block_s), _ROTATE, deadline.at)
            if arrived is not None:
                landed = yield Send("lrange", (reply_key, 0, -1), {}, deadline.at)
        popped += landed or []
        if landed:
            yield from _forget(deadline, "ltrim", reply_key, len(landed), -1)

    def take(raw: bytes) -> None:
        shared_key_reply(pending, raw, outcomes)

    return outcomes, (yield from _poll(core, deadline, pending, pop, take))


def reply_keys(
    core: ClientCore, request_ids: Sequence[str], deadline: Deadline
) -> Call[dict[int | None, dict[str, str]]]:
    """Reply key -> id of the (checked) ``request_ids``, by the shard each reply is on. A shard
    an id names that the queue does not have now counts if retired (its marker stays); best
    effort: a read refused or unanswered counts as not retired."""
    check_ids(request_ids)
    if all(keys.shard_in_id(request_id) is None for request_id in request_ids):
        return core.lanes.reply_keys(request_ids)
    try:
        yield from ensure_config(core, deadline)
    except BrokerUnavailable:
        return core.lanes.reply_keys(request_ids)
    retired: set[int] = set()
    for shard in core.lanes.shards_beyond(request_ids):
        marker = keys.retired(core.lanes.lane(shard).queue)
        try:
            if (yield from execute(core, deadline, "exists", marker)):
                retired.add(shard)
        except (ErrorReply, BrokerUnavailable) as exc:
            log.debug("cannot tell whether shard %d is retired (%s): taken as not", shard,
                      error_text(exc))
    return core.lanes.reply_keys(request_ids, retired)


def submit(
    core: ClientCore, text: str, *, text_pair: str | None = None,
    **options: Unpack[SubmitOptions],
) -> Call[str]:
    """Enqueue one text; its request id, for :meth:`result`. ``deadline_s`` (from now) or
    ``deadline_ms`` (epoch ms): when the answer stops being useful; ``reply_to``: another reply
    key. QueueFull at the queue's limit, BadRequest (InputTooLong) for bad input: no write."""
    return (yield from _submit(core, (text, text_pair), options))[0]


def submit_many(
    core: ClientCore, texts: Iterable[TextItem], *, unique: Sequence[str] | None = None,
    **options: Unpack[SubmitOptions],
) -> Call[list[str]]:
    """Enqueue a batch (texts or ``(text, text_pair)`` tuples) all or nothing; the ids.
    ``unique``: the requests' ids (32 hex digits each) instead of fresh ones: a retry that names
    the same ids is written once (``dedupe_ttl_s``)."""
    return (yield from _submit(core, _texts(texts), options, unique))


def _submit(
    core: ClientCore, texts: Texts, options: SubmitOptions, unique: Sequence[str] | None = None
) -> Call[list[str]]:
    """Enqueue ``texts`` to the lane chosen, bounded by ``settings.timeout_s``; a call naming its
    ids (``unique``) goes where they hash to, as each retry of it does."""
    refuse_unknown(options, SubmitOptions, _name("submit", texts))
    deadline = Deadline.after(core.settings.timeout_s)
    tenant = tenant_of(options)
    yield from ensure_config(core, deadline)

    def write(lane: Lane) -> Call[list[str]]:
        batch = _prepare(core, lane, texts, unique, now_ms=_now_ms(), **options)
        yield from enqueue(core, lane, batch, deadline, tenant=tenant)
        return [p.id for p in batch]

    pin = unique[0] if unique else None
    return (yield from on_current_shard(core, deadline, write, options.get("reply_to"), pin))


def _prepare(
    core: ClientCore, lane: Lane, texts: Texts, unique: Sequence[str] | None = None, **options: Any
) -> list[Prepared]:
    """The requests for ``lane``: one for a ``(text, text_pair)`` call, else the batch's."""
    if isinstance(texts, tuple):
        return [core.preparer.prepare(lane, texts[0], text_pair=texts[1], **options)]
    return core.preparer.prepare_many(lane, texts, unique=unique, **options)


def result(core: ClientCore, request_id: str, timeout_s: float | None = None) -> Call[Result]:
    """Wait for the reply to ``request_id`` (from this or any other process). Raises the
    worker's error as RemoteError (or DeadlineExceeded), ReplyTimeout when no reply comes in
    time. The first caller to fetch a reply consumes it."""
    return (yield from results(core, [request_id], timeout_s))[0]


def results(
    core: ClientCore, request_ids: Sequence[str], timeout_s: float | None = None, *,
    return_exceptions: bool = False, keep: bool = False,
) -> Call[list[Any]]:
    """Wait for several submitted requests' replies; results in input order. Keys are deleted
    once their replies are in hand, unless ``keep`` (then :meth:`forget` or the worker's
    ``reply_ttl_s`` does). ``return_exceptions``: errors in place."""
    started = time.monotonic()
    deadline = Deadline(started + _timeout(core, timeout_s))
    by_shard = yield from reply_keys(core, request_ids, deadline)
    several = len(by_shard) > 1
    outcomes: Outcomes = {}
    unreachable: BaseException | None = None
    for wanted in by_shard.values():
        got, down = yield from own_replies(core, wanted, deadline, at_least_once=several, keep=keep)
        outcomes.update(got)
        unreachable = unreachable or down
    missing = [i for wanted in by_shard.values() for i in wanted.values()]
    yield from _missing(core, core.lanes.home, missing, outcomes, started, unreachable)
    return settle(request_ids, outcomes, return_exceptions)


def forget(core: ClientCore, request_ids: Sequence[str]) -> Call[None]:
    """Delete the replies :meth:`results` kept for ``request_ids`` (best effort)."""
    deadline = Deadline.after(core.settings.timeout_s)
    for wanted in (yield from reply_keys(core, request_ids, deadline)).values():
        yield from _forget(deadline, "delete", *wanted)


def infer(
    core: ClientCore, text: str, *, text_pair: str | None = None, timeout_s: float | None = None,
    **options: Unpack[RequestOptions],
) -> Call[Result]:
    """Enqueue one text and wait for its result on its own reply key (an AsyncClient's: on the
    key it listens to): an outage is retried within ``timeout_s`` (then BrokerUnavailable), no
    answer is ReplyTimeout. Without a deadline the request carries the rest of the timeout: no
    device time on answers nobody awaits."""
    return (yield from _infer(core, (text, text_pair), timeout_s, options, False))[0]


def infer_many(
    core: ClientCore, texts: Iterable[TextItem], *, timeout_s: float | None = None,
    return_exceptions: bool = False, **options: Unpack[RequestOptions],
) -> Call[list[Any]]:
    """Enqueue a batch all or nothing and wait for every result, in input order. The replies
    land on one key of the call's (an AsyncClient's: on the key it listens to). Without
    ``return_exceptions`` the first failed item is raised once every reply is in or the timeout
    has passed."""
    return (yield from _infer(core, _texts(texts), timeout_s, options, return_exceptions))


def _infer(
    core: ClientCore, texts: Texts, timeout_s: float | None, options: RequestOptions, errors: bool
) -> Call[list[Any]]:
    """Enqueue ``texts`` and wait for their replies: from the client's listener (a reply may beat
    the script's answer, so it listens first), else from their reply keys (a batch's: one key of
    the call's)."""
    refuse_unknown(options, RequestOptions, _name("infer", texts))
    started = time.monotonic()
    deadline = Deadline(started + _timeout(core, timeout_s), persist=True)
    tenant = tenant_of(options)
    yield from ensure_config(core, deadline)
    listener = core.listener

    def write(lane: Lane) -> Call[tuple[Lane, list[Prepared]]]:
        listened = None if listener is None else listener(lane)
        key = listened or (None if isinstance(texts, tuple) else lane.reply_key(lane.new_id()))
        batch = _prepare(core, lane, texts, reply_to=key, **_infer_request(deadline, options))
        if listened is not None:
            yield Listen(tuple(p.id for p in batch), listened)
        yield from enqueue(core, lane, batch, deadline, awaited=True, tenant=tenant)
        return lane, batch

    lane, batch = yield from on_current_shard(core, deadline, write)
    ids = [p.id for p in batch]
    if listener is not None:
        outcomes, unreachable = yield Collect(tuple(ids), deadline)
    elif isinstance(texts, tuple):  # on its own reply key
        outcomes, unreachable = yield from own_replies(core, {batch[0].reply_to: ids[0]}, deadline)
    else:
        reply_key = batch[0].reply_to if batch else ""
        outcomes, unreachable = yield from drain(core, reply_key, set(ids), deadline)
    missing = [i for i in ids if i not in outcomes]
    yield from _missing(core, lane, missing, outcomes, started, unreachable)
    return settle(ids, outcomes, errors)


def workers_alive(core: ClientCore) -> Call[int]:
    """How many workers of the queue are alive now (0: nobody would answer); needs the
    optional reads of docs/SECURITY.md (``HKEYS``, ``EXISTS``)."""
    return (yield from live_workers(core, core.lanes.home, Deadline.after(core.settings.timeout_s)))


def queue_length(core: ClientCore, timeout_s: float | None = None) -> Call[int]:
    """How many requests the queue holds (pending and in flight), on its own stream and every
    tenant's, summed over a sharded queue's lanes (queue_depth.lua: a call each); raises
    ``BrokerUnavailable`` past ``timeout_s`` (default ``settings.timeout_s``)."""
    deadline = Deadline.after(core.settings.timeout_s if timeout_s is None else timeout_s)
    yield from ensure_config(core, deadline)
    total = 0
    for lane in core.lanes.every():
        found = yield from execute(core, deadline, QUEUE_DEPTH, keys=[lane.stream_key],
                                   args=["length"])
        total += int(found[0])
    return total


def pending_tokens(core: ClientCore, timeout_s: float | None = None) -> Call[int]:
    """The queue's pending tokens (every tenant's, summed over a sharded queue's lanes: what
    KEDA scales on; a sum holding no count, written by hand, counts 0 and is logged once);
    raises ``BrokerUnavailable`` past ``timeout_s``."""
    deadline = Deadline.after(core.settings.timeout_s if timeout_s is None else timeout_s)
    yield from ensure_config(core, deadline)
    total = 0
    for lane in core.lanes.every():
        key = keys.pending(lane.queue)
        found = yield from execute(core, deadline, "hget", key, keys.PENDING_TOTAL)
        counted = keys.pending_count(found)
        if counted is None and found is not None and key not in _UNCOUNTED:
            _UNCOUNTED.add(key)
            log.warning("%s field %s holds %r, not a count: read as 0 until it is one again "
                        "(tokenq's scripts keep it; docs/PROTOCOL.md, \"Pending tokens\")", key,
                        keys.PENDING_TOTAL, found[:40])
        total += max(0, counted or 0)
    return total


_UNCOUNTED: set[str] = set()
"""The pending hashes whose sum was found holding no count: each logged once a process."""


def config(core: ClientCore) -> Call[dict[str, str]]:
    """The queue's config hash as workers published it (empty before any started); also
    refreshes the copy enqueues are checked against."""
    return read_config(core, Deadline.after(core.settings.timeout_s), strict=True)


def command(core: ClientCore, name: str, *args: Any, **kwargs: Any) -> Call[Any]:
    """One redis-py command by name, bounded by ``timeout_s`` (keys kept beside the queue's)."""
    return execute(core, Deadline.after(core.settings.timeout_s), name, *args, **kwargs)


def _timeout(core: ClientCore, timeout_s: float | None) -> float:
    return core.settings.timeout_s if timeout_s is None else check_seconds(timeout_s, "timeout_s")


def _texts(texts: Iterable[TextItem]) -> list[TextItem]:
    """``texts`` as a list, so a call retried on another shard prepares the same inputs."""
    if isinstance(texts, (str, bytes)):
        raise BadRequest("texts must be a sequence of strings, not a single string (use "
                         "submit/infer for one text)", param="texts")
    try:
        return list(texts)
    except TypeError:
        raise BadRequest(f"texts must be a sequence of strings, got {type(texts).__name__}",
                         param="texts") from None


def _infer_request(deadline: Deadline, options: RequestOptions) -> dict[str, Any]:
    """An infer call's request options. Its deadline, unless given, is the rest of the timeout
    (capped at the protocol's largest): no worker spends device time on an answer nobody awaits."""
    request: dict[str, Any] = {**options, "now_ms": _now_ms()}
    if options.get("deadline_s") is None and options.get("deadline_ms") is None:
        request["deadline_s"] = min(max(deadline.remaining(), 0.001), wire.MAX_TIMEOUT_MS / 1000)
    return request


def _name(call: str, texts: Texts) -> str:
    """``call`` for one text, ``call_many`` for a batch."""
    return call if isinstance(texts, tuple) else f"{call}_many"


def _now_ms() -> int:
    """The wall clock in epoch ms, which turns an absolute ``deadline_ms`` into a relative one."""
    return int(time.time() * 1000)
