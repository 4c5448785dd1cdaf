"""``tokenq embed FILE --output OUT``: a file of texts through the queue, in input order.

This module is the command around the loop: it checks the flags, opens the
checkpoint (:mod:`tokenq.producer.ops.embed_io`), runs the inputs through
the queue (:mod:`tokenq.producer.ops.embed_pump`) and prints the summary:
throughput of the inputs that succeeded, and batches and padding efficiency
as the workers' heartbeats counted them over the run.

Stopped for any reason, the same command resumes where it stopped. Ctrl-C
and SIGTERM become one ``KeyboardInterrupt`` (:class:`_Signals`), which is
held back while a checkpoint file is being written, so an interruption never
lands in the middle of one; on its way out the run saves every row that is
back (finished chunks and the finished part of unfinished ones).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import redis

from tokenq.producer import BrokerUnavailable, Client
from tokenq.producer.ops.embed_io import (
    AlreadyComplete,
    Checkpoint,
    ResumeMismatch,
    Row,
    WriteFailed,
    count_lines,
    input_format,
    output_format,
)
from tokenq.producer.ops.embed_pump import THREAD_PREFIX, StoppedEarly, Tally, pump
from tokenq.producer.ops.progress import progress_bar
from tokenq.producer.ops.snapshot import (
    connection,
    counter_delta,
    explain,
    heartbeat_counters,
    live_names,
)
from tokenq.shared import keys
from tokenq.shared.cli import run_command
from tokenq.shared.failures import CommandFailed
from tokenq.shared.interrupts import unwrapped
from tokenq.shared.keys import QueueRef
from tokenq.shared.queue_config import model_identity, parse_config
from tokenq.shared.settings import EmbedSettings
from tokenq.shared.text import one_line, percent, plural

_HEARTBEAT_WAIT_S = 3.0
_BLANK_SHOWN = 5
"""How many skipped blank lines the summary names."""


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(EmbedSettings, list(argv or []), "tokenq embed", embed)


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
            print("tokenq embed: .npy output needs numpy: pip install 'tokenq[cli]', "
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


class _Signals:
    """SIGINT and SIGTERM as one ``KeyboardInterrupt``, never inside a :meth:`held` block.

    Why: the run saves what is back on its way out, and a second Ctrl-C (or
    the first one landing halfway through writing a chunk) must not cut that
    short. A signal that comes inside :meth:`held` is raised when the block
    ends; after the first one, later signals are ignored while the run
    saves and leaves (SIGKILL still ends it at once).
    """

    def __init__(self) -> None:
        self._holding = 0
        self._pending = False
        self.stopping = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        # Also where a shell started us with SIGINT ignored; restored after, for callers
        # in-process.
        self._previous = {sig: signal.signal(sig, self._on_signal)
                          for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

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
        "blank": settings.blank, "queue": settings.queue, "prefix": settings.prefix,
    }
    checkpoint = Checkpoint(settings.output, manifest)
    run = _Run(settings, checkpoint)
    # From the moment the checkpoint exists, a Ctrl-C is this function's to answer (with
    # the resume hint): one landing while it opens is held until it is open.
    signals = _Signals()
    signals.install()
    try:
        # A signal pydantic (or another library) wrapped in its own error is still the
        # interruption, answered below with the resume hint.
        with unwrapped(lambda: signals.stopping), Client(settings=settings) as client:
            manifest["model"] = _model(client)
            with signals.held():
                try:
                    done = checkpoint.open(restart=settings.restart)
                except AlreadyComplete as exc:
                    print(f"tokenq embed: {exc}"
                          + (f"; {plural(exc.failed, 'input')} failed" if exc.failed else ""),
                          file=sys.stderr)
                    return 1 if exc.failed else 0
            saved = checkpoint.partial_rows(done)
            if done or saved:
                rows = sum(len(rows) for rows in saved.values())
                print(f"tokenq embed: resuming: {plural(len(done), 'chunk')} of "
                      f"{settings.chunk_size} and {plural(rows, 'more input')} already done in "
                      f"{checkpoint.directory}", file=sys.stderr)
            return run.run(client, ops, q, before, done, saved, fmt, signals)
    except ResumeMismatch as exc:
        print(f"tokenq embed: {exc}", file=sys.stderr)
        return _exit(2)
    except WriteFailed as exc:
        hint = "" if run.written else f"; {run.resume_hint()} once it can be written"
        print(f"tokenq embed: {exc}{hint}", file=sys.stderr)
        return _exit(1)
    except (BrokerUnavailable, redis.RedisError) as exc:
        if isinstance(exc, BrokerUnavailable):
            message = one_line(str(exc))
        else:
            message = str(explain(exc, ops, [q], settings.redis_url, settings.socket_timeout_s))
        print(f"tokenq embed: {message}; {run.resume_hint()}", file=sys.stderr)
        return _exit(1)
    except StoppedEarly as exc:
        if not done and not saved:  # both set before anything could stop early
            checkpoint.discard()  # nothing of value: the corrected command starts afresh
        print(f"tokenq embed: {exc}", file=sys.stderr)
        return _exit(1)
    except KeyboardInterrupt:
        if run.written:
            print(f"\ntokenq embed: interrupted after writing {settings.output} (the summary "
                  "is left out)", file=sys.stderr)
        else:
            print(f"\ntokenq embed: interrupted; {run.resume_hint()}", file=sys.stderr)
        _leave(130)
    finally:
        checkpoint.close()
        signals.restore()
    return 1  # not reached: _leave does not return


def _exit(code: int) -> int:
    """``code``, or :func:`_leave` with it while threads of groups are still out."""
    if any(thread.name.startswith(THREAD_PREFIX) and thread.is_alive()
           for thread in threading.enumerate()):
        _leave(code)
    return code


def _leave(code: int) -> None:
    """Exit now, without waiting for the threads of groups still out: they may sit in a
    blocking read (or retry a Redis that is gone) until ``--timeout-s``, and the
    interpreter would wait for them. Everything worth keeping is on disk (atomically)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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


class _Run:
    """One run: the loop, the output, the summary."""

    def __init__(self, settings: EmbedSettings, checkpoint: Checkpoint) -> None:
        self.settings = settings
        self.checkpoint = checkpoint
        self.written = False
        """Whether OUT is complete (an interruption after it has nothing to resume)."""

    def resume_hint(self) -> str:
        return (f"progress is saved in {self.checkpoint.directory}: run the same command "
                "again to resume")

    def run(self, client: Client, ops: redis.Redis, q: QueueRef,
            before: dict[str, dict[str, float]] | None, done: set[int],
            saved: dict[int, dict[int, Row]], fmt: str, signals: _Signals) -> int:
        settings = self.settings
        tally = Tally()
        progress = progress_bar(count_lines(settings.file), settings.progress)
        started = time.monotonic()
        try:
            pump(settings, client, self.checkpoint, done, saved, fmt, tally, progress,
                 signals.held)
        finally:
            progress.close()
        elapsed = max(time.monotonic() - started, 1e-9)
        with signals.held():
            if self.checkpoint.format == "npy" and self.checkpoint.dim is None:
                self.checkpoint.set_dim(_queue_dim(client, settings))
            self.checkpoint.write_skipped(tally.blank)
            failed = self.checkpoint.assemble()
            self.written = True
        workers = None
        if before is not None:
            try:
                workers = counter_delta(before, _settled_counters(ops, q))
            except redis.RedisError as exc:  # the output is written: only the summary loses a line
                print(f"tokenq embed: could not read the workers' heartbeats after the run: "
                      f"{one_line(str(exc))}", file=sys.stderr)
        _summary(settings, tally, elapsed, workers, failed)
        return 1 if failed else 0


def _model(client: Client) -> dict[str, str | int | None] | None:
    """The model the queue serves (``queue_config.model_identity``), for the checkpoint;
    None when no worker has published a config yet or this Redis user may not read it."""
    try:
        return model_identity(parse_config(client.config()))
    except redis.exceptions.NoPermissionError:
        return None


def _queue_dim(client: Client, settings: EmbedSettings) -> int:
    """The width of an .npy output no input gave a vector for: the queue config's ``dim``.

    Why: an empty input (or one whose every line failed) is still a
    ``(rows, dim)`` matrix, which a program stacking outputs relies on.
    """
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
             workers: Mapping[str, Any] | None, failed_rows: int) -> None:
    """What the run did. Throughput counts the inputs that succeeded: a file whose every
    line fails is not fast."""
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
