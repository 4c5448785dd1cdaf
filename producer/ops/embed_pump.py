"""``tokenq embed``'s loop: inputs out in groups (at most ``--max-in-flight`` unanswered) with
request ids a resumed run repeats, replies kept until their chunk is on disk, every state
change inside ``held()`` so an interruption lands between two; a chunk is written once done."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from itertools import groupby, islice
from typing import Any, TypeVar

import redis

from tokenq.producer import (
    BadRequest,
    BrokerUnavailable,
    Client,
    QueueFull,
    RemoteError,
    ReplyTimeout,
    Result,
)
from tokenq.producer.ops.embed_io import Checkpoint, Item, Row, read_items, request_id
from tokenq.producer.ops.progress import Progress
from tokenq.shared.failures import CommandFailed
from tokenq.shared.settings import EmbedSettings
from tokenq.shared.text import plural

T = TypeVar("T")

_QUEUE_FULL_PAUSE_S = 0.5

Held = Callable[[], AbstractContextManager[None]]  # an interruption waits for the block


@dataclass
class Tally:
    """What this run did (inputs done by an earlier run are only counted as skipped)."""

    ok: int = 0
    tokens: int = 0
    skipped: int = 0
    blank: list[int] = field(default_factory=list)  # skipped blank inputs, done chunks' too
    failures: Counter[str] = field(default_factory=Counter)
    example: dict[str, Row] = field(default_factory=dict)  # the first failed row of each code

    def count(self, rows: Sequence[Row]) -> None:
        for row in rows:
            if row.error_code is None:
                self.ok += 1
                self.tokens += row.tokens or 0
            else:
                self.failures[row.error_code] += 1
                self.example.setdefault(row.error_code, row)


THREAD_PREFIX = "tokenq-embed"  # the threads that wait for the groups' replies
SIGNAL_CHECK_S = 0.25
"""The longest the main thread waits without running Python: a signal another thread took
runs its handler only then (tests/ops/test_signals_any_thread.py)."""


class StoppedEarly(CommandFailed):
    """Most of the first chunk failed the same way: the rest would too (exit 1)."""


def pump(settings: EmbedSettings, client: Client, checkpoint: Checkpoint, done: set[int],
         saved: dict[int, dict[int, Row]], fmt: str, tally: Tally, progress: Progress,
         held: Held) -> None:
    """Send every input not done yet; write each chunk once complete. On an exception other
    than :class:`StoppedEarly` (Ctrl-C, Redis gone) the rows back are saved first."""
    threads = max(1, settings.max_in_flight // settings.batch_size)
    outstanding: dict[Future[list[Row]], int] = {}
    token = checkpoint.token
    written_as: dict[int, str] = {}  # each input's id as enqueued: a shard's names the shard

    def forget(indexes: list[int]) -> None:
        client.forget([written_as.pop(index, request_id(token, index)) for index in indexes])

    chunks = _Chunks(checkpoint, saved, settings.chunk_size, forget)
    items = read_items(settings.file, fmt, settings.field, settings.id_field)
    pool = ThreadPoolExecutor(threads, thread_name_prefix=THREAD_PREFIX)

    def settle(block: bool) -> None:
        finished = {future for future in outstanding if future.done()}
        while block and outstanding and not finished:
            finished, _ = wait(outstanding, timeout=SIGNAL_CHECK_S, return_when=FIRST_COMPLETED)
        if not finished:
            return
        with held():
            for future in finished:
                number = outstanding.pop(future)
                rows = future.result()  # Redis gone: raised here, the run stops
                tally.count(rows)
                progress.advance(len(rows))
                chunks.received(number, rows)

    try:
        for number, group in _groups(items, settings.chunk_size, settings.batch_size):
            with held():
                chunks.reached(number)
                inputs = len(group)
                if settings.blank == "skip":
                    tally.blank.extend(item.index for item in group if item.blank)
                    group = [item for item in group if not item.blank]
                new = [] if number in done else chunks.sent(number, group)
                tally.skipped += len(group) - len(new)
                bad = [Row(item.index, item.id, error_code="bad_input", error_message=item.problem)
                       for item in new if item.text is None]
                tally.count(bad)
                chunks.received(number, bad)
                sendable = [item for item in new if item.text is not None]
                progress.advance(inputs - len(sendable))  # the sent ones as their rows come
            settle(block=False)
            if sendable:
                while len(outstanding) >= threads:
                    settle(block=True)
                outstanding[pool.submit(_infer_group, client, sendable, token,
                                        settings, written_as)] = number
        with held():
            chunks.reached(None)
        while outstanding:
            settle(block=True)
    except BaseException as exc:
        pool.shutdown(wait=False, cancel_futures=True)
        if not isinstance(exc, StoppedEarly):  # Ctrl-C, SIGTERM, Redis gone: keep what is back
            with held():
                chunks.judged = True  # no verdict now: what is back is saved, whatever it is
                for future in answered(outstanding):
                    chunks.received(outstanding.pop(future), future.result())
                chunks.save()
        raise
    pool.shutdown()


def answered(futures: Iterable[Future[T]]) -> list[Future[T]]:
    """The futures that finished with a result (asking a cancelled one for its exception
    raises)."""
    return [f for f in futures if f.done() and not f.cancelled() and f.exception() is None]


class _Chunks:
    """Rows gathered per chunk, by input index; a chunk is written once the input has
    moved past it and every one of its rows is back."""

    def __init__(self, checkpoint: Checkpoint, saved: dict[int, dict[int, Row]],
                 chunk_size: int, forget: Callable[[list[int]], None]) -> None:
        self.checkpoint = checkpoint
        self.forget = forget  # delete the kept replies of inputs whose rows are on disk
        self.chunk_size = chunk_size
        self.rows: dict[int, dict[int, Row]] = {n: dict(rows) for n, rows in saved.items()}
        self.expected: dict[int, int] = {n: len(rows) for n, rows in saved.items()}
        self.current: int | None = -1  # the input's chunk: -1 before the first, None past
        self.first: int | None = None  # this run's first chunk, the one judged
        self.judged = False

    def reached(self, number: int | None) -> None:
        """The input is now at chunk ``number`` (None: its end); earlier ones are closed, and
        leaving the first with input to come judges the inputs that could not be sent."""
        if number == self.current:
            return
        left, self.current = self.current, number
        if left is not None and left == self.first and number is not None:
            self._judge(left, only_known=True)
        for earlier in sorted(self.rows):
            self._maybe_finish(earlier)

    def sent(self, number: int, group: list[Item]) -> list[Item]:
        """Register ``group`` as part of chunk ``number``; the items whose rows are not saved."""
        if self.first is None:
            self.first = number
        rows = self.rows.setdefault(number, {})
        new = [item for item in group if item.index not in rows]
        self.expected[number] = self.expected.get(number, 0) + len(new)
        return new

    def received(self, number: int, rows: list[Row]) -> None:
        if not rows:
            return
        self.rows[number].update((row.index, row) for row in rows)
        self._maybe_finish(number)

    def save(self) -> None:
        """Write the rows back so far of every unfinished chunk (at an interruption)."""
        for number, rows in sorted(self.rows.items()):
            if rows:
                self.checkpoint.write_partial(number, sorted(rows.values(),
                                                             key=lambda row: row.index))

    def _maybe_finish(self, number: int) -> None:
        passed = self.current is None or number < self.current
        if not passed or len(self.rows[number]) < self.expected[number]:
            return
        if number == self.first and self.current is not None:
            self._judge(number, only_known=False)
        rows = sorted(self.rows[number].values(), key=lambda row: row.index)
        self.checkpoint.write_chunk(number, rows)
        self.forget([row.index for row in rows])
        del self.rows[number], self.expected[number]

    def _judge(self, number: int, *, only_known: bool) -> None:
        if self.judged:
            return
        size = self.expected[number]
        verdict = same_failure(list(self.rows[number].values()), size)
        if verdict is not None:
            failed, example = verdict
            first = number * self.chunk_size + 1
            hint = " (see --format and --field)" if example.error_code == "bad_input" else ""
            raise StoppedEarly(
                f"stopped early: {failed} of the {plural(size, 'input')} on lines {first}-"
                f"{first + size - 1} failed the same way, e.g. line {example.index + 1}: "
                f"{example.error_code}: {example.error_message}{hint}; the rest would most "
                "likely fail too, so the run stops here")
        self.judged = not only_known


def same_failure(rows: Sequence[Row], size: int) -> tuple[int, Row] | None:
    """(how many, the first of them) when more than half of a chunk of ``size`` inputs failed
    the same way (the error code; for ``bad_input`` the problem's kind); else None."""
    kinds: Counter[tuple[str, str]] = Counter()
    first: dict[tuple[str, str], Row] = {}
    for row in sorted(rows, key=lambda row: row.index):
        if row.error_code is None:
            continue
        problem = (row.error_message or "").split(":", 1)[0]  # its kind, without details
        kind = (row.error_code, problem if row.error_code == "bad_input" else "")
        kinds[kind] += 1
        first.setdefault(kind, row)
    if not kinds:
        return None
    kind, failed = kinds.most_common(1)[0]
    return (failed, first[kind]) if failed * 2 > size else None


def _groups(items: Iterator[Item], chunk_size: int,
            batch_size: int) -> Iterator[tuple[int, list[Item]]]:
    """(chunk number, group) in input order; a group never spans two chunks."""
    for number, chunk in groupby(items, lambda item: item.index // chunk_size):
        while group := list(islice(chunk, batch_size)):
            yield number, group


def _infer_group(client: Client, items: list[Item], token: str,
                 settings: EmbedSettings, written_as: dict[int, str]) -> list[Row]:
    """One enqueue for the group (each with ``--timeout-s`` as its deadline); a row per input,
    an exception only for Redis being down."""
    sent = [(request_id(token, item.index), item.text or "") for item in items]
    ids, outcomes = _infer_many(client, sent, settings)
    written_as.update((item.index, written) for item, written in zip(items, ids, strict=True))
    return [_row(item, outcome) for item, outcome in zip(items, outcomes, strict=True)]


def _infer_many(client: Client, sent: list[tuple[str, str]],
                settings: EmbedSettings) -> tuple[list[str], list[Any]]:
    """Enqueue (request id, text) pairs, waiting out QueueFull and isolating inputs the client
    refuses; (the ids as enqueued, ``<shard>.<id>`` when sharded; the kept replies)."""
    ids = [request_id for request_id, _ in sent]
    pause = _QUEUE_FULL_PAUSE_S
    while True:
        try:
            ids = client.submit_many([text for _, text in sent], unique=ids,
                                     deadline_s=settings.timeout_s)
            break
        except QueueFull:
            time.sleep(pause)  # other producers filled it: wait for the workers
            pause = min(pause * 2, 5.0)
        except BadRequest as exc:
            if len(sent) == 1:
                return ids, [exc]
            each = [_infer_many(client, [one], settings) for one in sent]
            return [i for one, _ in each for i in one], [o for _, got in each for o in got]
    return ids, client.results(ids, settings.timeout_s, return_exceptions=True, keep=True)


def _row(item: Item, outcome: Any) -> Row:
    if isinstance(outcome, Result):
        if outcome.embedding is not None:
            return Row(item.index, item.id, vector=list(outcome.embedding), tokens=outcome.tokens)
        return Row(item.index, item.id, vector=list(outcome.scores or ()), kind="scores",
                   tokens=outcome.tokens)
    if isinstance(outcome, (BrokerUnavailable, redis.RedisError)):
        raise outcome  # Redis itself failing stops the run (resumable), not one input
    if isinstance(outcome, RemoteError):
        code = outcome.code
    elif isinstance(outcome, ReplyTimeout):
        code = "timeout"
    elif isinstance(outcome, BadRequest):  # refused before enqueueing (InputTooLong: too_long)
        code = str(getattr(outcome, "code", "bad_request"))
    else:
        code = type(outcome).__name__
    return Row(item.index, item.id, error_code=code, error_message=str(outcome))
