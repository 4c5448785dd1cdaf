"""The read-ahead room, in tokens and bytes (:class:`Intake`): entries in the packer, reads being
tokenized and answers awaiting publish all count. Pure: what the packer holds is passed in."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
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


TOKEN_BYTES = 40
"""What one token of a buffered encoding holds: the Hugging Face backend's ids are a
tuple of Python ints (an 8-byte pointer and a 28-byte int each; the sim holds less)."""


def entry_bytes(fields: Mapping[bytes, bytes]) -> int:
    """What an entry costs the worker to hold: the raw size of its fields."""
    return sum(map(len, fields)) + sum(map(len, fields.values()))


class Intake:
    """The read-ahead room, the bytes held (entries read, not yet answered) and reserved for
    reads, and the running mean of tokens per entry that sizes reads."""

    def __init__(
        self, *, read_ahead_budgets: float, read_ahead_bytes: int, max_entry_bytes: int,
        max_input_tokens: int,
    ) -> None:
        self.read_ahead_budgets = read_ahead_budgets
        self.limit = read_ahead_bytes
        """The byte bound on read-ahead: held < ``limit`` + one largest entry (``max_entry``)."""
        self.max_entry = max_entry_bytes
        self._held: dict[int, dict[bytes, int]] = {}
        """What each entry held counts for, by lane, then by entry id: its raw size
        (:meth:`hold`), then its answer's once it is answered (:meth:`emitted`)."""
        self._charged = 0
        """The sum of ``_held``'s sizes, kept as they change (``used`` runs before each read)."""
        self.reserved = 0
        """Bytes reserved for reads asked for and not yet held."""
        self.avg_estimate = float(max(1, max_input_tokens))
        """Estimated tokens per request, turning the token room into a read's count: at first the
        longest input the model takes (a first read cannot overshoot), then a 0.1 EMA (learn)."""
        self.inflight_estimate = 0
        """The producers' token estimates of the reads being tokenized now."""
        self.unpublished_answers = 0
        """Answers emitted and not yet published: they hold read-ahead room, in tokens too."""
        self.answer_bytes = 0
        """The bytes of the answers emitted and not yet published (their packed replies)."""

    def used(self) -> int:
        """The bytes held and reserved."""
        return self._charged + self.reserved

    def held_by_lane(self) -> dict[int, list[bytes]]:
        """The entry ids the worker holds (read, not yet answered on Redis), by lane (lanes
        holding none left out)."""
        return {lane: list(sizes) for lane, sizes in self._held.items() if sizes}

    def size_of(self, lane: int, entry_id: bytes) -> int | None:
        """What one held entry counts for (None: not held)."""
        return self._held.get(lane, {}).get(entry_id)

    def room(self, max_batch_tokens: int, buffered_tokens: int) -> float:
        """Estimated tokens the worker may still read ahead."""
        limit = self.read_ahead_budgets * max_batch_tokens
        waiting = self.unpublished_answers * self.avg_estimate
        return limit - buffered_tokens - self.inflight_estimate - waiting

    def read_count(
        self, max_batch_tokens: int, buffered_tokens: int, *, readers: int, cap: int,
        own: int = 0,
    ) -> int:
        """How many entries the next read may take (0: no room now); every lane reads at once,
        so each takes its share of both rooms. ``own``: entries the lane may read past the token
        room (its tenant's own room), still within the byte room."""
        tokens = self.room(max_batch_tokens, buffered_tokens)
        room = self.limit - self.used() - buffered_tokens * TOKEN_BYTES
        if (tokens <= 0 and own <= 0) or room <= 0:
            return 0
        by_bytes = max(1, min(cap, room // self.max_entry // max(1, readers)))
        share = max(1, tokens // self.avg_estimate // readers) if tokens > 0 else 0
        return int(min(by_bytes, max(share, own)))

    def forget(self, lane: int) -> None:
        """``lane`` is removed, holding nothing: its record goes too."""
        if not self._held.get(lane):
            self._held.pop(lane, None)

    def held_count(self, lane: int) -> int:
        """Entries of ``lane`` held (read, not yet answered on Redis)."""
        return len(self._held.get(lane, ()))

    @contextmanager
    def reserving(self, count: int) -> Iterator[None]:
        """Reserve ``count`` maximum-size entries for the ``with`` block (one read); :meth:`hold`
        what it brought before the block ends."""
        reserved = count * self.max_entry
        self.reserved += reserved
        try:
            yield
        finally:
            self.reserved -= reserved

    def learn(self, requests: int, exact_tokens: int) -> None:
        """Move the running mean of tokens per entry towards one read's (0.1 EMA per entry)."""
        if requests <= 0:
            return
        weight = 1.0 - 0.9 ** requests
        exact = exact_tokens or requests
        self.avg_estimate += weight * (max(1.0, exact / requests) - self.avg_estimate)

    @contextmanager
    def estimating(self, claimed: int) -> Iterator[None]:
        """Count a read's claimed tokens as in flight while it is tokenized."""
        self.inflight_estimate += claimed
        try:
            yield
        finally:
            self.inflight_estimate -= claimed

    def hold(
        self, lane: int, entries: Iterable[tuple[bytes, Mapping[bytes, bytes] | None]]
    ) -> None:
        """Count a read's entries of ``lane`` as held, in one call, before its reservation ends;
        a deleted entry (no fields) holds nothing, an id held already counts for its new size."""
        present = [(entry_id, fields) for entry_id, fields in entries if fields]
        entry_ids = [entry_id for entry_id, _ in present]
        sizes = [entry_bytes(fields) for _, fields in present]
        held = self._held.setdefault(lane, {})
        before = sum(map(held.get, entry_ids, itertools.repeat(0))) if held else 0
        held.update(zip(entry_ids, sizes, strict=True))
        self._charged += sum(sizes) - before

    def emitted(self, lane: int, entry_ids: Sequence[bytes], sizes: Sequence[int]) -> None:
        """Answers handed to the outbox, their bytes in ``sizes``: from now on each entry held
        counts for its answer (not its request) until published."""
        self.unpublished_answers += len(entry_ids)
        held = self._held.get(lane)
        if not held:
            return
        before = list(map(held.get, entry_ids))
        if None in before:  # rare: filter per answer only then
            kept = [(entry_id, size) for entry_id, size, was
                    in zip(entry_ids, sizes, before, strict=True) if was is not None]
            entry_ids, sizes = [entry_id for entry_id, _ in kept], [size for _, size in kept]
            before = [was for was in before if was is not None]
        held.update(zip(entry_ids, sizes, strict=True))
        charged = sum(sizes)
        self._charged += charged - sum(before)  # type: ignore[arg-type]
        self.answer_bytes += charged

    def published(self, lane: int, entry_ids: Sequence[bytes]) -> None:
        """Answers published (or given up on): their entries (unheld ids skipped) stop holding
        room."""
        self.unpublished_answers -= len(entry_ids)
        held = self._held.get(lane)
        if held:
            released = sum(map(held.pop, entry_ids, itertools.repeat(0)))
            self._charged -= released
            self.answer_bytes -= released

    def answers_fit(self) -> bool:
        """Whether the device may take another batch: the answers awaiting publish fill less
        than the byte room."""
        return self.answer_bytes < self.limit

    def busy(self) -> bool:
        """Whether a read is being tokenized now (the worker is not idle)."""
        return bool(self.inflight_estimate)
