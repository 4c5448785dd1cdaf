"""``tokenq embed FILE --output OUT``: a file of texts through the queue, in input order;
resumable, an interruption saving every row that is back (:func:`pump`); then a summary."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import groupby, islice
from types import FrameType
from typing import Any, NamedTuple, NoReturn, TypeVar

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
from tokenq.producer.ops import snapshot
from tokenq.producer.ops.embed_io import (
    AlreadyComplete,
    Checkpoint,
    Item,
    ResumeMismatch,
    Row,
    WriteFailed,
    input_format,
    output_format,
    read_items,
    request_id,
)
from tokenq.shared import keys
from tokenq.shared.cli import run_command
from tokenq.shared.failures import CommandFailed
from tokenq.shared.flags import UsageError
from tokenq.shared.interrupts import unwrapped
from tokenq.shared.keys import QueueRef
from tokenq.shared.queue_config import model_identity, parse_config
from tokenq.shared.settings import EmbedSettings
from tokenq.shared.text import one_line, percent, plural

T = TypeVar("T")

_HEARTBEAT_WAIT_S = 3.0
_BLANK_SHOWN = 5  # how many skipped blank lines the summary names
_QUEUE_FULL_PAUSE_S = 0.5
THREAD_PREFIX = "tokenq-embed"  # the threads that wait for the groups' replies
SIGNAL_CHECK_S = 0.25
"""The longest the main thread waits without running Python: a signal another thread took
runs its handler only then (tests/ops/test_signals_any_thread.py)."""

Held = Callable[[], contextlib.AbstractContextManager[None]]  # an interruption waits for it


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(EmbedSettings, list(argv or []), "tokenq embed", embed)


def embed(settings: EmbedSettings) -> int:
    if output_format(settings.output) == "npy":
        try:
            import numpy  # noqa: F401
        except ImportError:
            raise UsageError(".npy output needs numpy: pip install 'tokenq[cli]', or write "
                             ".jsonl instead") from None
    if settings.output.is_dir():
        raise UsageError(f"--output {settings.output} is a directory; name a .npy or .jsonl "
                         "file")
    if settings.file != "-":
        try:
            open(settings.file, "rb").close()
        except OSError:
            raise UsageError(f"cannot read {settings.file}") from None
    q = QueueRef(settings.queue, settings.prefix)
    with snapshot.connection(settings.redis_url, settings.socket_timeout_s, [q]) as ops:
        return _embed(settings, ops, q)


class _Signals:
    """SIGINT and SIGTERM as one ``KeyboardInterrupt``, raised after a :meth:`held` block
    rather than inside it; later ones are ignored while the run saves and leaves."""

    def __init__(self) -> None:
        self._holding = 0
        self._pending = False
        self.stopping = False
        self._previous = {sig: signal.signal(sig, self._on_signal)
                          for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            return
        if self._holding:
            self._pending = True
            return
        self.stopping = True
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
        if not self._holding and self._pending and not self.stopping:
            self.stopping = True
            raise KeyboardInterrupt


def _embed(settings: EmbedSettings, ops: redis.Redis, q: QueueRef) -> int:
    before: dict[str, dict[str, float]] | None = None  # the workers' counters (ACL: unknown)
    try:  # first: a Redis failure is told before anything is written
        before = snapshot.heartbeat_counters(ops, q)
    except redis.exceptions.NoPermissionError:
        print(f"tokenq embed: this Redis user may not read {keys.workers(q)} (ACL); the "
              "summary leaves out what the workers did", file=sys.stderr)
    if before == {}:
        print(f"tokenq embed: no worker has a heartbeat on queue {settings.queue!r} yet; "
              "requests wait until one starts", file=sys.stderr)
    fmt = input_format(settings.file, settings.input_format)
    manifest = {
        "version": 1, **Checkpoint.describe_input(settings.file), "format": fmt,
        "field": settings.field if fmt == "jsonl" else None, "chunk_size": settings.chunk_size,
        "blank": settings.blank, "queue": settings.queue, "prefix": settings.prefix,
    }
    checkpoint = Checkpoint(settings.output, manifest)
    resume = f"progress is saved in {checkpoint.directory}: run the same command again to resume"
    signals = _Signals()  # from here a Ctrl-C is answered with the resume hint
    try:
        with unwrapped(lambda: signals.stopping), Client(settings=settings) as client:
            try:
                manifest["model"] = model_identity(parse_config(client.config()))
            except redis.exceptions.NoPermissionError:
                manifest["model"] = None  # unknown: the checkpoint keeps what it knows
            with signals.held():
                try:
                    checkpoint.open(restart=settings.restart)
                except AlreadyComplete as exc:
                    print(f"tokenq embed: {exc}"
                          + (f"; {plural(exc.failed, 'input')} failed" if exc.failed else ""),
                          file=sys.stderr)
                    return 1 if exc.failed else 0
            if checkpoint.done or checkpoint.saved:
                rows = sum(len(rows) for rows in checkpoint.saved.values())
                print(f"tokenq embed: resuming: {plural(len(checkpoint.done), 'chunk')} of "
                      f"{settings.chunk_size} and {plural(rows, 'more input')} already done in "
                      f"{checkpoint.directory}", file=sys.stderr)
            return _run(settings, checkpoint, client, ops, q, before, signals)
    except ResumeMismatch as exc:
        print(f"tokenq embed: {exc}", file=sys.stderr)
        return _exit(2)
    except WriteFailed as exc:
        hint = "" if checkpoint.complete else f"; {resume} once it can be written"
        print(f"tokenq embed: {exc}{hint}", file=sys.stderr)
        return _exit(1)
    except (BrokerUnavailable, redis.RedisError) as exc:
        if isinstance(exc, BrokerUnavailable):
            message = one_line(str(exc))
        else:
            message = str(snapshot.explain(exc, ops, [q], settings.redis_url,
                                           settings.socket_timeout_s))
        print(f"tokenq embed: {message}; {resume}", file=sys.stderr)
        return _exit(1)
    except StoppedEarly as exc:
        if not checkpoint.done and not checkpoint.saved:  # both read before it could stop
            checkpoint.discard()  # nothing of value: the corrected command starts afresh
        print(f"tokenq embed: {exc}", file=sys.stderr)
        return _exit(1)
    except KeyboardInterrupt:
        if checkpoint.complete:
            print(f"\ntokenq embed: interrupted after writing {settings.output} (the summary "
                  "is left out)", file=sys.stderr)
        else:
            print(f"\ntokenq embed: interrupted; {resume}", file=sys.stderr)
        _leave(130)
    finally:
        checkpoint.close()
        signals.restore()


def _exit(code: int) -> int:
    """``code``, or :func:`_leave` with it while groups' threads are still out."""
    if any(thread.name.startswith(THREAD_PREFIX) and thread.is_alive()
           for thread in threading.enumerate()):
        _leave(code)
    return code


def _leave(code: int) -> NoReturn:
    """Exit now, not waiting for the groups' threads (in a read until ``--timeout-s``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(settings: EmbedSettings, checkpoint: Checkpoint, client: Client, ops: redis.Redis,
         q: QueueRef, before: dict[str, dict[str, float]] | None, signals: _Signals) -> int:
    """The loop, the output, the summary."""
    tally = Tally()
    progress = progress_bar(_count_lines(settings.file), settings.progress)
    started = time.monotonic()
    try:
        pump(settings, client, checkpoint, tally, progress, signals.held)
    finally:
        progress.close()
    elapsed = max(time.monotonic() - started, 1e-9)
    with signals.held():
        if checkpoint.format == "npy" and checkpoint.dim is None:
            checkpoint.set_dim(_queue_dim(client, settings))
        failed = checkpoint.assemble(tally.blank)
    workers = None
    if before is not None:
        try:
            workers = snapshot.counter_delta(before, _settled_counters(ops, q))
        except redis.RedisError as exc:  # the output is written: only the summary loses a line
            print(f"tokenq embed: could not read the workers' heartbeats after the run: "
                  f"{one_line(str(exc))}", file=sys.stderr)
    _summary(settings, tally, elapsed, workers, failed)
    return 1 if failed else 0


def _count_lines(path: str) -> int | None:
    if path == "-":
        return None
    with open(path, "rb") as stream:
        return sum(1 for _ in stream)


class Progress(NamedTuple):
    """A bar counting inputs done, on stderr (stdout stays free for pipes)."""

    advance: Callable[[int], object]
    close: Callable[[], object]


def progress_bar(total: int | None, enabled: bool) -> Progress:
    """A bar over ``total`` inputs (None: unknown, as for stdin): rich if installed, else
    tqdm, else (or with ``--no-progress``) none."""
    none = Progress(lambda n: None, lambda: None)
    if not enabled:
        return none
    try:
        import rich.console
        import rich.progress as rp
    except ImportError:
        try:
            from tqdm import tqdm
        except ImportError:
            return none
        bar = tqdm(total=total, unit="input", desc="embed", file=sys.stderr)
        return Progress(bar.update, bar.close)
    rich_bar = rp.Progress(rp.TextColumn("embed"), rp.BarColumn(), rp.MofNCompleteColumn(),
                           rp.TimeElapsedColumn(), rp.TimeRemainingColumn(), transient=False,
                           console=rich.console.Console(stderr=True))
    task = rich_bar.add_task("embed", total=total)
    rich_bar.start()
    return Progress(lambda n: rich_bar.advance(task, n), rich_bar.stop)


def _queue_dim(client: Client, settings: EmbedSettings) -> int:
    """The queue config's ``dim``, for an .npy output no input gave a vector for."""
    config = parse_config(client.config())
    if config is None or config.dim is None:
        why = ("has no config hash (no worker has started on it yet)" if config is None
               else "says no dim in its config hash")
        raise CommandFailed(
            f"cannot write {settings.output}: no input gave a vector to take its width from, "
            f"and queue {settings.queue!r} {why}; start a worker and run the same command "
            "again, or write .jsonl")
    return config.dim


def _settled_counters(ops: redis.Redis, q: QueueRef) -> dict[str, dict[str, float]]:
    """Heartbeat counters once every live worker has beaten again since the run ended (each
    ``at`` compared with the same worker's; gives up after a few seconds)."""
    deadline = time.monotonic() + _HEARTBEAT_WAIT_S
    after = snapshot.heartbeat_counters(ops, q)
    alive = snapshot.live_names(ops, q, after)
    waiting = {name: c["at"] for name, c in after.items() if name in alive}
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)
        after = snapshot.heartbeat_counters(ops, q)
        waiting = {name: at for name, at in waiting.items()
                   if name in after and after[name]["at"] <= at}
    return after


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


def _summary(settings: EmbedSettings, tally: Tally, elapsed: float,
             workers: Mapping[str, Any] | None, failed_rows: int) -> None:
    """What the run did; throughput counts only the inputs that succeeded."""
    done = tally.ok + sum(tally.failures.values())
    lines = [
        f"tokenq embed: wrote {settings.output} "
        f"({plural(done, 'input')} this run, {tally.skipped} from an earlier run)",
        f"  {elapsed:.2f}s  {tally.ok / elapsed:.1f} requests/s  "
        f"{tally.tokens / elapsed:.0f} tokens/s  ({plural(tally.ok, 'input')} embedded)",
    ]
    if tally.blank:
        shown = ", ".join(str(index + 1) for index in tally.blank[:_BLANK_SHOWN])
        more = "" if len(tally.blank) <= _BLANK_SHOWN else ", ..."
        where = (f"; their indexes are in {settings.output}.skipped.txt"
                 if settings.output.suffix == ".npy" else "; rows keep their input index")
        lines.append(f"  skipped {plural(len(tally.blank), 'blank input')} (no row; lines "
                     f"{shown}{more}){where}")
    if workers is not None:
        lines.append(
            f"  workers (heartbeat deltas): {plural(round(workers['batches']), 'batch')}, "
            f"{plural(round(workers['tokens']), 'token')}, padding efficiency "
            f"{percent(workers['padding_efficiency'])}, device {workers['device_ms'] / 1000:.2f}s")
    if tally.failures or failed_rows:
        codes = ", ".join(f"{code} {n}" for code, n in tally.failures.most_common())
        where = (f"{settings.output}.errors.jsonl" if settings.output.suffix == ".npy"
                 else "the output's error rows")
        lines.append(f"  FAILED: {plural(failed_rows, 'input')} in total "
                     f"({codes or 'earlier run'}); see {where}")
        if tally.failures:
            code = tally.failures.most_common(1)[0][0]
            example = tally.example[code]
            lines.append(f"  e.g. line {example.index + 1}: {code}: {example.error_message}")
    print("\n".join(lines), file=sys.stderr)


class StoppedEarly(CommandFailed):
    """Most of the first chunk failed the same way: the rest would too (exit 1)."""


def pump(settings: EmbedSettings, client: Client, checkpoint: Checkpoint, tally: Tally,
         progress: Progress, held: Held) -> None:
    """Send every input not done yet (by the opened ``checkpoint``); write each chunk once
    complete. On an exception other than :class:`StoppedEarly` (Ctrl-C, Redis gone) the
    rows back are saved first."""
    threads = max(1, settings.max_in_flight // settings.batch_size)
    outstanding: dict[Future[list[Row]], int] = {}
    token = checkpoint.token
    written_as: dict[int, str] = {}  # each input's id as enqueued: a shard's names the shard

    def forget(indexes: list[int]) -> None:
        client.forget([written_as.pop(index, request_id(token, index)) for index in indexes])

    chunks = _Chunks(checkpoint, settings.chunk_size, forget)
    fmt = input_format(settings.file, settings.input_format)
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
                new = [] if number in checkpoint.done else chunks.sent(number, group)
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
    """The futures that finished with a result (asking a cancelled one its exception raises)."""
    return [f for f in futures if f.done() and not f.cancelled() and f.exception() is None]


class _Chunks:
    """Rows gathered per chunk, by input index; a chunk is written once the input has
    moved past it and every one of its rows is back."""

    def __init__(self, checkpoint: Checkpoint, chunk_size: int,
                 forget: Callable[[list[int]], None]) -> None:
        self.checkpoint = checkpoint
        self.forget = forget  # delete the kept replies of inputs whose rows are on disk
        self.chunk_size = chunk_size
        saved = checkpoint.saved
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
                self.checkpoint.write_partial(number, _in_order(rows))

    def _maybe_finish(self, number: int) -> None:
        passed = self.current is None or number < self.current
        if not passed or len(self.rows[number]) < self.expected[number]:
            return
        if number == self.first and self.current is not None:
            self._judge(number, only_known=False)
        rows = _in_order(self.rows[number])
        self.checkpoint.write_chunk(number, rows)
        self.forget([row.index for row in rows])
        del self.rows[number], self.expected[number]

    def _judge(self, number: int, *, only_known: bool) -> None:
        """Stop the run when more than half of chunk ``number``'s inputs failed the same way
        (the error code; for ``bad_input`` the problem's kind, without its details)."""
        if self.judged:
            return
        kinds: Counter[tuple[str, str]] = Counter()
        first: dict[tuple[str, str], Row] = {}
        for row in _in_order(self.rows[number]):
            if row.error_code is not None:
                problem = (row.error_message or "").split(":", 1)[0]
                kind = (row.error_code, problem if row.error_code == "bad_input" else "")
                kinds[kind] += 1
                first.setdefault(kind, row)
        size = self.expected[number]
        for kind, failed in kinds.most_common(1):
            if failed * 2 > size:
                example, start = first[kind], number * self.chunk_size + 1
                hint = " (see --format and --field)" if example.error_code == "bad_input" else ""
                raise StoppedEarly(
                    f"stopped early: {failed} of the {plural(size, 'input')} on lines {start}-"
                    f"{start + size - 1} failed the same way, e.g. line {example.index + 1}: "
                    f"{example.error_code}: {example.error_message}{hint}; the rest would most "
                    "likely fail too, so the run stops here")
        self.judged = not only_known


def _in_order(rows: dict[int, Row]) -> list[Row]:
    return [rows[index] for index in sorted(rows)]


def _groups(items: Iterator[Item], chunk_size: int,
            batch_size: int) -> Iterator[tuple[int, list[Item]]]:
    """(chunk number, group) in input order; a group never spans two chunks."""
    for number, chunk in groupby(items, lambda item: item.index // chunk_size):
        while group := list(islice(chunk, batch_size)):
            yield number, group


def _infer_group(client: Client, items: list[Item], token: str, settings: EmbedSettings,
                 written_as: dict[int, str]) -> list[Row]:
    """One enqueue for the group (each with ``--timeout-s`` as its deadline), waiting out
    QueueFull and isolating inputs the client refuses; a row per input, an exception only
    for Redis being down. ``written_as`` learns each id as enqueued (a shard's names it)."""
    ids = [request_id(token, item.index) for item in items]
    pause = _QUEUE_FULL_PAUSE_S
    while True:
        try:
            ids = client.submit_many([item.text or "" for item in items], unique=ids,
                                     deadline_s=settings.timeout_s)
            break
        except QueueFull:
            time.sleep(pause)  # other producers filled it: wait for the workers
            pause = min(pause * 2, 5.0)
        except BadRequest as exc:
            if len(items) == 1:
                return [_row(items[0], exc)]
            return [row for item in items
                    for row in _infer_group(client, [item], token, settings, written_as)]
    written_as.update(zip((item.index for item in items), ids, strict=True))
    outcomes = client.results(ids, settings.timeout_s, return_exceptions=True, keep=True)
    return [_row(item, outcome) for item, outcome in zip(items, outcomes, strict=True)]


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
