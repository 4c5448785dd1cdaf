"""Every Redis key tokenq touches is named here, and only here.

Layout for queue ``q`` under the default prefix ``tokenq``::

    tokenq:{q}:requests        stream   producers XADD; consumer group "workers"
    tokenq:{q}:requests:<t>    stream   the same for tenant <t> (the default tenant's is
                                        tokenq:{q}:requests)
    tokenq:{q}:tenants         set      the tenant streams written to (enqueue.lua SADDs)
    tokenq:{q}:tenants:added   stream   a stream new to that set (enqueue.lua XADDs, MAXLEN
                                        64): idle workers block on it to read a new tenant
    tokenq:{q}:weights         hash     tenant -> its weight in the fair share, set by the
                                        operator; field "*" the weight of tenants not named
    tokenq:{q}:pending         hash     pending tokens: "tokens" the sum of the streams'
                                        entries' first field "counted" (wire.COUNTED_FIELD),
                                        "tokens:<t>" tenant <t>'s part (:func:`pending_field`);
                                        kept by the scripts that add or delete entries
    tokenq:{q}:quotas          hash     tenant -> most pending tokens it may hold, set by the
                                        operator (tokenq quotas); field "*": tenants not named
    tokenq:{q}:dead            stream   dead letters, with their error
    tokenq:{q}:config          hash     written by workers at start: model, limits, policy
    tokenq:{q}:workers         hash     consumer name -> last heartbeat (msgpack map)
    tokenq:{q}:worker:<name>   string   liveness key with a TTL, refreshed by each heartbeat
    tokenq:{q}:reply:<id>      list     replies (msgpack maps), PEXPIREd by the worker
    tokenq:{q}:seen:<id>       string   request ids enqueued lately (retry dedupe), TTL
    tokenq:{q}:seen:call.<h>   string   one enqueue call's stream ids (retry dedupe of a call
                                        of fresh ids; <h> digests its request ids), TTL
    tokenq:{q}:shards_served   string   highest shard count served while shards beyond
                                        today's are still draining (:func:`shards_served`)
    tokenq:{q:k}:retired       string   shard k is retired: enqueue.lua refuses new entries
    tokenq:{q}:idem:<h>        string   the gateway's record of one Idempotency-Key (<h>
                                        digests the key): route and body digest, then the
                                        finished HTTP answer; TTL the dedupe window
    tokenq:{q}:idem:<h>:lease  string   which gateway request computes that answer now; TTL
                                        its --timeout-s and a grace
    tokenq:{q}:cache           hash     result cache: digest -> written ms + reply (workers)
    tokenq:{q}:cache_index     zset     the cache's digests by the ms each was written
    tokenq:{q}:cache_bytes     string   the bytes the cache's entries are counted at
    tokenq:{q}:cache_claim:<d> string   the worker computing digest <d> (hex) now, for the
                                        others to wait for; TTL its lease

The braces are a Redis Cluster hash tag: one queue's keys share a slot. A queue of K > 1
shards is served on ``{q:0}`` … ``{q:K-1}``, each with every key above, plus the plain
``{q}``; shards beyond a shrunk K are retired and drained
(docs/decisions/0026-a-shard-is-a-whole-queue.md, 0029-drain-retired-shards.md).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenq.shared.redis_text import as_text

GROUP = "workers"
"""The consumer group every worker of a queue reads through."""
DEFAULT_PREFIX = "tokenq"
MAX_SHARDS = 256
"""The most shards a queue may have (a Cluster has 16384 slots; far more than nodes)."""
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_TENANT = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
DEFAULT_TENANT = "default"
"""The tenant of a request that names none: its stream is the queue's own ``requests``."""


@dataclass(frozen=True, slots=True)
class QueueRef:
    """One queue (or one shard of it) under one key prefix."""

    name: str
    prefix: str = DEFAULT_PREFIX
    shard: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"queue name {self.name!r} is invalid: use 1-128 characters from "
                "letters, digits, '_', '.', '-'"
            )
        if not isinstance(self.prefix, str) or not _NAME.match(self.prefix):
            raise ValueError(f"key prefix {self.prefix!r} is invalid: use letters, digits, _.-")
        if self.shard is not None and (type(self.shard) is not int or self.shard < 0):
            raise ValueError(f"shard must be a non-negative integer, got {self.shard!r}")

    @property
    def tag(self) -> str:
        """The hash-tagged part shared by every key of this queue (shard)."""
        inner = self.name if self.shard is None else f"{self.name}:{self.shard}"
        return f"{self.prefix}:{{{inner}}}"


def shards_of(q: QueueRef, shards: int) -> tuple[QueueRef, ...]:
    """Where a queue of ``shards`` shards takes requests: ``(q,)`` for 1, else ``{q:0}`` …."""
    if type(shards) is not int or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be an integer from 1 to {MAX_SHARDS}, got {shards!r}")
    if shards == 1:
        return (q,)
    return tuple(QueueRef(q.name, q.prefix, k) for k in range(shards))


def lanes_of(q: QueueRef, shards: int) -> tuple[QueueRef, ...]:
    """Every stream a worker of a queue of ``shards`` shards reads: the shards, then ``{q}``
    (where a producer that has not learned the shard count writes)."""
    spread = shards_of(q, shards)
    return spread if shards == 1 else (*spread, q)


def retired_shards(q: QueueRef, shards: int, served: int) -> tuple[QueueRef, ...]:
    """The shards once served up to ``served`` and no more: ``{q:shards}`` … ``{q:served-1}``,
    or every ``{q:k}`` below ``served`` when the queue is now unsharded."""
    if served <= shards:
        return ()
    first = 0 if shards == 1 else shards
    return tuple(QueueRef(q.name, q.prefix, k) for k in range(first, min(served, MAX_SHARDS)))


_SHARDED_ID = re.compile(r"^(0|[1-9][0-9]{0,2})\.[0-9A-Za-z_-]+$")


def id_on_shard(shard: int | None, unique: str) -> str:
    """The request id for ``shard``: ``<shard>.<unique>``, or ``unique`` on the plain ``{q}``."""
    return unique if shard is None else f"{shard}.{unique}"


def shard_in_id(request_id: str) -> int | None:
    """The shard a request id names (:func:`id_on_shard` undone), None for a plain id; only a
    queue that has (or had) shard ``k`` reads ``k.<unique>`` as that shard's."""
    match = _SHARDED_ID.match(request_id)
    if match is None:
        return None
    shard = int(match.group(1))
    return shard if shard < MAX_SHARDS else None


def requests(q: QueueRef) -> str:
    """The stream producers append requests to."""
    return f"{q.tag}:requests"


def check_tenant(tenant: object) -> str:
    """``tenant`` if it is a tenant name (1-64 letters, digits, '_', '.', '-'), else ValueError."""
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
        shown = repr(tenant) if len(repr(tenant)) <= 80 else repr(tenant)[:77] + "..."
        raise ValueError(f"tenant {shown} is invalid: use 1-64 characters from letters, "
                         "digits, '_', '.', '-'")
    return tenant


def tenant_requests(q: QueueRef, tenant: str) -> str:
    """The request stream of ``tenant`` (checked by :func:`check_tenant`) in the queue's slot."""
    base = requests(q)
    return base if tenant == DEFAULT_TENANT else f"{base}:{tenant}"


def tenant_of(q: QueueRef, stream: object) -> str | None:
    """The tenant whose stream :func:`tenant_requests` named ``stream``; None: not one."""
    text = stream.decode(errors="replace") if isinstance(stream, bytes) else stream
    head = requests(q) + ":"
    if not isinstance(text, str) or not text.startswith(head):
        return None
    tenant = text[len(head):]
    return tenant if _TENANT.fullmatch(tenant) and tenant != DEFAULT_TENANT else None


def tenants(q: QueueRef) -> str:
    """The set of tenant streams written to, which workers read (enqueue.lua adds to it)."""
    return f"{q.tag}:tenants"


def tenants_added(q: QueueRef) -> str:
    """Where enqueue.lua tells workers a stream joined :func:`tenants` (one entry each)."""
    return f"{tenants(q)}:added"


def weights(q: QueueRef) -> str:
    """The operator's hash of tenant weights (field ``*``: tenants not named)."""
    return f"{q.tag}:weights"


def requests_pattern(prefix: str = DEFAULT_PREFIX) -> str:
    """A SCAN pattern matching the request stream of every queue (and shard) under ``prefix``."""
    return f"{prefix}:{{*}}:requests"


def queue_of(key: str, prefix: str = DEFAULT_PREFIX) -> QueueRef | None:
    """The queue (shard) whose request stream ``key`` is, or None: :func:`requests` undone."""
    # Names hold no ':', so what follows one is the shard.
    match = re.fullmatch(rf"{re.escape(prefix)}:\{{([^:]*)(?::([0-9]+))?\}}:requests", key)
    if match is None:
        return None
    try:
        return QueueRef(match[1], prefix, None if match[2] is None else int(match[2]))
    except ValueError:
        return None


def pending(q: QueueRef) -> str:
    """The queue's pending tokens (field :data:`PENDING_TOTAL`); its scripts name it from the
    stream's key, ``:pending`` for ``:requests`` (``shared/lua`` ``pending_tokens.lua``)."""
    return f"{q.tag}:pending"


PENDING_TOTAL = "tokens"
"""The field of :func:`pending` holding the sum over every tenant's stream."""
_PENDING_OF = PENDING_TOTAL + ":"


def pending_field(tenant: str) -> str:
    """The field of :func:`pending` holding ``tenant``'s pending tokens: ``tokens:<tenant>``,
    absent at 0; the default tenant has none (:func:`tenant_pending`)."""
    return PENDING_TOTAL if tenant == DEFAULT_TENANT else _PENDING_OF + tenant


_COUNT = re.compile(r"-?[0-9]{1,19}")


def pending_count(value: object) -> int | None:
    """A field of :func:`pending` as the count Redis keeps there (HINCRBY's 64-bit integer), or
    None when it holds none (absent, or written by hand): readers skip it, as the scripts do."""
    text = as_text(value)
    return int(text) if _COUNT.fullmatch(text) else None


def tenant_pending(fields: Mapping[Any, Any]) -> dict[str, int]:
    """Each tenant's pending tokens from :func:`pending`'s fields (HGETALL): a named tenant's
    its own field; the default tenant's the sum less all the others, at least 0 (its stream's
    entries have no field of their own, so enqueue pays no second write for them). A field
    that names no tenant, or holds no count (:func:`pending_count`), is skipped."""
    held: dict[str, int] = {}
    total = 0
    for raw_name, raw_value in fields.items():
        name, value = as_text(raw_name), pending_count(raw_value)
        if value is None:
            continue
        tenant = name[len(_PENDING_OF):]
        if name == PENDING_TOTAL:
            total = value
        elif (name.startswith(_PENDING_OF) and _TENANT.fullmatch(tenant)
              and tenant != DEFAULT_TENANT):
            held[tenant] = max(0, value)
    return {DEFAULT_TENANT: max(0, total - sum(held.values())), **held}


MAX_QUOTA = 10**15 - 1
"""The largest quota ``enqueue.lua`` reads (15 digits): far past any queue's tokens."""


def quotas(q: QueueRef) -> str:
    """The operator's hash of tenant quotas: tenant -> the most pending tokens enqueue lets it
    hold (field ``*``: tenants not named; absent: no cap). ``enqueue.lua`` names it from the
    stream's key, ``:quotas`` for ``:requests``."""
    return f"{q.tag}:quotas"


def dead(q: QueueRef) -> str:
    """The dead-letter stream."""
    return f"{q.tag}:dead"


def config(q: QueueRef) -> str:
    """The hash where workers publish the model's limits and the queue policy."""
    return f"{q.tag}:config"


def workers(q: QueueRef) -> str:
    """The hash of worker heartbeats (consumer name -> msgpack stats)."""
    return f"{q.tag}:workers"


def retired(q: QueueRef) -> str:
    """A retired shard's marker: present, the shard takes no new requests (enqueue.lua)."""
    return f"{q.tag}:retired"


def shards_served(q: QueueRef) -> str:
    """The highest shard count the queue served while shards beyond today's still drain."""
    return f"{q.tag}:shards_served"


def worker_alive(q: QueueRef, consumer: str) -> str:
    """A per-worker key with a TTL: present means the worker is alive."""
    return f"{q.tag}:worker:{consumer}"


def reply(q: QueueRef, reply_id: str) -> str:
    """The list one request's reply (or a client's multiplexed replies) lands on."""
    return f"{q.tag}:reply:{reply_id}"


def reply_prefix(q: QueueRef) -> str:
    """The queue's reply namespace: every key a worker pushes a reply to starts with it."""
    return f"{q.tag}:reply:"


def shard_of_reply_key(q: QueueRef, shards: int, key: str) -> int | None:
    """The shard of queue ``q`` whose reply namespace ``key`` is in, or None (any other key)."""
    for lane in shards_of(q, shards):
        if lane.shard is not None and key.startswith(reply_prefix(lane)):
            return lane.shard
    return None


def reply_to_refusal(
    q: QueueRef, reply_to: str, extra_prefixes: tuple[str, ...] = ()
) -> str | None:
    """Why a worker must not push a reply onto ``reply_to`` (None: it may): only the queue's
    reply namespace, or ``extra_prefixes``, and never another tokenq key (docs/PROTOCOL.md)."""
    return reply_to_check(q, extra_prefixes)(reply_to)


def reply_to_check(
    q: QueueRef, extra_prefixes: tuple[str, ...] = ()
) -> Callable[[str], str | None]:
    """:func:`reply_to_refusal` for one queue, made once: it runs once per request, and
    answers the queue's own reply keys with one ``startswith``."""
    own = reply_prefix(q)
    shortest = len(own) + 1

    def refusal(reply_to: str) -> str | None:
        if len(reply_to) >= shortest and reply_to.startswith(own):
            return None
        if reply_to.startswith(own):
            return "it names no reply id after the prefix"
        if _is_tokenq_key(q.prefix, reply_to):
            return f"it is one of tokenq's own keys, not a reply key (replies go under {own!r})"
        if any(reply_to.startswith(prefix) for prefix in extra_prefixes if prefix):
            return None
        return f"it is outside the queue's reply namespace {own!r}"

    return refusal


def _is_tokenq_key(prefix: str, key: str) -> bool:
    """Whether ``key`` is a tokenq key under ``prefix`` other than a reply key."""
    match = re.match(rf"{re.escape(prefix)}:\{{[^}}]*\}}:(?P<kind>[^:]*)", key)
    return match is not None and match.group("kind") != "reply"


def seen(q: QueueRef, request_id: str) -> str:
    """Marks a request id as enqueued, so a retried enqueue does not add it twice."""
    return f"{q.tag}:seen:{request_id}"


def seen_call(q: QueueRef, request_ids: Iterable[str]) -> str:
    """Marks one enqueue call as written, so its retry adds nothing; named by a digest of the
    call's request ids in order."""
    digest = hashlib.blake2b("\n".join(request_ids).encode(), digest_size=16).hexdigest()
    return f"{q.tag}:seen:call.{digest}"


def reply_pattern(q: QueueRef) -> str:
    """A SCAN pattern matching every reply key of the queue."""
    return reply_prefix(q) + "*"


def idempotent_answer(q: QueueRef, key_digest: str) -> str:
    """The gateway's record of one ``Idempotency-Key``: what it was used for, then its answer."""
    return f"{q.tag}:idem:{key_digest}"


def idempotent_lease(q: QueueRef, key_digest: str) -> str:
    """Held by the gateway request now computing that key's answer (a retry waits meanwhile)."""
    return idempotent_answer(q, key_digest) + ":lease"


def cache(q: QueueRef) -> tuple[str, str, str]:
    """The result cache's keys: its hash (a request's digest -> when it was written and its
    reply), its index (the digests by the ms each was written: oldest evicted first) and the
    bytes its entries are counted at (kept within its budget)."""
    return f"{q.tag}:cache", f"{q.tag}:cache_index", f"{q.tag}:cache_bytes"


def cache_claim(q: QueueRef, digest: bytes) -> str:
    """Names the worker computing ``digest`` now, so the others wait for its cached answer."""
    return f"{q.tag}:cache_claim:{digest.hex()}"
