"""``tokenq embed``'s files: inputs read, chunks checkpointed atomically in ``OUTPUT.partial/``
and joined into OUTPUT; a crash at any step leaves a resumable checkpoint or a whole output."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tokenq.shared.failures import CommandFailed
from tokenq.shared.flags import UsageError

_LOCK = "lock"
_MANIFEST = "manifest.json"
_DONE = ".done"
_PART = ".part.jsonl"  # an unfinished chunk's saved rows
_UNCHECKED = ("dim", "model", "requests")  # manifest keys learned, checked alone, or chosen


class ResumeMismatch(Exception):
    """The partial results on disk belong to another run (input, settings or model changed)."""


class AlreadyComplete(Exception):
    """An earlier run wrote OUTPUT and stopped while removing its checkpoint."""

    def __init__(self, output: Path, failed: int) -> None:
        super().__init__(f"{output} is already complete: an earlier run wrote it and stopped "
                         "while removing its checkpoint (now removed)")
        self.failed = failed


class WriteFailed(CommandFailed):
    """A file could not be written (full disk, size limit, read-only): named, no temp left."""


@dataclass(frozen=True, slots=True)
class Item:
    """One input: its text, or why it has none (``blank``: only whitespace)."""

    index: int
    text: str | None
    id: Any = None
    problem: str | None = None
    blank: bool = False


@dataclass(slots=True)
class Row:
    """One output row: a vector (embedding or scores) or an error."""

    index: int
    id: Any
    vector: list[float] | None = None
    kind: str = "embedding"
    tokens: int | None = None
    error_code: str | None = None
    error_message: str | None = None


def input_format(path: str, chosen: str) -> str:
    if chosen != "auto":
        return chosen
    return "jsonl" if path.endswith((".jsonl", ".ndjson")) else "text"


def read_items(path: str, fmt: str, field: str, id_field: str) -> Iterator[Item]:
    """Every input (one a line) in file order, numbered from 0."""
    with (contextlib.nullcontext(sys.stdin.buffer) if path == "-"
          else open(path, "rb")) as stream:
        for index, raw in enumerate(stream):
            yield _item(index, raw, fmt, field, id_field)


def _item(index: int, raw: bytes, fmt: str, field: str, id_field: str) -> Item:
    try:
        line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        return Item(index, None, problem=f"line is not UTF-8: {exc}")
    if not line.strip():
        return Item(index, None, problem="blank line", blank=True)
    if fmt == "text":
        return Item(index, line)
    try:
        record = json.loads(line)
    except ValueError as exc:
        return Item(index, None, problem=f"not JSON: {exc}")
    if not isinstance(record, dict):
        return Item(index, None, problem="JSON line is not an object")
    text, item_id = record.get(field), record.get(id_field)
    if isinstance(text, str) and not text.strip():
        return Item(index, None, item_id, problem=f"blank field {field!r}", blank=True)
    if not isinstance(text, str):
        return Item(index, None, item_id, problem=f"no non-empty string field {field!r}")
    return Item(index, text, item_id)


def request_id(token: str, index: int) -> str:
    """Input ``index``'s request id, the same in every run that resumes it (the enqueue's
    dedupe writes a resent request once; its reply is where the first run left it)."""
    return f"{token}{index:016x}"


def output_format(output: Path) -> str:
    suffix = output.suffix.lower()
    if suffix == ".npy":
        return "npy"
    if suffix in {".jsonl", ".ndjson"}:
        return "jsonl"
    raise UsageError(f"output must end in .npy or .jsonl, got {output.name!r}")


class Checkpoint:
    """``OUTPUT.partial/``: the manifest and one file per finished chunk."""

    def __init__(self, output: Path, manifest: dict[str, Any]) -> None:
        self.output = output
        self.format = output_format(output)
        self.directory = output.with_name(output.name + ".partial")
        self.manifest = manifest
        self.complete = False  # OUTPUT is written: an interruption has nothing to resume
        self._lock_file: BinaryIO | None = None
        self.done: set[int] = set()  # the chunks an earlier run finished (once open)
        self.saved: dict[int, dict[int, Row]] = {}  # rows of unfinished ones, by chunk, index

    @staticmethod
    def describe_input(path: str) -> dict[str, Any]:
        if path == "-":
            return {"input": "-"}
        stat = os.stat(path)
        return {"input": str(Path(path).resolve()), "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns}

    @property
    def removing(self) -> Path:
        """Where the directory goes once OUTPUT is complete, to be removed."""
        return self.output.with_name(self.output.name + ".removing")

    def open(self, *, restart: bool) -> None:
        """Create or reuse the directory, locked until :meth:`assemble` or :meth:`close`;
        read what is :attr:`done` and :attr:`saved` (:class:`AlreadyComplete`: OUTPUT is)."""
        manifest_path = self.directory / _MANIFEST
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock()
        if restart:
            _remove_tree(self.directory, keep=_LOCK)
        if self.removing.exists():
            complete = not restart and not manifest_path.exists() and self._completed_by(
                self.removing)
            _remove_tree(self.removing, complete=True)
            if complete:
                self.discard()
                raise AlreadyComplete(self.output, self._failed_in_output())
        found = _manifest_in(self.directory)
        if manifest_path.exists():
            if found is None:
                raise ResumeMismatch(f"{manifest_path} is not a tokenq embed manifest; re-run "
                                     "with --restart to discard the partial results")
            if changed := self._changed(found):
                raise ResumeMismatch(
                    f"{self.directory} is from a different run ({', '.join(changed)} changed); "
                    "re-run with --restart to discard it")
            self._check_model(found.get("model"))
            if found.get("dim") is not None:
                self.manifest["dim"] = found["dim"]
        self.manifest["requests"] = (found or {}).get("requests") or secrets.token_hex(8)
        if found is None or (self.manifest.get("model"), self.manifest["requests"]) != (
                found.get("model"), found.get("requests")):
            self._write_manifest()  # new, or the first run did not know its model: now pinned
        self.done = set(self._numbers(_DONE))
        self.saved = self._partial_rows()

    def _changed(self, found: dict[str, Any]) -> list[str]:
        """The keys (but :data:`_UNCHECKED`) an earlier run's manifest differs in."""
        return sorted(k for k in found.keys() | self.manifest.keys()
                      if k not in _UNCHECKED and found.get(k) != self.manifest.get(k))

    def _check_model(self, stored: dict[str, Any] | None) -> None:
        """Refuse to resume with another model than the saved rows'; unknown on either side
        keeps the known one (a width change is still refused: :func:`_check_widths`)."""
        current = self.manifest.get("model")
        if stored is None or current is None:
            self.manifest["model"] = current or stored
            return
        if stored != current:
            raise ResumeMismatch(
                f"{self.directory} holds vectors of {model_words(stored)}, but queue "
                f"{self.manifest.get('queue')!r} now serves {model_words(current)}; re-run "
                "with --restart to discard them and embed everything with the new model")

    def _completed_by(self, leftover: Path) -> bool:
        """Whether ``leftover`` (a directory being removed) is this command's finished run."""
        found = _manifest_in(leftover)
        return found is not None and not self._changed(found) and self.output.exists()

    def _failed_in_output(self) -> int:
        if self.format == "npy":
            errors = self.output.with_name(self.output.name + ".errors.jsonl")
            return len(errors.read_bytes().splitlines()) if errors.exists() else 0
        with self.output.open("rb") as rows:
            return sum(1 for line in rows if "error" in json.loads(line))

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return
        self._lock_file = (self.directory / _LOCK).open("wb")
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise ResumeMismatch(
                f"another tokenq embed is writing {self.output} right now") from None

    def close(self) -> None:
        """Release the lock (the directory stays, for a later run to resume)."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    @property
    def token(self) -> str:
        """This run's part of every request id (:func:`request_id`)."""
        return str(self.manifest["requests"])

    @property
    def dim(self) -> int | None:
        return self.manifest.get("dim")

    def set_dim(self, dim: int | None) -> None:
        """Pin the output's width (the first vector seen: a chunk of failures has none)."""
        if self.dim is None and dim is not None:
            self.manifest["dim"] = dim
            self._write_manifest()

    def _learn_dim(self, rows: list[Row]) -> None:
        self.set_dim(next((len(row.vector) for row in rows if row.vector is not None), None))

    def _write_manifest(self) -> None:
        _atomic_write(self.directory / _MANIFEST, json.dumps(self.manifest, indent=2).encode())

    def write_partial(self, number: int, rows: list[Row]) -> None:
        """Save the rows back so far of unfinished chunk ``number``."""
        self._learn_dim(rows)
        _atomic_write(self._chunk(number, _PART), _json_lines(map(asdict, rows)))

    def _partial_rows(self) -> dict[int, dict[int, Row]]:
        """The rows saved for unfinished chunks, by chunk and index (an unreadable or stray
        row is left out, to be sent again)."""
        chunk_size = int(self.manifest["chunk_size"])
        out: dict[int, dict[int, Row]] = {}
        for number in self._numbers(_PART):
            path = self._chunk(number, _PART)
            if number in self.done:
                path.unlink(missing_ok=True)
                continue
            rows = {}
            for line in path.read_bytes().splitlines():
                row = _row_from_record(line)
                if row is not None and row.index // chunk_size == number:
                    rows[row.index] = row
            if rows:
                out[number] = rows
        return out

    def discard(self) -> None:
        """Remove the directory and everything in it."""
        self.close()
        _remove_tree(self.directory)

    def write_chunk(self, number: int, rows: list[Row]) -> None:
        """Store one finished chunk, its ``.done`` marker last, then drop its saved rows."""
        self._learn_dim(rows)
        _check_widths(rows, self.dim, self.manifest.get("queue"))
        if self.format == "npy":
            _atomic_write(self._chunk(number, ".npy"), _npy_bytes(rows, self.dim))
        else:
            _atomic_write(self._chunk(number, ".jsonl"), _json_lines(map(_row_json, rows)))
        _atomic_write(self._chunk(number, ".errors.jsonl"), _json_lines(
            _row_json(row) for row in rows if row.error_code is not None))
        _atomic_write(self._chunk(number, _DONE), str(len(rows)).encode())
        self._chunk(number, _PART).unlink(missing_ok=True)

    def assemble(self, skipped: Sequence[int] = ()) -> int:
        """Join every chunk into OUTPUT (for ``.npy`` also OUTPUT.errors.jsonl and
        OUTPUT.skipped.txt: the ``skipped`` blank inputs' indexes), then remove the directory;
        the number of failed rows."""
        numbers = self._numbers(_DONE)
        if numbers != list(range(len(numbers))):
            raise CommandFailed(f"{self.directory} is missing chunks; re-run the same "
                                "command to finish them")
        if self.format == "npy":
            skipped_path = self.output.with_name(self.output.name + ".skipped.txt")
            if skipped:
                _atomic_write(skipped_path, "".join(f"{index}\n" for index in skipped).encode())
            else:
                skipped_path.unlink(missing_ok=True)
            errors = self.output.with_name(self.output.name + ".errors.jsonl")
            if not (failed := self._join_files(numbers, ".errors.jsonl", errors)):
                errors.unlink(missing_ok=True)
            self._join_npy(numbers)
        else:  # the errors are rows of the output itself
            failed = sum(len(self._chunk(n, ".errors.jsonl").read_bytes().splitlines())
                         for n in numbers)
            self._join_files(numbers, ".jsonl", self.output)
        self.close()
        if self.removing.exists():  # left by a finished run before this one: not ours
            _remove_tree(self.removing, complete=True)
        os.replace(self.directory, self.removing)
        _remove_tree(self.removing, complete=True)
        self.complete = True
        return failed

    def _chunk(self, number: int, suffix: str) -> Path:
        return self.directory / f"chunk-{number:06d}{suffix}"

    def _numbers(self, suffix: str) -> list[int]:
        return sorted(int(p.name[6:12]) for p in self.directory.glob("chunk-??????" + suffix))

    def _join_files(self, numbers: list[int], suffix: str, target: Path) -> int:
        lines = 0
        with _writing(target, target.with_name(target.name + ".tmp")) as out:
            for n in numbers:
                body = self._chunk(n, suffix).read_bytes()
                lines += len(body.splitlines())
                out.write(body)
        return lines

    def _join_npy(self, numbers: list[int]) -> None:
        """Stream the chunks into one ``(rows, dim)`` matrix with plain writes (under a memory
        map a full disk is a silent SIGBUS)."""
        import numpy as np

        parts = [np.load(self._chunk(n, ".npy"), mmap_mode="r") for n in numbers]
        dim = self.dim or 0
        rows = sum(part.shape[0] for part in parts)
        temp = self.output.with_name(self.output.name + ".tmp.npy")
        with _writing(self.output, temp) as out:
            np.lib.format.write_array_header_1_0(
                out, {"descr": "<f4", "fortran_order": False, "shape": (rows, dim)})
            for part in parts:
                # A chunk whose every input failed before the width was known is (n, 0).
                block = part if part.shape[1] == dim else np.full((part.shape[0], dim), np.nan)
                out.write(np.ascontiguousarray(block, dtype="<f4").tobytes())


def _manifest_in(directory: Path) -> dict[str, Any] | None:
    try:
        found = json.loads((directory / _MANIFEST).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return found if isinstance(found, dict) else None


def _npy_bytes(rows: list[Row], dim: int | None) -> bytes:
    import io

    import numpy as np

    width = dim or 0
    matrix = np.full((len(rows), width), np.nan, dtype="<f4")
    for at, row in enumerate(rows):
        if row.vector is not None and width:
            matrix[at] = row.vector
    buffer = io.BytesIO()
    np.save(buffer, matrix)
    return buffer.getvalue()


def _row_json(row: Row) -> dict[str, Any]:
    body: dict[str, Any] = {"index": row.index}
    if row.id is not None:
        body["id"] = row.id
    if row.error_code is not None:
        body["error"] = {"code": row.error_code, "message": row.error_message}
    else:
        body[row.kind] = row.vector
        if row.tokens is not None:
            body["tokens"] = row.tokens
    return body


def _json_lines(records: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def _row_from_record(line: bytes) -> Row | None:
    """A ``.part.jsonl`` line's row (written by ``asdict``), or None for a line that is not one."""
    try:
        row = Row(**json.loads(line))
    except (ValueError, TypeError):
        return None
    if not isinstance(row.index, int) or (row.vector is None) == (row.error_code is None):
        return None  # a row has exactly one of them
    return row


def model_words(identity: dict[str, Any]) -> str:
    """A model identity in words: ``model M (backend, task, dim D)``."""
    details = ", ".join(f"{key} {identity[key]}" if key == "dim" else str(identity[key])
                        for key in ("backend", "task", "dim") if identity.get(key) is not None)
    return f"model {identity.get('model')}" + (f" ({details})" if details else "")


def _check_widths(rows: list[Row], dim: int | None, queue: object) -> None:
    """Refuse a chunk whose vectors are not all ``dim`` wide (another model answered)."""
    widths = {len(row.vector) for row in rows if row.vector is not None}
    if dim is not None and widths - {dim}:
        raise ResumeMismatch(
            f"queue {queue!r} answered vectors of {sorted(widths - {dim})[0]} values where this "
            f"run's earlier ones have {dim}: its model changed; re-run with --restart to "
            "embed everything with the new model")


def _remove_tree(directory: Path, keep: str | None = None, *, complete: bool = False) -> None:
    """Remove a checkpoint directory's files (all but ``keep``), then itself, in an order safe
    to stop after: ``.done`` markers, saved rows, the manifest (last if ``complete``: while
    it is there a rerun knows the run is done), the rest."""
    def rank(path: Path) -> int:
        name = path.name
        if name == _MANIFEST:
            return 4 if complete else 2
        return 0 if name.endswith(_DONE) else 1 if name.endswith(_PART) else 3

    try:
        paths = sorted(directory.iterdir(), key=rank)
    except FileNotFoundError:
        return
    for path in paths:
        if path.name != keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    if keep is None:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(directory)


@contextlib.contextmanager
def _writing(target: Path, temp: Path) -> Iterator[BinaryIO]:
    """``temp`` open for writing, synced and renamed to ``target`` at the end; on failure
    removed (an OSError becomes :class:`WriteFailed`)."""
    try:
        with temp.open("wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(exc, OSError):
            raise WriteFailed(f"cannot write {target}: {exc.strerror or exc}") from exc
        raise


def _atomic_write(path: Path, data: bytes) -> None:
    with _writing(path, path.with_name(path.name + ".tmp")) as out:
        out.write(data)
