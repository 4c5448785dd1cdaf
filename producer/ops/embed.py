"""``tokenq embed FILE --output OUT``: a file of texts through the queue, in input order.

Inputs go out in groups of ``--batch-size`` (one ``Client.infer_many`` each,
one reply key per group) from a small thread pool, so at most
``--max-in-flight`` inputs are enqueued and unanswered at any time: the
queue never floods, other producers keep their share, and the workers' token
budget (not this command) decides how requests are batched on the device.

Groups are collected in submission order, so every chunk of ``--chunk-size``
inputs completes in order and is checkpointed at once (see
:mod:`tokenq.producer.ops.embed_io`). Stopped for any reason, the same command
resumes after the last finished chunk. At the end it prints throughput, and
batches and padding efficiency as the workers' heartbeats counted them over
the run.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

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
from tokenq.producer.ops.embed_io import (
    Checkpoint,
    Item,
    ResumeMismatch,
    Row,
    count_lines,
    input_format,
    output_format,
    read_items,
)
from tokenq.producer.ops.snapshot import (
    connection,
    counter_delta,
    explain,
    heartbeat_counters,
    live_names,
)
from tokenq.shared import keys
from tokenq.shared.cli import one_line, run_command
from tokenq.shared.keys import QueueRef
from tokenq.shared.settings import EmbedSettings

_QUEUE_FULL_PAUSE_S = 0.5
_HEARTBEAT_WAIT_S = 3.0


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(EmbedSettings, list(argv or []), "tokenq embed", embed)


@dataclass
class Tally:
    """What this run did (chunks skipped from an earlier run are not counted)."""

    ok: int = 0
    tokens: int = 0
    skipped: int = 0
    failures: Counter[str] = field(default_factory=Counter)


def embed(settings: EmbedSettings) -> int:
    try:
        out_format = output_format(settings.output)
    except ValueError as exc:
        print(f"tokenq embed: {exc}", file=sys.stderr)
        return 2
    if out_format == "npy":
        try:
            import numpy  # noqa: F401
        except ImportError:
            print("tokenq embed: .npy output needs numpy (pip install numpy), "
                  "or write .jsonl instead", file=sys.stderr)
            return 2
    if settings.output.is_dir():
        print(f"tokenq embed: --output {settings.output} is a directory; name a .npy or "
              ".jsonl file", file=sys.stderr)
        return 2
    fmt = input_format(settings.file, settings.input_format)
    if settings.file != "-" and not _readable(settings.file):
        print(f"tokenq embed: cannot read {settings.file}", file=sys.stderr)
        return 2
    q = QueueRef(settings.queue, settings.prefix)
    # A Redis failure before the run (or outside the client) ends as one line naming the URL.
    with connection(settings.redis_url, settings.socket_timeout_s, [q]) as ops:
        return _embed(settings, ops, q, fmt)


def _embed(settings: EmbedSettings, ops: redis.Redis, q: QueueRef, fmt: str) -> int:
    # Read the heartbeats first: an unreachable Redis or a refused login is
    # reported before anything is written next to the output.
    before = _heartbeats(ops, q)
    if before is not None and not before:
        print(f"tokenq embed: no worker has a heartbeat on queue {settings.queue!r} yet; "
              "requests wait until one starts", file=sys.stderr)
    manifest = {
        "version": 1, **Checkpoint.describe_input(settings.file), "format": fmt,
        "field": settings.field if fmt == "jsonl" else None, "chunk_size": settings.chunk_size,
        "queue": settings.queue, "prefix": settings.prefix,
    }
    checkpoint = Checkpoint(settings.output, manifest)
    try:
        done = checkpoint.open(restart=settings.restart)
    except ResumeMismatch as exc:
        print(f"tokenq embed: {exc}", file=sys.stderr)
        return 2
    if done:
        print(f"tokenq embed: resuming: {len(done)} chunks of {settings.chunk_size} already "
              f"done in {checkpoint.directory}", file=sys.stderr)
    # Ctrl-C and kill both end in the same clean message (even where a shell
    # started us with SIGINT ignored); restored after, for callers in-process.
    previous = {sig: signal.signal(sig, signal.default_int_handler)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Client(settings=settings) as client:
            return _run(settings, client, ops, q, before, checkpoint, done, fmt)
    except (BrokerUnavailable, redis.RedisError) as exc:
        if isinstance(exc, BrokerUnavailable):
            message = one_line(str(exc))
        else:
            message = str(explain(exc, ops, [q], settings.redis_url, settings.socket_timeout_s))
        print(f"tokenq embed: {message}; progress is saved in {checkpoint.directory}: run the "
              "same command again to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ntokenq embed: interrupted; progress is saved in {checkpoint.directory}; "
              "run the same command again to resume", file=sys.stderr)
        # Threads may sit in a BLPOP until their timeout; every finished chunk is
        # already on disk (atomically), so leave without waiting for them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    finally:
        checkpoint.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _heartbeats(ops: redis.Redis, q: QueueRef) -> dict[str, dict[str, float]] | None:
    """The workers' heartbeat counters, or None when this ACL user may not read them.

    A producer's ACL user has no access to the workers' hash (docs/SECURITY.md):
    the run goes on without the workers' part of the summary.
    """
    try:
        return heartbeat_counters(ops, q)
    except redis.exceptions.NoPermissionError:
        print(f"tokenq embed: this Redis user may not read {keys.workers(q)} (ACL); the "
              "summary leaves out what the workers did", file=sys.stderr)
        return None


def _readable(path: str) -> bool:
    try:
        with open(path, "rb"):
            return True
    except OSError:
        return False


def _run(settings: EmbedSettings, client: Client, ops: redis.Redis, q: QueueRef,
         before: dict[str, dict[str, float]] | None, checkpoint: Checkpoint, done: set[int],
         fmt: str) -> int:
    tally = Tally()
    progress = _progress(count_lines(settings.file), settings.progress)
    started = time.monotonic()
    try:
        _pump(settings, client, checkpoint, done, fmt, tally, progress)
    finally:
        progress.close()
    elapsed = max(time.monotonic() - started, 1e-9)
    failed = checkpoint.assemble()
    workers = None
    if before is not None:
        try:
            workers = counter_delta(before, _settled_counters(ops, q))
        except redis.RedisError as exc:  # the output is written: only the summary loses a line
            print(f"tokenq embed: could not read the workers' heartbeats after the run: "
                  f"{one_line(str(exc))}", file=sys.stderr)
    _summary(settings, tally, elapsed, workers, failed)
    return 1 if failed else 0


def _pump(settings: EmbedSettings, client: Client, checkpoint: Checkpoint, done: set[int],
          fmt: str, tally: Tally, progress: Any) -> None:
    """Keep up to max_in_flight inputs out; write each chunk as soon as it is complete."""
    threads = max(1, settings.max_in_flight // settings.batch_size)
    outstanding: deque[tuple[int, int, Future[list[Row]]]] = deque()
    chunks = _Chunks(checkpoint)
    items = read_items(settings.file, fmt, settings.field, settings.id_field)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenq-embed")

    def collect_oldest() -> None:
        number, size, future = outstanding.popleft()
        rows = future.result()
        _count(rows, tally)
        progress.advance(size)
        chunks.received(number, rows)

    try:
        for number, group in _groups(items, settings.chunk_size, settings.batch_size):
            chunks.reached(number)
            if number in done:
                tally.skipped += len(group)
                progress.advance(len(group))
                continue
            chunks.sent(number, len(group))
            while len(outstanding) >= threads:
                collect_oldest()
            future = pool.submit(_infer_group, client, group, settings)
            outstanding.append((number, len(group), future))
        chunks.reached(None)
        while outstanding:
            collect_oldest()
    except BaseException:
        # Ctrl-C or Redis gone: do not wait for groups still out; finished chunks are on disk.
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


class _Chunks:
    """Rows gathered per chunk; a chunk is written once the input has moved past it and
    every one of its rows is back."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.rows: dict[int, list[Row]] = {}
        self.expected: dict[int, int] = {}
        self.current: int | None = None

    def reached(self, number: int | None) -> None:
        """The input is now at chunk ``number`` (None: at its end); earlier ones are closed."""
        if number == self.current:
            return
        self.current = number
        for earlier in sorted(self.rows):
            self._maybe_finish(earlier)

    def sent(self, number: int, n: int) -> None:
        self.expected[number] = self.expected.get(number, 0) + n
        self.rows.setdefault(number, [])

    def received(self, number: int, rows: list[Row]) -> None:
        self.rows[number].extend(rows)
        self._maybe_finish(number)

    def _maybe_finish(self, number: int) -> None:
        if number == self.current or len(self.rows[number]) < self.expected[number]:
            return
        _finish_chunk(self.checkpoint, number, self.rows.pop(number))
        del self.expected[number]


def _finish_chunk(checkpoint: Checkpoint, number: int, rows: list[Row]) -> None:
    if checkpoint.dim is None:
        widths = [len(row.vector) for row in rows if row.vector is not None]
        if widths:
            checkpoint.set_dim(widths[0])
    checkpoint.write_chunk(number, sorted(rows, key=lambda row: row.index))


def _groups(items: Iterator[Item], chunk_size: int,
            batch_size: int) -> Iterator[tuple[int, list[Item]]]:
    """(chunk number, group) in input order; a group never spans two chunks."""
    group: list[Item] = []
    number = 0
    for item in items:
        item_chunk = item.index // chunk_size
        if group and (item_chunk != number or len(group) >= batch_size):
            yield number, group
            group = []
        number = item_chunk
        group.append(item)
    if group:
        yield number, group


def _infer_group(client: Client, items: list[Item], settings: EmbedSettings) -> list[Row]:
    """One enqueue call for the group's valid inputs; per-input rows, never an exception
    for a single bad input (only Redis being down propagates)."""
    rows = {item.index: Row(item.index, item.id, error_code="bad_input",
                            error_message=item.problem)
            for item in items if item.text is None}
    sendable = [item for item in items if item.text is not None]
    if sendable:
        outcomes = _infer_many(client, [item.text or "" for item in sendable], settings)
        for item, outcome in zip(sendable, outcomes, strict=True):
            rows[item.index] = _row(item, outcome)
    return [rows[item.index] for item in items]


def _infer_many(client: Client, texts: list[str], settings: EmbedSettings) -> list[Any]:
    """infer_many, waiting out QueueFull, isolating inputs the client refuses."""
    pause = _QUEUE_FULL_PAUSE_S
    while True:
        try:
            return client.infer_many(texts, timeout_s=settings.timeout_s,
                                     return_exceptions=True)
        except QueueFull:
            time.sleep(pause)  # other producers filled it: wait for the workers
            pause = min(pause * 2, 5.0)
        except BadRequest as exc:
            if len(texts) == 1:
                return [exc]
            return [outcome for text in texts
                    for outcome in _infer_many(client, [text], settings)]


def _row(item: Item, outcome: Any) -> Row:
    if isinstance(outcome, Result):
        if outcome.embedding is not None:
            return Row(item.index, item.id, vector=list(outcome.embedding), tokens=outcome.tokens)
        return Row(item.index, item.id, vector=list(outcome.scores or ()), kind="scores",
                   tokens=outcome.tokens)
    if isinstance(outcome, RemoteError):
        return Row(item.index, item.id, error_code=outcome.code, error_message=str(outcome))
    if isinstance(outcome, ReplyTimeout):
        return Row(item.index, item.id, error_code="timeout", error_message=str(outcome))
    if isinstance(outcome, (BrokerUnavailable, redis.RedisError)):
        raise outcome  # Redis itself failing stops the run (resumable), not one input
    if isinstance(outcome, BadRequest):  # refused before enqueueing (InputTooLong: too_long)
        code = str(getattr(outcome, "code", "bad_request"))
    else:
        code = type(outcome).__name__
    return Row(item.index, item.id, error_code=code, error_message=str(outcome))


def _count(rows: list[Row], tally: Tally) -> None:
    for row in rows:
        if row.error_code is None:
            tally.ok += 1
            tally.tokens += row.tokens or 0
        else:
            tally.failures[row.error_code] += 1


def _settled_counters(ops: redis.Redis, q: QueueRef) -> dict[str, dict[str, float]]:
    """Heartbeat counters once every live worker has beaten again since the run ended.

    Clock-free: a worker's ``at`` (its own clock) is only compared with an
    earlier ``at`` of the same worker, never with this host's clock; rows of
    workers that are gone (no liveness key) are not waited for. Gives up after
    a few seconds (the delta is then a lower bound).
    """
    deadline = time.monotonic() + _HEARTBEAT_WAIT_S
    at_end = heartbeat_counters(ops, q)
    waiting = {name: c["at"] for name, c in at_end.items()
               if name in live_names(ops, q, at_end)}
    after = at_end
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)
        after = heartbeat_counters(ops, q)
        waiting = {name: at for name, at in waiting.items()
                   if name in after and after[name]["at"] <= at}
    return after


def _summary(settings: EmbedSettings, tally: Tally, elapsed: float,
             workers: dict[str, float] | None, failed_rows: int) -> None:
    done = tally.ok + sum(tally.failures.values())
    lines = [
        f"tokenq embed: wrote {settings.output} "
        f"({done} inputs this run, {tally.skipped} from an earlier run)",
        f"  {elapsed:.2f}s  {done / elapsed:.1f} requests/s  {tally.tokens / elapsed:.0f} tokens/s",
    ]
    if workers is not None:
        lines.append(
            f"  workers (heartbeat deltas): {workers['batches']:.0f} batches, "
            f"{workers['tokens']:.0f} tokens, padding efficiency "
            f"{workers['padding_efficiency']:.1%}, device {workers['device_ms'] / 1000:.2f}s")
    if tally.failures or failed_rows:
        codes = ", ".join(f"{code} {n}" for code, n in tally.failures.most_common())
        where = (f"{settings.output}.errors.jsonl" if settings.output.suffix == ".npy"
                 else "the output's error rows")
        lines.append(f"  FAILED: {failed_rows} inputs in total ({codes or 'earlier run'}); "
                     f"see {where}")
    print("\n".join(lines), file=sys.stderr)


# ---------------------------------------------------------------- progress bar


class _NoProgress:
    def advance(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _RichProgress:
    def __init__(self, total: int | None) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(TextColumn("embed"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
        self._task = self._bar.add_task("embed", total=total)
        self._bar.start()

    def advance(self, n: int) -> None:
        self._bar.advance(self._task, n)

    def close(self) -> None:
        self._bar.stop()


class _TqdmProgress:
    def __init__(self, total: int | None) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="input", desc="embed")

    def advance(self, n: int) -> None:
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


def _progress(total: int | None, enabled: bool) -> Any:
    """rich if installed, else tqdm, else nothing (``--no-progress`` turns it off)."""
    if not enabled:
        return _NoProgress()
    for kind in (_RichProgress, _TqdmProgress):
        try:
            return kind(total)
        except ImportError:
            continue
    return _NoProgress()
