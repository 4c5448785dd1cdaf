"""Which shard of a sharded queue a producer writes to: the count (the workers' published K, or
``settings.shards``) and each call's choice (``round_robin`` or ``shortest``); no I/O."""

from __future__ import annotations

import hashlib
import itertools
import random
import threading
from collections.abc import Sequence

from tokenq.shared.errors import ConfigError
from tokenq.shared.keys import MAX_SHARDS
from tokenq.shared.queue_config import QueueConfig

RETIRED = "RETIRED"
"""First word of enqueue.lua's refusal on a retired shard."""

LENGTHS_TTL_S = 1.0
"""How long the shortest-shard choice trusts one reading of the shards' lengths."""


class ShardRetired(ConfigError):
    """The shard a call chose is retired: nothing was written. A caller sees it only when its
    count still includes the shard (a ``shards`` setting, a config it may not read)."""

    def __init__(self, queue: str, shard: int) -> None:
        super().__init__(
            f"shard {shard} of queue {queue!r} is retired (its workers serve fewer shards), "
            "but this client still counts it (shards / TOKENQ_SHARDS, or a config hash it "
            "may not read); make them agree; nothing was written"
        )
        self.shard = shard


def is_retired(message: str) -> bool:
    """Whether a script's error ``message`` is the refusal of a retired shard."""
    return message.split(" ", 1)[0] == RETIRED


def shard_count(wanted: int | None, config: QueueConfig | None, queue: str) -> int:
    """The queue's shard count: the workers' when published, else the setting, else 1. A setting
    that contradicts the published count is a ConfigError: writing to shards no worker reads would
    strand every request."""
    if config is None:
        return wanted or 1
    published = config.shards or 1
    if wanted is not None and wanted != published:
        raise ConfigError(
            f"queue {queue!r} is set to {wanted} shards (shards / TOKENQ_SHARDS), but its "
            f"workers serve {published}; make them agree; nothing was written"
        )
    return published


def shard_for(unique: str, shards: int) -> int:
    """The shard a call of caller-chosen ids goes to: the same for every retry of it."""
    return int.from_bytes(hashlib.blake2b(unique.encode(), digest_size=8).digest(), "big") % shards


class ShardChooser:
    """One client's choice of shard per enqueueing call (thread-safe)."""

    def __init__(self, choice: str) -> None:
        self.choice = choice
        # From a random shard, so clients made per web request do not all start on shard 0.
        self._turn = itertools.count(random.randrange(MAX_SHARDS))
        self._lock = threading.Lock()
        self._lengths: list[int] = []
        self._read_at: float | None = None

    def lengths_due(self, shards: int, now_s: float) -> bool:
        """Whether the next choice should read the shards' lengths first (``shortest``)."""
        if self.choice != "shortest":
            return False
        with self._lock:
            stale = self._read_at is None or now_s - self._read_at >= LENGTHS_TTL_S
            return stale or len(self._lengths) != shards

    def take_lengths(self, lengths: Sequence[int], now_s: float) -> None:
        """Adopt a reading of every shard's XLEN, in shard order."""
        with self._lock:
            self._lengths = list(lengths)
            self._read_at = now_s

    def pick(self, shards: int) -> int:
        with self._lock:
            start = next(self._turn) % shards
            if self.choice != "shortest" or len(self._lengths) != shards:
                return start
            # Ties go round robin, so equal shards share a burst evenly.
            order = [(start + i) % shards for i in range(shards)]
            return min(order, key=self._lengths.__getitem__)

    def added(self, shard: int | None, n: int) -> None:
        """``n`` requests were written to ``shard``: count them until the next reading."""
        with self._lock:
            if shard is not None and shard < len(self._lengths):
                self._lengths[shard] += n
