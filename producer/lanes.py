"""Request ids and the streams a producer writes to: one :class:`Lane` per shard (an id on shard
``k`` reads ``k.<32 hex digits>``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from tokenq.producer.shards import shard_count
from tokenq.shared import keys, wire
from tokenq.shared.errors import BadRequest, DecodeError
from tokenq.shared.queue_config import QueueConfig

_VERSION = bytes(byte & 0x0F | 0x40 for byte in range(256))  # uuid4's version nibble (byte 6)
_VARIANT = bytes(byte & 0x3F | 0x80 for byte in range(256))  # and variant bits (byte 8)
_IDS_PER_DRAW = 256  # 4 KiB of os.urandom


class _IdSource:
    """Fresh uuid4 hex ids, drawn from the OS in blocks. Thread-safe (each id leaves by one atomic
    ``list.pop``); a forked child drops the block it inherited, which its parent hands out."""

    def __init__(self) -> None:
        self._block: list[str] = []
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._block = []

    def next(self) -> str:
        try:
            return self._block.pop()
        except IndexError:
            block = self._block = _draw(_IDS_PER_DRAW)
            return block.pop()


def _draw(n: int) -> list[str]:
    """``n`` ids, ``uuid.uuid4().hex`` digit for digit, without the UUID objects."""
    raw = bytearray(os.urandom(16 * n))
    raw[6::16] = raw[6::16].translate(_VERSION)  # every id's bytes at once: no int per id
    raw[8::16] = raw[8::16].translate(_VARIANT)
    digits = raw.hex()
    return [digits[at:at + 32] for at in range(0, 32 * n, 32)]


uuid4_hex = _IdSource().next
"""A fresh id: 32 hex digits of uuid4."""


def check_ids(request_ids: Sequence[str]) -> None:
    """BadRequest unless ``request_ids`` is a sequence of ids the protocol allows."""
    if isinstance(request_ids, str):
        raise BadRequest("request_ids must be a sequence of ids, not a single string",
                         param="request_ids")
    for request_id in request_ids:
        try:
            wire.validate_id(request_id, "request id")
        except DecodeError as exc:
            raise BadRequest(f"{exc}: {request_id!r}", param="request_ids") from None


@dataclass(frozen=True, slots=True)
class Lane:
    """One stream a client writes to: a shard, or the plain queue ``{q}`` (``shard`` None)."""

    shard: int | None
    queue: keys.QueueRef
    stream_key: str
    workers_key: str

    def new_id(self) -> str:
        """A fresh request (or batch, or client) id on this shard."""
        return keys.id_on_shard(self.shard, uuid4_hex())

    def reply_key(self, reply_id: str) -> str:
        """The list a request's reply (or a batch's, or a client's) lands on."""
        return keys.reply(self.queue, reply_id)


class Lanes:
    """A client's lanes, made once each, and which lane an id's reply is on; the shard count is
    the config's (``config()``: the hash last read) or ``wanted`` (``settings.shards``)."""

    def __init__(
        self, queue: keys.QueueRef, wanted: int | None,
        config: Callable[[], QueueConfig | None],
    ) -> None:
        self._queue = queue
        self._wanted = wanted
        self._config = config
        self._made: dict[int | None, Lane] = {}
        self.home = self.lane(None)
        """The plain ``{q}``: where an unsharded queue's requests go."""

    def count(self) -> int:
        """The queue's shard count as this client knows it."""
        return shard_count(self._wanted, self._config(), self._queue.name)

    def lane(self, shard: int | None) -> Lane:
        """The lane of ``shard`` (None: the plain ``{q}``)."""
        made = self._made.get(shard)
        if made is None:
            on = keys.QueueRef(self._queue.name, self._queue.prefix, shard)
            lane = Lane(shard, on, keys.requests(on), keys.workers(on))
            made = self._made.setdefault(shard, lane)
        return made

    def every(self) -> list[Lane]:
        """Every stream the queue's workers read: the shards, then the plain ``{q}``."""
        count = self.count()
        if count == 1:
            return [self.home]
        return [*(self.lane(k) for k in range(count)), self.home]

    def shards_beyond(self, request_ids: Sequence[str]) -> list[int]:
        """The shards ids name that the queue does not have now: were they retired?"""
        count = self.count()
        named = {keys.shard_in_id(request_id) for request_id in request_ids}
        return sorted(k for k in named if k is not None and (count == 1 or k >= count))

    def reply_keys(
        self, request_ids: Sequence[str], retired: Collection[int] = ()
    ) -> dict[int | None, dict[str, str]]:
        """Reply key -> request id, by the shard each (checked) id's reply is on: ``k.<unique>``
        names shard ``k`` only where the queue has it now or had it (``retired``); elsewhere it is
        a plain id another producer chose (docs/PROTOCOL.md, "K = 1")."""
        by_shard: dict[int | None, dict[str, str]] = {}
        for request_id in request_ids:
            shard = keys.shard_in_id(request_id)
            if shard is not None and shard not in retired:
                count = self.count()
                shard = shard if count > 1 and shard < count else None
            lane = self.lane(shard)
            by_shard.setdefault(lane.shard, {})[lane.reply_key(request_id)] = request_id
        return by_shard
