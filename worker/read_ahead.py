"""The byte bound on read-ahead: how many entries the next read may ask for.

``XREADGROUP COUNT n`` returns up to ``n`` entries whose sizes are unknown
until they arrive, so no running mean of past sizes can bound what one read
brings: after many small entries, a read counted from their mean took 120
entries of 96 KB against a 1 MiB bound. The only count that is safe whatever
arrives is the room divided by the largest entry that can arrive
(``max_entry``: :func:`tokenq.shared.wire.max_entry_bytes`), and a read asks
for at least one entry whenever any room is left (or a queue of entries
larger than the room would never be read).

A read's room is *reserved* (``count × max_entry``) from the moment it is
asked for until its entries are held, so reads running at once on several
lanes (or a reclaim scan) cannot each count the same room. Hence the bound on
the entries held (read, not yet answered), proved by
``tests/worker/test_read_ahead_bound.py`` over sequences of sizes:

    held + reserved  <  limit + max_entry         (so held < limit + max_entry)

A read is asked for only while ``held + reserved < limit``; it reserves
either at most the room, or (the at-least-one rule) one ``max_entry``; the
entries it brings are each at most ``max_entry``, so holding them in place
of the reservation never adds. Entries larger than ``max_entry`` can only be
written by a raw ``XADD`` (the producer refuses them): each exceeds the bound
by its own excess, once, until it is dead-lettered.

Entries are not all the worker holds for them: once answered, an entry counts
for its packed reply instead (an embedding of 4,096 floats is 16 KB where its
request was 175 B) until the reply is published or dead-lettered
(:meth:`ByteRoom.charge_all`), and its encoding
counts while it is buffered (``Intake``). All of it takes the same room, so a
worker whose replies Redis refuses stops reading once its answers fill it;
and its device stops taking batches then too (``Intake.answers_fit``), so the
entries already read cannot turn into replies beyond it:

    answers held  <  limit + one batch's replies

The price: many tiny entries are read in more, smaller reads (256 MiB of
room over 1 MiB entries allows about 240 a read, whatever their real size).
Each read's round trip, admission and batches cost the worker per read, not
per request, so the room is the lever on CPU per request with a fast model:
60 entries a read cost a null worker a third more than 240, and 240 a fifth
more than 960 (docs/BENCHMARKS.md, "cpu"). Hence the default room is a share of
the memory the worker may use (:func:`auto_limit`), not a constant: a host
with 32 GiB or more reads about 960 at a time, a small pod keeps a small
bound. The count cap and ``read_ahead_budgets`` (tokens) bound reads anyway.
Pure: no I/O, no clock.

What is held is kept per lane, by entry id (two lanes' streams can hand out
the same id), so a read's entries are held and an answer's released in one
C-level call each, not a tuple made and hashed per entry.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

AUTO_SHARE = 32
"""The default room is this fraction (1/32) of the memory the worker may use. Small on
purpose: the bound counts raw entry bytes, and Python's copies of a held entry (the read's
bytes while it is decoded, then its text) take more than that."""
AUTO_MIN = 64 * 1024 * 1024
AUTO_MAX = 1024 * 1024 * 1024
"""The default room's range: at least 64 MiB (60 entries a read at the default 1 MiB
``max_request_bytes``), at most 1 GiB (about 960 a read, near the count cap of 1,024)."""


def auto_limit(memory_bytes: int | None) -> int:
    """The default read-ahead room for a worker that may use ``memory_bytes`` (None: not
    known, the smallest room): a 32nd of it, from 64 MiB to 1 GiB."""
    if memory_bytes is None:
        return AUTO_MIN
    return max(AUTO_MIN, min(AUTO_MAX, memory_bytes // AUTO_SHARE))


class ByteRoom:
    """The bytes a worker holds (entries read, not yet answered) and reserves for reads."""

    def __init__(self, limit: int, max_entry: int) -> None:
        if limit < 1 or max_entry < 1:
            raise ValueError(f"limit and max_entry must be >= 1, got {limit}, {max_entry}")
        self.limit = limit
        self.max_entry = max_entry
        self._held: dict[int, dict[bytes, int]] = {}
        """What each entry held counts for, by lane, then by entry id: its raw size
        (:meth:`hold_all`), then its answer's once it is answered (:meth:`charge_all`)."""
        self._charged = 0
        """The sum of ``_held``'s sizes, kept as they change (``used`` runs before each read)."""
        self.reserved = 0
        """Bytes reserved for reads asked for and not yet held."""

    def used(self) -> int:
        return self._charged + self.reserved

    def held(self) -> dict[int, list[bytes]]:
        """The ids of the entries held, by lane (lanes holding none left out)."""
        return {lane: list(sizes) for lane, sizes in self._held.items() if sizes}

    def size_of(self, lane: int, entry_id: bytes) -> int | None:
        """What one held entry counts for (None: not held)."""
        return self._held.get(lane, {}).get(entry_id)

    def count(self, cap: int, readers: int = 1, also: int = 0) -> int:
        """How many entries the next read may ask for: 0 while there is no room.

        ``readers`` reading at once (a sharded queue's lanes) each ask for their
        share, so a blocking read on an empty lane does not reserve the room
        the others need (the bound holds for any share). ``also``: bytes held
        elsewhere that take room too (the buffered entries' encodings).
        """
        room = self.limit - self.used() - also
        if room <= 0:
            return 0
        return max(1, min(cap, room // self.max_entry // max(1, readers)))

    @contextmanager
    def reserving(self, count: int) -> Iterator[None]:
        """Reserve ``count`` maximum-size entries for the ``with`` block (one read).

        Hold what the read brought (:meth:`hold`) before the block ends, so
        the room is never free in between.
        """
        reserved = count * self.max_entry
        self.reserved += reserved
        try:
            yield
        finally:
            self.reserved -= reserved

    def hold_all(self, lane: int, entry_ids: Sequence[bytes], sizes: Sequence[int]) -> None:
        """Hold a read's entries of ``lane`` (ids and sizes in the same order), in one call
        (an id held already counts for its new size instead)."""
        held = self._held.get(lane)
        if held is None:
            held = self._held[lane] = {}
        before = sum(map(held.get, entry_ids, itertools.repeat(0))) if held else 0
        held.update(zip(entry_ids, sizes, strict=True))
        self._charged += sum(sizes) - before

    def charge_all(self, lane: int, entry_ids: Sequence[bytes], sizes: Sequence[int]) -> int:
        """Make held entries of ``lane`` count for ``sizes`` from now on (their answers':
        what the worker holds for them until published), in a few C-level calls; the bytes
        now charged for them.

        Ids not held are skipped (an entry deleted while pending, answered with
        nothing: holding it would have the heartbeat claim it again).
        """
        held = self._held.get(lane)
        if not held:
            return 0
        before = list(map(held.get, entry_ids))
        if None in before:  # rare: filter per answer only then
            kept = [(entry_id, size) for entry_id, size, was
                    in zip(entry_ids, sizes, before, strict=True) if was is not None]
            entry_ids, sizes = [entry_id for entry_id, _ in kept], [size for _, size in kept]
            before = [was for was in before if was is not None]
        held.update(zip(entry_ids, sizes, strict=True))
        charged = sum(sizes)
        self._charged += charged - sum(before)  # type: ignore[arg-type]
        return charged

    def release_all(self, lane: int, entry_ids: Iterable[bytes]) -> int:
        """Stop holding entries of ``lane`` (ids not held are skipped), in one call; the
        bytes they counted for."""
        held = self._held.get(lane)
        if not held:
            return 0
        released = sum(map(held.pop, entry_ids, itertools.repeat(0)))
        self._charged -= released
        return released
