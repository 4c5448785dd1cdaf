"""The read-ahead room, in tokens and bytes: entries in the packer, reads being tokenized and
answers awaiting publish all count. Pure: what the packer holds is passed in."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from tokenq.worker.loop.read_ahead import ByteRoom

TOKEN_BYTES = 40
"""What one token of a buffered encoding holds: the Hugging Face backend's ids are a
tuple of Python ints (an 8-byte pointer and a 28-byte int each; the sim holds less)."""


def entry_bytes(fields: Mapping[bytes, bytes]) -> int:
    """What an entry costs the worker to hold: the raw size of its fields."""
    return sum(map(len, fields)) + sum(map(len, fields.values()))


class Intake:
    """The read-ahead room and the running mean of tokens per entry that sizes reads."""

    def __init__(
        self, *, read_ahead_budgets: float, read_ahead_bytes: int, max_entry_bytes: int,
        max_input_tokens: int,
    ) -> None:
        self.read_ahead_budgets = read_ahead_budgets
        self.bytes = ByteRoom(read_ahead_bytes, max_entry_bytes)
        """The byte bound on read-ahead: held < read_ahead_bytes + one largest entry."""
        self.avg_estimate = float(max(1, max_input_tokens))
        """Estimated tokens per request, which turns the token room into a read's count.

        Starts at the longest input the model takes, so a first read cannot overshoot;
        then a 0.1 EMA per request (:meth:`learn`)."""
        self.inflight_estimate = 0
        """The producers' token estimates of the reads being tokenized now."""
        self.unpublished_answers = 0
        """Answers emitted and not yet published: they hold read-ahead room, in tokens too."""
        self.answer_bytes = 0
        """The bytes of the answers emitted and not yet published (their packed replies)."""

    # ------------------------------------------------------------------ tokens

    def room(self, max_batch_tokens: int, buffered_tokens: int) -> float:
        """Estimated tokens the worker may still read ahead."""
        limit = self.read_ahead_budgets * max_batch_tokens
        waiting = self.unpublished_answers * self.avg_estimate
        return limit - buffered_tokens - self.inflight_estimate - waiting

    def read_count(
        self, max_batch_tokens: int, buffered_tokens: int, *, readers: int, cap: int
    ) -> int:
        """How many entries the next read may take (0: no room now)."""
        tokens = self.room(max_batch_tokens, buffered_tokens)
        # Every lane reads at once, so each takes its share of both rooms.
        by_bytes = self.bytes.count(cap, readers=readers, also=buffered_tokens * TOKEN_BYTES)
        if tokens <= 0 or by_bytes == 0:
            return 0
        share = tokens // self.avg_estimate // readers
        return int(min(by_bytes, max(1, share)))

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

    # ------------------------------------------------------------------- bytes

    def hold(
        self, lane: int, entries: Iterable[tuple[bytes, Mapping[bytes, bytes] | None]]
    ) -> None:
        """Count a read's entries as held, before its reservation ends; a deleted entry (no
        fields) holds nothing.
        """
        present = [(entry_id, fields) for entry_id, fields in entries if fields]
        self.bytes.hold_all(lane, [entry_id for entry_id, _ in present],
                            [entry_bytes(fields) for _, fields in present])

    def emitted(self, lane: int, entry_ids: Sequence[bytes], sizes: Sequence[int]) -> None:
        """Answers handed to the outbox, their bytes in ``sizes``: from now on each entry
        counts for its answer (not its request) until published."""
        self.unpublished_answers += len(entry_ids)
        self.answer_bytes += self.bytes.charge_all(lane, entry_ids, sizes)

    def published(self, lane: int, entry_ids: Sequence[bytes]) -> None:
        """Answers published (or given up on): their entries stop holding room."""
        self.answer_bytes -= self.bytes.release_all(lane, entry_ids)
        self.unpublished_answers -= len(entry_ids)

    def answers_fit(self) -> bool:
        """Whether the device may take another batch: the answers awaiting publish fill less
        than the byte room."""
        return self.answer_bytes < self.bytes.limit

    def held_by_lane(self) -> dict[int, list[bytes]]:
        """The entry ids the worker holds (read, not yet answered on Redis), by lane."""
        return self.bytes.held()

    def busy(self) -> bool:
        """Whether a read is being tokenized now (the worker is not idle)."""
        return bool(self.inflight_estimate)
