"""How much the worker may read ahead: the read-ahead room, in tokens and in bytes.

Everything the worker holds counts against it: entries buffered in the
packer, a read being tokenized (by the producers' estimates, until it is
admitted), answers waiting to be published (each at the running mean of
tokens per entry), and in bytes (:class:`~tokenq.worker.read_ahead.ByteRoom`,
the one bound that holds whatever the sizes) every entry read and not yet
answered on Redis: its raw bytes, its encoding while it is buffered
(:data:`TOKEN_BYTES` a token), then its packed reply until that is
published. The reader asks :meth:`Intake.read_count` before each read; the
outbox gives room back as answers are published.

Pure: no asyncio, no Redis, no clock. What the packer holds (its budget and
buffered tokens) is passed in, so tests drive every rule with plain numbers
(``tests/worker/test_worker_parts.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager

from tokenq.worker.read_ahead import ByteRoom

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

        It starts at the longest input the model takes, so the first read
        cannot overshoot the room however long the requests are (from 64, one
        idle worker took a whole burst while its peers idled); each request
        read then counts as one step of a 0.1 EMA (:meth:`learn`)."""
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
        """How many entries the next read may take (0: no room now).

        Bounded by both rooms. Tokens: from the exact lengths of what was read
        lately (not the producers' claims), about ``read_ahead_budgets``
        budgets, each reader its share. Bytes: a bound, not an estimate
        (``read_ahead.py``): the room left by the entries, answers and buffered
        encodings held, over the largest entry, reserved while the read runs
        (:meth:`reserving`), so the entries held stay below ``read_ahead_bytes``
        plus one largest entry whatever the sizes.
        """
        tokens = self.room(max_batch_tokens, buffered_tokens)
        # Every lane reads at once, so each takes its share of both rooms.
        by_bytes = self.bytes.count(cap, readers=readers, also=buffered_tokens * TOKEN_BYTES)
        if tokens <= 0 or by_bytes == 0:
            return 0
        share = tokens // self.avg_estimate // readers
        return int(min(by_bytes, max(1, share)))

    def learn(self, requests: int, exact_tokens: int) -> None:
        """Move the running mean of tokens per entry towards one read's.

        Exact lengths, not the producers' ``tokens`` claims: a claim is only a
        hint, and a lying one must not make the next read huge. Each entry
        counts as one step of a 0.1 EMA. (Bytes need no mean: ``read_ahead.py``.)
        """
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

    def reserving(self, count: int) -> AbstractContextManager[None]:
        """Reserve the bytes of ``count`` largest entries for one read (``read_ahead.py``)."""
        return self.bytes.reserving(count)

    def hold(
        self, lane: int, entries: Iterable[tuple[bytes, Mapping[bytes, bytes] | None]]
    ) -> None:
        """Count a read's entries as held (before its reservation ends: the room they take
        is never free in between); an entry deleted meanwhile (no fields: None or ``{}``)
        holds nothing."""
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
        """Whether the device may take another batch: the answers waiting to be published
        fill less than the byte room.

        While Redis refuses replies, what stays in the packer keeps its small
        request size instead of becoming replies beyond the room; with no
        answer waiting a batch always goes, whatever its replies weigh (no
        deadlock on an answer larger than the room).
        """
        return self.answer_bytes < self.bytes.limit

    def held_by_lane(self) -> dict[int, list[bytes]]:
        """The entry ids the worker holds (read, not yet answered on Redis), by lane.

        Buffered, on the device, and answered but waiting to be published
        alike: each is pending to this worker until its answer is published.
        """
        return self.bytes.held()

    def busy(self) -> bool:
        """Whether a read is being tokenized now (the worker is not idle)."""
        return bool(self.inflight_estimate)
