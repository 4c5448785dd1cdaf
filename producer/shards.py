"""Which shard of a sharded queue a producer writes to: the count, and the choice.

A queue of K shards takes requests on ``{q:0}`` … ``{q:K-1}``
(:func:`tokenq.shared.keys.shards_of`). Its workers publish K as ``shards``
in the config hash, which the producer reads anyway; ``settings.shards``
names it for a producer that may not read the hash (an ACL), and one that
disagrees with the workers is refused rather than let write where nobody
reads. Before any worker has published, a producer without the setting
writes to the plain ``{q}``, which the workers of a sharded queue read too.

Each enqueueing call goes to one shard, so a batch stays one script call:
all or nothing, and ``QueueFull`` exact for that shard (the queue as a whole
holds at most K × ``max_queue_length``). Which shard:

* ``round_robin`` — calls take the shards in turn (per client, from a
  random shard, so clients made per request do not all start on shard 0);
* ``shortest`` — the shard whose stream was shortest when the lengths were
  last read (``XLEN`` of each, at most once per :data:`LENGTHS_TTL_S`),
  counting what this client added since, so a burst between reads spreads
  instead of landing on one shard.

A call whose request ids the caller chose (an ``Idempotency-Key`` at the
gateway) goes to the shard its first id hashes to (:func:`shard_for`), not
to the chooser's: its retry names the same ids, lands on the same shard and
is deduplicated there.

When the workers' K shrinks, the shards beyond it are retired (they drain;
:mod:`tokenq.shared.keys`): the enqueue script refuses a retired shard with
``RETIRED`` and writes nothing, and the call reads the config again and
chooses among the shards it now names (:func:`tokenq.producer.calls.on_current_shard`),
so a producer holding the old K for up to ``config_ttl_s`` loses nothing and
sees no error.

Sans-I/O: the calls read the lengths and hand them over with the time.
"""

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
"""First word of enqueue.lua's refusal on a retired shard (its header says why)."""


class ShardRetired(ConfigError):
    """The shard a call chose is retired: nothing was written.

    The calls catch it and choose again once the config names fewer shards;
    it reaches a caller only when the count it goes by still includes the
    retired shard (a ``shards`` setting the workers left, a config it may not read).
    """

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


LENGTHS_TTL_S = 1.0
"""How long the shortest-shard choice trusts one reading of the shards' lengths."""


def shard_count(wanted: int | None, config: QueueConfig | None, queue: str) -> int:
    """The queue's shard count: the workers' when published, else the setting, else 1.

    A setting that contradicts a published count is a :class:`ConfigError`:
    writing to shards no worker reads would strand every request.
    """
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
    """The shard of ``shards`` a call of caller-chosen ids goes to: the same for every retry."""
    return int.from_bytes(hashlib.blake2b(unique.encode(), digest_size=8).digest(), "big") % shards


class ShardChooser:
    """One client's choice of shard per enqueueing call (thread-safe)."""

    def __init__(self, choice: str) -> None:
        self.choice = choice
        # From a random place, so short-lived clients (one per web request) do
        # not all start on shard 0.
        self._turn = itertools.count(random.randrange(MAX_SHARDS))
        self._lock = threading.Lock()
        self._lengths: list[int] = []
        self._read_at: float | None = None

    def lengths_due(self, shards: int, now_s: float) -> bool:
        """Whether the next choice should read the shards' lengths first (``shortest`` only)."""
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
        """The shard the next enqueueing call goes to."""
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
