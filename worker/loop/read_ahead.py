"""The byte bound on read-ahead: how many entries the next read may ask for."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

AUTO_SHARE = 32
"""The default room is 1/32 of the memory the worker may use: small, since Python's
copies of a held entry take more than its raw bytes."""
AUTO_MIN = 64 * 1024 * 1024
AUTO_MAX = 1024 * 1024 * 1024
"""The default room's range: at least 64 MiB (60 entries a read at the default 1 MiB
``max_request_bytes``), at most 1 GiB (about 960 a read, near the count cap of 1,024)."""


def auto_limit(memory_bytes: int | None) -> int:
    """The default read-ahead room for ``memory_bytes`` (None: unknown): a 32nd, 64 MiB to 1 GiB."""
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
        """How many entries the next read may ask for: 0 while there is no room."""
        room = self.limit - self.used() - also
        if room <= 0:
            return 0
        return max(1, min(cap, room // self.max_entry // max(1, readers)))

    @contextmanager
    def reserving(self, count: int) -> Iterator[None]:
        """Reserve ``count`` maximum-size entries for the ``with`` block (one read); :meth:`hold`
        what it brought before the block ends.
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
        """Make held entries of ``lane`` count for their answers' ``sizes``; the bytes now charged.
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
        """Stop holding entries of ``lane`` (unheld ids skipped); the bytes they counted for."""
        held = self._held.get(lane)
        if not held:
            return 0
        released = sum(map(held.pop, entry_ids, itertools.repeat(0)))
        self._charged -= released
        return released
