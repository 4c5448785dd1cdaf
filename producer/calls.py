"""Every call of a producer, as the sequence of steps it takes: no I/O here.

Rule: which Redis commands a client sends, in which order, what it retries,
how long it waits and what it makes of each answer lives in this module,
once for both clients (the shape of h11). Each call (``submit``,
``infer``, ``results``, ...) is a generator that yields a :class:`Step`,
what to do next, and is resumed with the step's answer, or has the step's
failure thrown in (:class:`Unreachable`, :class:`ErrorReply`). A driver
performs the steps without knowing the sequence: ``Client._run`` by
blocking, ``AsyncClient._run`` by awaiting (see :func:`resume`). What to
write and what a reply means are decided by
:class:`~tokenq.producer.core.ClientCore`.

The steps a call may ask for:

* :class:`Send`: one Redis command, bounded by the caller's deadline.
* :class:`Sleep`: a backoff after Redis was unreachable.
* :class:`ShareConfigRead`: the queue's config hash is stale; read it with
  :func:`read_config`, or wait for the read another caller has in flight,
  until the deadline.
* :class:`LoadTokenizer`: load the tokenizer.json the config names, once,
  away from the caller; wait for it until the deadline.
* :class:`Listen` and :class:`Collect` (AsyncClient only): its one listener
  resolves replies on the client's own key; register the ids before the
  enqueue (a reply may beat the script's answer), then wait for them.

Without a listener ``infer`` waits on the request's own reply key and
``infer_many`` on one key of its own for the whole batch. Deadlines are on
the ``time.monotonic()`` clock, which the sequences read through
:class:`~tokenq.producer.deadline.Deadline`; the wall clock is read once per
enqueue, for an absolute ``deadline_ms``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tokenq.producer.call_options import RequestOptions, SubmitOptions, refuse_unknown
from tokenq.producer.core import ENQUEUE_SCRIPT, PEEK_SCRIPT, ClientCore
from tokenq.producer.deadline import Deadline, backoff_s
from tokenq.producer.prepare import Prepared, TextItem
from tokenq.producer.replies import Outcome, Result
from tokenq.producer.shards import ShardRetired, is_retired, shard_for
from tokenq.shared import keys
from tokenq.shared.errors import BrokerUnavailable
from tokenq.shared.failures import error_text

T = TypeVar("T")

ENQUEUE = "enqueue"
"""The :class:`Send` command name of the enqueue script (enqueue.lua), which each client loads."""

PEEK = "peek_replies"
"""The :class:`Send` command name of peek_replies.lua, which each client loads too."""

DURABLE_ENQUEUE = "durable_enqueue"
"""The :class:`Send` command name of a durable enqueue: the enqueue script, then ``WAIT
replicas timeout_ms``, pipelined on one connection (WAIT counts only the writes of the
connection it runs on). Answer: the script's reply and how many replicas confirmed."""

ENQUEUE_SEEN = "enqueue_seen"
"""The :class:`Send` command name of the enqueue script as a read-only function: it answers
a batch written before (every entry seen) and refuses one with anything new, even when
Redis is at ``maxmemory`` and refuses the enqueue function itself (:func:`_written_before`)."""

SCRIPTS = {ENQUEUE: ENQUEUE_SCRIPT, PEEK: PEEK_SCRIPT, ENQUEUE_SEEN: ENQUEUE_SCRIPT}
"""Every script a :class:`Send` may name, by name (its short name in
:data:`tokenq.shared.lua_scripts.SCRIPTS`): each client calls it as a function of tokenq's
library, ``FCALL`` (:mod:`tokenq.shared.functions`; ``EVALSHA`` before Redis 7)."""

log = logging.getLogger("tokenq.producer")


# ------------------------------------------------------------------ failures


class CommandFailed(Exception):
    """A Redis command failed; thrown into the call by its driver. ``error``: redis-py's exception.

    One the call does not handle reaches the caller as ``error`` itself.
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class Unreachable(CommandFailed):
    """No answer: refused, cut off, timed out, or BUSY (a script holds Redis; nothing ran)."""


class ErrorReply(CommandFailed):
    """Redis answered with an error reply (the enqueue script's QUEUEFULL, an ACL's NOPERM, ...)."""


class OutOfMemory(ErrorReply):
    """Redis refused a write at its ``maxmemory``; a script is refused before its first write."""


# --------------------------------------------------------------------- steps


@dataclass(slots=True, eq=False)  # made per command: no frozen-init cost
class Send:
    """Run one command: ``command`` names a method of redis-py's client, or :data:`ENQUEUE`.

    The driver bounds every wait of it (socket, pool, redis-py's retries) by
    ``deadline`` (monotonic) plus ``DEADLINE_GRACE_S``. Answer: the reply.
    """

    command: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    deadline: float


@dataclass(frozen=True, slots=True)
class Sleep:
    """Pause for ``seconds``. Answer: None."""

    seconds: float


@dataclass(frozen=True, slots=True)
class ShareConfigRead:
    """Run :func:`read_config` (not strict), or join the read in flight; wait until ``deadline``.

    Only the caller whose read it is sees its failure (BrokerUnavailable);
    the others carry on with what the cache holds. Answer: None.
    """

    deadline: Deadline


@dataclass(frozen=True, slots=True)
class LoadTokenizer:
    """Load ``path`` off the caller's thread (or loop), once, into the config cache.

    Wait for it until ``deadline``; a longer load goes on without the caller,
    who carries on with the heuristic. Answer: None.
    """

    path: str
    deadline: Deadline


@dataclass(frozen=True, slots=True)
class Listen:
    """Have the client's listener of ``key`` keep the replies to ``ids``. Answer: None."""

    ids: tuple[str, ...]
    key: str


@dataclass(frozen=True, slots=True)
class Collect:
    """Wait until the listener holds every reply to ``ids``, or ``deadline``.

    Answer: ``(outcomes, unreachable)``, the outcomes in by then and the
    listener's last outage (None if Redis answered it last).
    """

    ids: tuple[str, ...]
    deadline: Deadline


Step = Send | Sleep | ShareConfigRead | LoadTokenizer | Listen | Collect

Listener = Callable[["ClientCore"], str]
"""The reply key a client's listener reads for requests written through a core (shard)."""
Call = Generator[Step, Any, T]
"""A call in progress: yields steps, is sent their answers, returns the call's value."""


@dataclass(slots=True, eq=False)  # made per command: no frozen-init cost
class Done(Generic[T]):
    """What :func:`resume` returns once the call returned ``value``."""

    value: T


def resume(
    call: Call[T], answer: Any = None, failure: BaseException | None = None
) -> Step | Done[T]:
    """The call's next step, given the last step's ``answer`` or ``failure``; Done at its end.

    A driver calls ``resume(call)`` to start, performs each step and resumes
    with what came of it, until Done. What the call raises reaches the
    caller; a :class:`CommandFailed` it does not handle does so as
    redis-py's own exception.
    """
    try:
        return call.send(answer) if failure is None else call.throw(failure)
    except StopIteration as stop:
        return Done(stop.value)
    except CommandFailed as failed:
        error = failed.error
        raise error from error.__cause__


# ------------------------------------------------------------------ commands


def command(
    core: ClientCore, deadline: Deadline, name: str, *args: Any, **kwargs: Any
) -> Call[Any]:
    """One command for a caller; BrokerUnavailable when Redis stays unreachable.

    With ``deadline.persist`` an outage is tried again, with backoff, until
    the deadline (``infer``: the caller gave that time for an answer, and a
    retried enqueue is deduplicated by the script); without it redis-py's
    own ``retries`` are all it gets.
    """
    failures = 0
    while True:
        try:
            return (yield Send(name, args, kwargs, deadline.at))
        except Unreachable as down:
            failures += 1
            if deadline.persist:
                yield Sleep(deadline.cap(backoff_s(failures)))
            if not deadline.persist or deadline.remaining() <= 0:
                raise core.unreachable(down.error) from down.error


def read_config(core: ClientCore, deadline: Deadline, *, strict: bool) -> Call[dict[str, str]]:
    """HGETALL the config hash into the cache, loading a tokenizer it newly names.

    Not ``strict``: a refused read (an ACL without access to the hash)
    leaves the client without early checks instead of failing enqueues.
    """
    try:
        raw = yield from command(core, deadline, "hgetall", core.config_key)
    except ErrorReply as refused:
        if strict:
            raise
        core.config_unreadable(refused.error, time.monotonic())
        return {}
    path = core.take_config(raw, time.monotonic())
    if path is not None:
        yield LoadTokenizer(path, deadline)
    return core.decode_config(raw)


def ensure_config(core: ClientCore, deadline: Deadline) -> Call[None]:
    """Before an enqueue: the cached config hash at most ``config_ttl_s`` old."""
    if core.config_due(time.monotonic()):
        yield ShareConfigRead(deadline)


def choose_shard(
    core: ClientCore, deadline: Deadline, reply_to: object = None, pin: str | None = None
) -> Call[ClientCore]:
    """The core (shard) this enqueueing call writes through; ``core`` itself unsharded.

    A ``reply_to`` in one shard's reply namespace pins the call to that
    shard (a worker answers only within its request's shard); so does
    ``pin``, a caller-chosen request id, to the shard it hashes to
    (:func:`~tokenq.producer.shards.shard_for`). Otherwise,
    with ``shard_choice="shortest"`` the shards' lengths are read first when
    the last reading is stale: one XLEN per shard (in a Cluster each is on
    its own node). A refused XLEN (an ACL) leaves the choice round robin.
    """
    count = core.shards()
    if count == 1:
        return core
    if isinstance(reply_to, str):
        pinned = keys.shard_of_reply_key(core.queue, count, reply_to)
        if pinned is not None:
            return core.lane(pinned)
    if pin is not None:
        return core.lane(shard_for(pin, count))
    if core.chooser.lengths_due(count, time.monotonic()):
        lengths = []
        try:
            for shard in range(count):
                lane = core.lane(shard)
                lengths.append(int((yield from command(lane, deadline, "xlen", lane.stream_key))))
        except ErrorReply as refused:
            log.debug("cannot read the shards' lengths (%s); choosing round robin", refused.error)
            lengths = []
        core.chooser.take_lengths(lengths, time.monotonic())
    return core.lane(core.chooser.pick(count))


def on_current_shard(
    core: ClientCore, deadline: Deadline, write: Callable[[ClientCore], Call[T]],
    reply_to: object = None, pin: str | None = None,
) -> Call[T]:
    """``write`` through the shard :func:`choose_shard` picks; on another if that one is retired.

    A client holding a stale shard count (up to ``config_ttl_s``) may pick a
    shard the workers retired; enqueue.lua refuses it with nothing written
    (:mod:`tokenq.producer.shards`). The call reads the config again and
    chooses among the shards it names now, so the caller sees nothing of it.
    Only a count that still includes the refused shard (a ``shards`` setting,
    a config it may not read) reaches the caller, as :class:`ShardRetired`.
    Each retry chooses below the refused shard, so this ends.
    """
    while True:
        lane = yield from choose_shard(core, deadline, reply_to, pin)
        try:
            return (yield from write(lane))
        except ShardRetired as retired:
            yield from read_config(core, deadline, strict=False)
            count = core.shards()
            if count > 1 and retired.shard < count:  # a count of 1 is the plain {q} alone
                raise
            log.info("shard %d of queue %r is retired; choosing again among %d shards",
                     retired.shard, core.queue.name, count)


def enqueue(
    core: ClientCore, batch: Sequence[Prepared], deadline: Deadline, *, awaited: bool = False
) -> Call[None]:
    """Write ``batch`` with the enqueue script, all or nothing; QueueFull when it does not fit.

    A durable enqueue too few replicas confirmed raises NotReplicated, unless
    ``awaited``: the call waits for the replies itself (``infer``,
    ``infer_many``), so it goes on waiting as usual, and the miss is counted
    and logged (:meth:`ClientCore.unconfirmed`). The requests are queued and
    will be answered; an error would only invite a retry that runs them twice
    (docs/decisions/0025-durable-enqueue-waits-on.md).
    """
    if not batch:
        return
    yield from _write(core, batch, deadline, awaited)
    core.chooser.added(core.shard, len(batch))


def _write(
    core: ClientCore, batch: Sequence[Prepared], deadline: Deadline, awaited: bool
) -> Call[None]:
    replicas = core.settings.durable_replicas
    try:
        # With ``persist`` a lost reply is retried with the same ids and
        # seen keys, which the script answers without adding anything.
        if not replicas:
            yield from command(
                core, deadline, ENQUEUE, keys=core.script_keys(batch), args=core.script_args(batch)
            )
            return
        wait_ms = max(1, min(core.settings.durable_timeout_ms, int(deadline.remaining() * 1000)))
        _, confirmed = yield from command(
            core, deadline, DURABLE_ENQUEUE, keys=core.script_keys(batch),
            args=core.script_args(batch), replicas=replicas, timeout_ms=wait_ms,
        )
    except OutOfMemory:
        if not replicas and (yield from _written_before(core, batch, deadline)):
            return
        raise core.broker_full(len(batch)) from None
    except ErrorReply as refused:
        if core.shard is not None and is_retired(str(refused.error)):
            raise ShardRetired(core.queue.name, core.shard) from None
        full = core.queue_full(str(refused.error), len(batch))
        if full is None:
            raise
        raise full from None
    if confirmed < replicas:
        missed = core.not_replicated(batch, confirmed, wait_ms)
        core.unconfirmed(missed, awaited=awaited)
        if not awaited:
            raise missed


def _written_before(core: ClientCore, batch: Sequence[Prepared], deadline: Deadline) -> Call[bool]:
    """After Redis refused the enqueue for memory: whether an earlier try wrote all of ``batch``.

    Redis refuses a function that may write before it runs when it is at
    ``maxmemory``, even when it would write nothing: the retry of a batch whose
    first try was written but whose reply was lost (and whose writes may be
    what filled the memory) would be told "nothing was written", and the work
    submitted again. The read-only twin (:data:`ENQUEUE_SEEN`) runs at
    ``maxmemory`` and answers such a batch from its seen keys; a batch with
    anything new makes it fail at its first write, before writing anything.
    """
    try:
        yield from command(core, deadline, ENQUEUE_SEEN, keys=core.script_keys(batch),
                           args=core.script_args(batch))
    except ErrorReply:
        return False
    return True


def queue_length(core: ClientCore) -> Call[int]:
    """XLEN of the queue's stream (pending and in flight); summed over a sharded queue's."""
    deadline = core.deadline()
    yield from ensure_config(core, deadline)
    total = 0
    for lane in core.lanes():
        total += int((yield from command(lane, deadline, "xlen", lane.stream_key)))
    return total


def workers_alive(core: ClientCore) -> Call[int]:
    """:func:`live_workers` for a caller, bounded by ``settings.timeout_s``."""
    return (yield from live_workers(core, core.deadline()))


# ------------------------------------------------------------------- waiting


Outcomes = dict[str, Outcome | Exception]


@dataclass(frozen=True, slots=True)
class Sent:
    """What an infer call wrote, and through which core (shard): where its replies land."""

    core: ClientCore
    batch: Sequence[Prepared]


def _poll(
    core: ClientCore,
    deadline: Deadline,
    pending: Sized,
    pop: Callable[[float, list[Any]], Call[None]],
    take: Callable[[Any], None],
    *,
    at_least_once: bool = False,
) -> Call[BaseException | None]:
    """Pop replies with ``pop`` and hand each to ``take`` until none is ``pending`` or the deadline.

    Each pop blocks at most ``core.block_s`` (under the socket timeout), so
    the loop, not redis-py, waits out the caller's time; an outage is
    backed off and tried again until then. What a pop got counts even if a
    later command of it failed. ``at_least_once`` pops once (for the
    shortest block) even past the deadline: replies that landed while the
    caller waited on another shard are in hand, not timed out. Returns
    Redis's last outage, or None.
    """
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
            yield from pop(core.block_s(remaining), popped)
            unreachable, failures = None, 0
        except Unreachable as down:
            unreachable, failures = down.error, failures + 1
        for item in popped:
            take(item)
        if failures and pending:
            yield Sleep(deadline.cap(backoff_s(failures)))
    return unreachable


LIVENESS_CHECK_S = 0.1
"""How long the check behind a timeout's "no live worker" may take, past the caller's deadline."""


def live_workers(core: ClientCore, deadline: Deadline) -> Call[int]:
    """How many of the queue's workers are alive: named in the workers hash, liveness key set.

    Two reads: HKEYS of the workers hash, then one EXISTS over those
    workers' liveness keys (which expire three heartbeats after a worker's
    last beat). BrokerUnavailable or the ACL's refusal as any command's.
    """
    names = yield from command(core, deadline, "hkeys", core.workers_key)
    if not names:
        return 0
    return int((yield from command(core, deadline, "exists", *core.alive_keys(names))))


def why_unanswered(core: ClientCore, missing: Sequence[str]) -> Call[str | None]:
    """After a wait that left ``missing`` unanswered: the reason, if no worker is alive.

    :func:`live_workers`, bounded by :data:`LIVENESS_CHECK_S`. Best effort: a
    Redis that does not answer, or an ACL without these reads (docs/SECURITY.md
    lists them as optional), gives no reason rather than another error.
    """
    if not missing:
        return None
    try:
        alive = yield from live_workers(core, Deadline.after(LIVENESS_CHECK_S))
    except Exception as exc:  # a timeout's message must not become another error
        log.debug("could not tell whether any worker is alive: %s", error_text(exc))
        return None
    return None if alive else core.no_live_worker()


def own_keys(
    core: ClientCore, wanted: dict[str, str], deadline: Deadline, started: float
) -> Call[Outcomes]:
    """:func:`own_replies` of ``wanted``, then every one still missing recorded as such."""
    outcomes, unreachable = yield from own_replies(core, wanted, deadline)
    yield from _missing(core, list(wanted.values()), outcomes, started, unreachable)
    return outcomes


def own_replies(
    core: ClientCore, wanted: dict[str, str], deadline: Deadline, *, at_least_once: bool = False,
    keep: bool = False,
) -> Call[tuple[Outcomes, BaseException | None]]:
    """Outcomes of requests whose replies land on their own keys (``wanted``: key -> id).

    Nothing is removed before it is in hand (docs/RELIABILITY.md, "A reply
    lost on its way"): one script call reads every key still missing
    (peek_replies.lua); when none has a reply, ``BLMOVE key key`` waits on
    the first, a rotation that returns the reply and leaves it where it
    was; the keys read are deleted at the end, in one DEL. A reply whose
    read never arrived (Redis stopped, the connection dropped) is read
    again on the next try.
    """
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
        core.own_key_reply(wanted, key, raw, outcomes)
        read.append(key)

    unreachable = yield from _poll(core, deadline, wanted, pop, take, at_least_once=at_least_once)
    if read and not keep:
        yield from _forget(deadline, "delete", *read)
    return outcomes, unreachable


def forget_replies(core: ClientCore, request_ids: Sequence[str]) -> Call[None]:
    """Delete the reply keys of requests whose replies were read with ``keep`` (best effort)."""
    deadline = core.deadline()
    core.check_ids(request_ids)
    retired = yield from retired_shards_named(core, request_ids, deadline)
    for wanted in core.reply_keys(request_ids, retired).values():
        yield from _forget(deadline, "delete", *wanted)


_ROTATE = {"src": "LEFT", "dest": "RIGHT"}
"""``BLMOVE key key LEFT RIGHT``: waits like BLPOP, moves the head to the tail, removes nothing."""


def _forget(deadline: Deadline, command: str, *args: Any) -> Call[None]:
    """Remove replies already in hand (DEL, LTRIM); best effort, since each key expires anyway.

    The reply keys carry the worker's ``reply_ttl_s``, so one that cannot be
    removed now (Redis down) still goes, later; the caller's outcome does not
    wait for it.
    """
    try:
        yield Send(command, args, {}, deadline.at)
    except Unreachable:
        log.debug("could not remove replies already read (%s); they expire", command)


def _missing(
    core: ClientCore, ids: Sequence[str], outcomes: Outcomes, started: float,
    unreachable: BaseException | None,
) -> Call[None]:
    """Record every request of ``ids`` still unanswered, with why when no worker is alive."""
    waited_s = time.monotonic() - started
    why = None if unreachable else (yield from why_unanswered(core, ids))
    core.missing(ids, outcomes, waited_s, unreachable, why)


def drain(
    core: ClientCore, reply_key: str, pending: set[str], deadline: Deadline, started: float
) -> Call[Outcomes]:
    """Outcomes of the ``pending`` ids, whose replies all land on ``reply_key``.

    Read, then removed: ``LRANGE`` takes what has landed, matched by id,
    and only then ``LTRIM`` drops what was read (the worker only appends,
    so the first ``n`` are those). With nothing there, ``BLMOVE key key``
    waits without removing anything. So a reply is never removed before it
    is in hand (docs/RELIABILITY.md); one read twice is matched once.
    """
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
        core.shared_key_reply(pending, raw, outcomes)

    unreachable = yield from _poll(core, deadline, pending, pop, take)
    yield from _missing(core, sorted(pending), outcomes, started, unreachable)
    return outcomes


def written(
    core: ClientCore, batch: Sequence[Prepared], deadline: Deadline, key: str | None
) -> Call[Sent]:
    """Enqueue ``batch``, first having the client's listener of ``key`` (if any) keep its
    replies: a reply may beat the script's answer."""
    if key is not None:
        yield Listen(tuple(p.id for p in batch), key)
    yield from enqueue(core, batch, deadline, awaited=True)
    return Sent(core, batch)


def listened(
    core: ClientCore, batch: Sequence[Prepared], deadline: Deadline, started: float
) -> Call[Outcomes]:
    """Collect what the client's listener resolves for ``batch`` (see :func:`written`)."""
    ids = tuple(p.id for p in batch)
    outcomes, unreachable = yield Collect(ids, deadline)
    missing = [i for i in ids if i not in outcomes]
    yield from _missing(core, missing, outcomes, started, unreachable)
    return outcomes


# --------------------------------------------------------------------- calls


def submit(
    core: ClientCore, text: str, text_pair: str | None, options: SubmitOptions
) -> Call[str]:
    """Enqueue one text; its id. Bounded by ``settings.timeout_s``."""
    refuse_unknown(options, SubmitOptions, "submit")
    deadline = core.deadline()
    yield from ensure_config(core, deadline)

    def write(lane: ClientCore) -> Call[str]:
        prepared = lane.prepare(text, now_ms=_now_ms(), text_pair=text_pair, **options)
        yield from enqueue(lane, [prepared], deadline)
        return prepared.id

    return (yield from on_current_shard(core, deadline, write, options.get("reply_to")))


def submit_many(
    core: ClientCore, texts: Iterable[TextItem], options: SubmitOptions,
    unique: Sequence[str] | None = None,
) -> Call[list[str]]:
    """Enqueue a batch all or nothing; the ids in input order (``unique``: see
    :meth:`ClientCore.prepare_many`)."""
    refuse_unknown(options, SubmitOptions, "submit_many")
    deadline = core.deadline()
    yield from ensure_config(core, deadline)
    items = _replayable(texts)

    def write(lane: ClientCore) -> Call[list[str]]:
        batch = lane.prepare_many(items, now_ms=_now_ms(), unique=unique, **options)
        yield from enqueue(lane, batch, deadline)
        return [p.id for p in batch]

    pin = unique[0] if unique else None  # a retry of the same ids: the same shard
    return (yield from on_current_shard(core, deadline, write, options.get("reply_to"), pin))


def results(
    core: ClientCore, request_ids: Sequence[str], timeout_s: float | None, return_exceptions: bool,
    keep: bool = False,
) -> Call[list[Any]]:
    """Wait for submitted requests' replies on their own keys; outcomes in input order.

    Requests of a sharded queue are waited for shard by shard (one script
    may read keys of one slot only), all within the one deadline. ``keep``:
    leave the replies read on their keys (until their TTL, or
    :func:`forget_replies`), so that another reader of the same ids gets them too.
    """
    started = time.monotonic()
    deadline = Deadline(started + core.timeout(timeout_s))
    core.check_ids(request_ids)
    retired = yield from retired_shards_named(core, request_ids, deadline)
    by_shard = core.reply_keys(request_ids, retired)
    several = len(by_shard) > 1
    outcomes: Outcomes = {}
    unreachable: BaseException | None = None
    for shard, wanted in by_shard.items():
        got, down = yield from own_replies(core.lane(shard), wanted, deadline,
                                           at_least_once=several, keep=keep)
        outcomes.update(got)
        unreachable = unreachable or down
    # own_replies leaves in each ``wanted`` exactly the ids it did not get.
    missing = [i for wanted in by_shard.values() for i in wanted.values()]
    yield from _missing(core, missing, outcomes, started, unreachable)
    return core.settle(request_ids, outcomes, return_exceptions)


def retired_shards_named(
    core: ClientCore, request_ids: Sequence[str], deadline: Deadline
) -> Call[frozenset[int]]:
    """Of the shards ``request_ids`` name that the queue does not have now, the retired ones.

    Such an id's reply is on its shard if the queue once had it (a retired
    shard keeps its marker: :mod:`tokenq.producer.shards`), else on ``{q}``
    (:meth:`ClientCore.shard_of_id`). Read only when an id names a shard:
    the config hash for K (as an enqueue reads it), then one ``EXISTS`` of
    each such shard's marker. Best effort: a read refused (an ACL without the
    shard's keys) or not answered counts as not retired, and an outage is
    the wait's to report.
    """
    if all(keys.shard_in_id(request_id) is None for request_id in request_ids):
        return frozenset()
    try:
        yield from ensure_config(core, deadline)
    except BrokerUnavailable:
        return frozenset()
    retired: set[int] = set()
    for shard in core.shards_beyond(request_ids):
        lane = core.lane(shard)
        try:
            if (yield from command(lane, deadline, "exists", keys.retired(lane.queue))):
                retired.add(shard)
        except (ErrorReply, BrokerUnavailable) as exc:
            log.debug("cannot tell whether shard %d is retired (%s): taken as not", shard,
                      error_text(exc))
    return frozenset(retired)


def infer(
    core: ClientCore,
    text: str,
    text_pair: str | None,
    timeout_s: float | None,
    options: RequestOptions,
    listener: Listener | None,
) -> Call[Result]:
    """Enqueue one text and wait for its result (``listener``: the client's listened key)."""
    refuse_unknown(options, RequestOptions, "infer")
    started = time.monotonic()
    deadline = Deadline(started + core.timeout(timeout_s), persist=True)
    yield from ensure_config(core, deadline)

    def write(lane: ClientCore) -> Call[Sent]:
        request = _infer_request(lane, deadline, options)
        key = None if listener is None else listener(lane)
        prepared = lane.prepare(text, text_pair=text_pair, reply_to=key, **request)
        return (yield from written(lane, [prepared], deadline, key))

    sent = yield from on_current_shard(core, deadline, write)
    core, (prepared,) = sent.core, sent.batch
    if listener is None:
        wanted = {prepared.reply_to: prepared.id}
        outcomes = yield from own_keys(core, wanted, deadline, started)
    else:
        outcomes = yield from listened(core, sent.batch, deadline, started)
    return core.settle([prepared.id], outcomes, False)[0]


def infer_many(
    core: ClientCore,
    texts: Iterable[TextItem],
    timeout_s: float | None,
    return_exceptions: bool,
    options: RequestOptions,
    listener: Listener | None,
) -> Call[list[Any]]:
    """Enqueue a batch all or nothing and wait for every result, in input order."""
    refuse_unknown(options, RequestOptions, "infer_many")
    started = time.monotonic()
    deadline = Deadline(started + core.timeout(timeout_s), persist=True)
    yield from ensure_config(core, deadline)
    items = _replayable(texts)

    def write(lane: ClientCore) -> Call[Sent]:
        key = lane.reply_key(lane.new_id()) if listener is None else listener(lane)
        request = _infer_request(lane, deadline, options)
        batch = lane.prepare_many(items, reply_to=key, **request)
        return (yield from written(lane, batch, deadline, None if listener is None else key))

    sent = yield from on_current_shard(core, deadline, write)
    core, batch = sent.core, sent.batch
    if listener is None:
        reply_key = batch[0].reply_to if batch else ""
        outcomes = yield from drain(core, reply_key, {p.id for p in batch}, deadline, started)
    else:
        outcomes = yield from listened(core, batch, deadline, started)
    return core.settle([p.id for p in batch], outcomes, return_exceptions)


def _replayable(texts: Iterable[TextItem]) -> Iterable[TextItem]:
    """``texts`` as a list, so a call retried on another shard (:func:`on_current_shard`)
    prepares the same inputs; a string or a non-iterable as it is, for ``prepare_many``
    to refuse by name."""
    if isinstance(texts, (str, bytes)):
        return texts
    try:
        return list(texts)
    except TypeError:
        return texts


def _infer_request(core: ClientCore, deadline: Deadline, options: RequestOptions) -> dict[str, Any]:
    """An infer call's request options, its deadline made the rest of the timeout if none given.

    So no worker spends device time on an answer nobody waits for any more.
    """
    deadline_s, deadline_ms = core.infer_deadline(
        deadline.remaining(), options.get("deadline_s"), options.get("deadline_ms")
    )
    return {**options, "now_ms": _now_ms(), "deadline_s": deadline_s, "deadline_ms": deadline_ms}


def _now_ms() -> int:
    """The wall clock in epoch ms, which turns an absolute ``deadline_ms`` into a relative one."""
    return int(time.time() * 1000)
