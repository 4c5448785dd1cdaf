"""Every Redis key tokenq touches is named here, and only here.

Layout for queue ``q`` under the default prefix ``tokenq``::

    tokenq:{q}:requests        stream   producers XADD; consumer group "workers"
    tokenq:{q}:dead            stream   dead letters, with their error
    tokenq:{q}:config          hash     written by workers at start: model, limits, policy
    tokenq:{q}:workers         hash     consumer name -> last heartbeat (msgpack map)
    tokenq:{q}:worker:<name>   string   liveness key with a TTL, refreshed by each heartbeat
    tokenq:{q}:reply:<id>      list     replies (msgpack maps), PEXPIREd by the worker
    tokenq:{q}:seen:<id>       string   request ids enqueued lately (retry dedupe), TTL

The queue name sits in braces, which makes it a Redis Cluster hash tag: every
key of one queue lands in one slot, so a MULTI or a Lua script may touch them
together. A shard of a queue is addressed as ``QueueRef(name, shard=k)`` and
renders as ``{q:k}``; nothing outside this module builds a key by hand, so
adding shards changes no call site.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GROUP = "workers"
"""The consumer group every worker of a queue reads through."""

DEFAULT_PREFIX = "tokenq"

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


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


def requests(q: QueueRef) -> str:
    """The stream producers append requests to."""
    return f"{q.tag}:requests"


def requests_pattern(prefix: str = DEFAULT_PREFIX) -> str:
    """A SCAN pattern matching the request stream of every queue (and shard) under ``prefix``."""
    return f"{prefix}:{{*}}:requests"


def queue_of(key: str, prefix: str = DEFAULT_PREFIX) -> QueueRef | None:
    """The queue (shard) whose request stream ``key`` is, or None: :func:`requests` undone."""
    head, tail = f"{prefix}:{{", "}:requests"
    if not (key.startswith(head) and key.endswith(tail)):
        return None
    inner = key[len(head):-len(tail)]
    name, shard = inner, None
    if ":" in inner:  # names hold no ':', so this is a shard
        name, _, shard_text = inner.rpartition(":")
        if not (shard_text.isascii() and shard_text.isdigit()):
            return None
        shard = int(shard_text)
    try:
        return QueueRef(name, prefix, shard)
    except ValueError:
        return None


def dead(q: QueueRef) -> str:
    """The dead-letter stream."""
    return f"{q.tag}:dead"


def config(q: QueueRef) -> str:
    """The hash where workers publish the model's limits and the queue policy."""
    return f"{q.tag}:config"


def workers(q: QueueRef) -> str:
    """The hash of worker heartbeats (consumer name -> msgpack stats)."""
    return f"{q.tag}:workers"


def worker_alive(q: QueueRef, consumer: str) -> str:
    """A per-worker key with a TTL: present means the worker is alive."""
    return f"{q.tag}:worker:{consumer}"


def reply(q: QueueRef, reply_id: str) -> str:
    """The list one request's reply (or a client's multiplexed replies) lands on."""
    return f"{q.tag}:reply:{reply_id}"


def reply_prefix(q: QueueRef) -> str:
    """The queue's reply namespace: every key a worker pushes a reply to starts with it."""
    return f"{q.tag}:reply:"


def reply_to_refusal(
    q: QueueRef, reply_to: str, extra_prefixes: tuple[str, ...] = ()
) -> str | None:
    """Why a worker must not push a reply onto ``reply_to``; None when it may.

    The protocol rule (docs/PROTOCOL.md): a reply goes only to a key in the
    queue's reply namespace, ``<prefix>:{q}:reply:<something>``, so no
    producer can aim a worker's RPUSH/PEXPIRE at tokenq's own keys (the dead
    stream, the config hash, another request's dedupe key) or at another
    application's data. An operator may widen the rule with
    ``extra_prefixes`` (``--reply-to-prefixes``); even then, a key under
    tokenq's prefix that is not some queue's reply key is refused.
    """
    own = reply_prefix(q)
    if reply_to.startswith(own):
        return None if len(reply_to) > len(own) else "it names no reply id after the prefix"
    if _is_tokenq_key(q.prefix, reply_to):
        return f"it is one of tokenq's own keys, not a reply key (replies go under {own!r})"
    if any(reply_to.startswith(prefix) for prefix in extra_prefixes if prefix):
        return None
    return f"it is outside the queue's reply namespace {own!r}"


def _is_tokenq_key(prefix: str, key: str) -> bool:
    """Whether ``key`` is a tokenq key under ``prefix`` other than a reply key."""
    match = re.match(rf"{re.escape(prefix)}:\{{[^}}]*\}}:(?P<kind>[^:]*)", key)
    return match is not None and match.group("kind") != "reply"


def seen(q: QueueRef, request_id: str) -> str:
    """Marks a request id as enqueued, so a retried enqueue does not add it twice."""
    return f"{q.tag}:seen:{request_id}"


def reply_pattern(q: QueueRef) -> str:
    """A SCAN pattern matching every reply key of the queue."""
    return f"{q.tag}:reply:*"
