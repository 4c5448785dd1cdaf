"""``tokenq embed FILE --output OUT``: a file of texts through the queue, in input order,
resumable: Ctrl-C and SIGTERM are one ``KeyboardInterrupt``, held back while a checkpoint
file is written, after which every row that is back is saved; then a summary."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any, NoReturn

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
from tokenq.shared.flags import UsageError
from tokenq.shared.interrupts import unwrapped
from tokenq.shared.keys import QueueRef
from tokenq.shared.queue_config import model_identity, parse_config
from tokenq.shared.settings import EmbedSettings
from tokenq.shared.text import one_line, percent, plural

_HEARTBEAT_WAIT_S = 3.0
_BLANK_SHOWN = 5  # how many skipped blank lines the summary names


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
    fmt = input_format(settings.file, settings.input_format)
    if settings.file != "-":
        try:
            open(settings.file, "rb").close()
        except OSError:
            raise UsageError(f"cannot read {settings.file}") from None
    q = QueueRef(settings.queue, settings.prefix)
    with connection(settings.redis_url, settings.socket_timeout_s, [q]) as ops:
        return _embed(settings, ops, q, fmt)


class _Signals:
    """SIGINT and SIGTERM as one ``KeyboardInterrupt``, raised after a :meth:`held` block
    rather than inside it; later ones are ignored while the run saves and leaves."""

    def __init__(self) -> None:
        self._holding = 0
        self._pending = False
        self.stopping = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
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
    before = _heartbeats(ops, q)  # first: a Redis failure is told before anything is written
    if before is not None and not before:
        print(f"tokenq embed: no worker has a heartbeat on queue {settings.queue!r} yet; "
              "requests wait until one starts", file=sys.stderr)
    manifest = {
        "version": 1, **Checkpoint.describe_input(settings.file), "format": fmt,
        "field": settings.field if fmt == "jsonl" else None, "chunk_size": settings.chunk_size,
        "blank": settings.blank, "queue": settings.queue, "prefix": settings.prefix,
    }
    checkpoint = Checkpoint(settings.output, manifest)
    resume = f"progress is saved in {checkpoint.directory}: run the same command again to resume"
    signals = _Signals()  # from here a Ctrl-C is answered with the resume hint
    signals.install()
    try:
        with unwrapped(lambda: signals.stopping), Client(settings=settings) as client:
            try:
                manifest["model"] = model_identity(parse_config(client.config()))
            except redis.exceptions.NoPermissionError:
                manifest["model"] = None  # unknown: the checkpoint keeps what it knows
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
            return _run(settings, checkpoint, client, ops, q, before, done, saved, fmt, signals)
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
            message = str(explain(exc, ops, [q], settings.redis_url, settings.socket_timeout_s))
        print(f"tokenq embed: {message}; {resume}", file=sys.stderr)
        return _exit(1)
    except StoppedEarly as exc:
        if not done and not saved:  # both set before anything could stop early
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
    """``code``, or :func:`_leave` with it while threads of groups are still out."""
    if any(thread.name.startswith(THREAD_PREFIX) and thread.is_alive()
           for thread in threading.enumerate()):
        _leave(code)
    return code


def _leave(code: int) -> NoReturn:
    """Exit now, not waiting for the threads of groups still out (in a read until
    ``--timeout-s``); everything worth keeping is on disk."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _heartbeats(ops: redis.Redis, q: QueueRef) -> dict[str, dict[str, float]] | None:
    """The workers' heartbeat counters, or None when this ACL user may not read them."""
    try:
        return heartbeat_counters(ops, q)
    except redis.exceptions.NoPermissionError:
        print(f"tokenq embed: this Redis user may not read {keys.workers(q)} (ACL); the "
              "summary leaves out what the workers did", file=sys.stderr)
        return None


def _run(settings: EmbedSettings, checkpoint: Checkpoint, client: Client, ops: redis.Redis,
         q: QueueRef, before: dict[str, dict[str, float]] | None, done: set[int],
         saved: dict[int, dict[int, Row]], fmt: str, signals: _Signals) -> int:
    """The loop, the output, the summary."""
    tally = Tally()
    progress = progress_bar(count_lines(settings.file), settings.progress)
    started = time.monotonic()
    try:
        pump(settings, client, checkpoint, done, saved, fmt, tally, progress, signals.held)
    finally:
        progress.close()
    elapsed = max(time.monotonic() - started, 1e-9)
    with signals.held():
        if checkpoint.format == "npy" and checkpoint.dim is None:
            checkpoint.set_dim(_queue_dim(client, settings))
        checkpoint.write_skipped(tally.blank)
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


def _queue_dim(client: Client, settings: EmbedSettings) -> int:
    """The queue config's ``dim``, for an .npy output no input gave a vector for (still a
    ``(rows, dim)`` matrix)."""
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
    after = heartbeat_counters(ops, q)
    alive = live_names(ops, q, after)
    waiting = {name: c["at"] for name, c in after.items() if name in alive}
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)
        after = heartbeat_counters(ops, q)
        waiting = {name: at for name, at in waiting.items()
                   if name in after and after[name]["at"] <= at}
    return after


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
