"""Files for ``tokenq embed``: reading inputs, checkpointing chunks, assembling the output.

Why checkpoints: a few million lines take hours, and a laptop sleeps, a
network drops, an operator presses Ctrl-C. Inputs are numbered in file order
and cut into chunks of ``chunk_size``; each finished chunk is written
atomically (temp file + rename) into ``OUTPUT.partial/`` beside a
``manifest.json`` that pins what the run was (input, its size and mtime,
format, field, chunk size). A run that stops before a chunk is finished
(Ctrl-C, SIGTERM, Redis gone) saves the rows of that chunk that are back in
``chunk-NNNNNN.part.jsonl``, so even a file smaller than one chunk loses
nothing. Running the same command again skips the chunks already there and
the saved rows, and sends only the rest. When every chunk is in, they are
joined into OUTPUT (streamed, never all in memory) and the directory is
removed.

A failed input does not stop the run: its row is NaN in ``.npy`` output (its
error goes to ``OUTPUT.errors.jsonl``), or carries ``error`` in ``.jsonl``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tokenq.shared.failures import CommandFailed

MANIFEST_VERSION = 1
_LOCK = "lock"
_PART = ".part.jsonl"
"""Suffix of an unfinished chunk's saved rows."""


class ResumeMismatch(Exception):
    """The partial results on disk belong to a different run (input or settings changed)."""


class IncompleteOutput(CommandFailed):
    """Chunks are missing from the partial results when they should all be there (exit 1)."""


@dataclass(frozen=True, slots=True)
class Item:
    """One input: its text, or why it has none (blank line, bad JSON, missing field)."""

    index: int
    text: str | None
    id: Any = None
    problem: str | None = None


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


def _open_input(path: str) -> BinaryIO:
    return sys.stdin.buffer if path == "-" else open(path, "rb")


def read_items(path: str, fmt: str, field: str, id_field: str) -> Iterator[Item]:
    """Every input in file order, numbered from 0; one line is one input."""
    stream = _open_input(path)
    try:
        for index, raw in enumerate(stream):
            yield _item(index, raw, fmt, field, id_field)
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def _item(index: int, raw: bytes, fmt: str, field: str, id_field: str) -> Item:
    try:
        line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        return Item(index, None, problem=f"line is not UTF-8: {exc}")
    if fmt == "text":
        if not line.strip():
            return Item(index, None, problem="blank line")
        return Item(index, line)
    try:
        record = json.loads(line)
    except ValueError as exc:
        return Item(index, None, problem=f"not JSON: {exc}")
    if not isinstance(record, dict):
        return Item(index, None, problem="JSON line is not an object")
    text, item_id = record.get(field), record.get(id_field)
    if not isinstance(text, str) or not text.strip():
        return Item(index, None, item_id, problem=f"no non-empty string field {field!r}")
    return Item(index, text, item_id)


def count_lines(path: str) -> int | None:
    """How many inputs a file holds (None for stdin), for the progress bar."""
    if path == "-":
        return None
    with open(path, "rb") as stream:
        return sum(1 for _ in stream)


def output_format(output: Path) -> str:
    suffix = output.suffix.lower()
    if suffix == ".npy":
        return "npy"
    if suffix in {".jsonl", ".ndjson"}:
        return "jsonl"
    raise ValueError(f"output must end in .npy or .jsonl, got {output.name!r}")


class Checkpoint:
    """``OUTPUT.partial/``: the manifest and one file per finished chunk."""

    def __init__(self, output: Path, manifest: dict[str, Any]) -> None:
        self.output = output
        self.format = output_format(output)
        self.directory = output.with_name(output.name + ".partial")
        self.manifest = manifest
        self._lock_file: BinaryIO | None = None

    @staticmethod
    def describe_input(path: str) -> dict[str, Any]:
        if path == "-":
            return {"input": "-"}
        stat = os.stat(path)
        return {"input": str(Path(path).resolve()), "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns}

    def open(self, *, restart: bool) -> set[int]:
        """Create or reuse the directory; return the chunks already done.

        Holds a lock on the directory until :meth:`assemble` or :meth:`close`,
        so two runs can never write the same output at once.
        """
        manifest_path = self.directory / "manifest.json"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock()
        if restart:
            for stale in self.directory.iterdir():
                if stale.name != _LOCK:
                    stale.unlink()
        if manifest_path.exists():
            try:
                found = json.loads(manifest_path.read_text())
            except (ValueError, UnicodeDecodeError):
                found = None
            if not isinstance(found, dict):
                raise ResumeMismatch(
                    f"{manifest_path} is not a tokenq embed manifest; "
                    "re-run with --restart to discard the partial results"
                )
            stored = {k: v for k, v in found.items() if k != "dim"}
            if stored != self.manifest:
                changed = sorted(k for k in set(stored) | set(self.manifest)
                                 if stored.get(k) != self.manifest.get(k))
                raise ResumeMismatch(
                    f"{self.directory} is from a different run ({', '.join(changed)} changed); "
                    "re-run with --restart to discard it"
                )
            if found.get("dim") is not None:
                self.manifest["dim"] = found["dim"]
        else:
            self._write_manifest()
        return {int(p.name[6:12]) for p in self.directory.glob("chunk-??????.done")}

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, as before
            return
        self._lock_file = (self.directory / _LOCK).open("wb")
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise ResumeMismatch(
                f"another tokenq embed is writing {self.output} right now"
            ) from None

    def close(self) -> None:
        """Release the lock (the directory stays, for a later run to resume)."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    @property
    def dim(self) -> int | None:
        return self.manifest.get("dim")

    def set_dim(self, dim: int) -> None:
        if self.manifest.get("dim") is None:
            self.manifest["dim"] = dim
            self._write_manifest()

    def _write_manifest(self) -> None:
        _atomic_write(self.directory / "manifest.json",
                      json.dumps(self.manifest, indent=2).encode())

    def write_partial(self, number: int, rows: list[Row]) -> None:
        """Save the rows of unfinished chunk ``number`` that are back (replacing any
        saved before), so a resumed run sends only the others."""
        body = "".join(json.dumps(_row_record(row), ensure_ascii=False) + "\n" for row in rows)
        _atomic_write(self._chunk(number, _PART), body.encode())

    def partial_rows(self, done: set[int]) -> dict[int, dict[int, Row]]:
        """The rows saved for unfinished chunks, by chunk and input index.

        A saved row that does not belong to its chunk, or cannot be read, is
        left out (its input is simply sent again); rows saved for a chunk
        that is done are removed.
        """
        chunk_size = int(self.manifest["chunk_size"])
        out: dict[int, dict[int, Row]] = {}
        for path in sorted(self.directory.glob("chunk-??????" + _PART)):
            number = int(path.name[6:12])
            if number in done:
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
        """Remove the directory and everything in it (a run that stopped before saving any)."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def write_chunk(self, number: int, rows: list[Row]) -> None:
        """Store one finished chunk; its ``.done`` marker is written last, then the rows
        saved for it at an interruption are dropped."""
        base = self.directory / f"chunk-{number:06d}"
        errors = [_row_json(row) for row in rows if row.error_code is not None]
        if self.format == "npy":
            _atomic_write(base.with_suffix(".npy"), _npy_bytes(rows, self.dim))
        else:
            body = "".join(json.dumps(_row_json(row), ensure_ascii=False) + "\n" for row in rows)
            _atomic_write(base.with_suffix(".jsonl"), body.encode())
        _atomic_write(base.with_suffix(".errors.jsonl"),
                      "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in errors).encode())
        _atomic_write(base.with_suffix(".done"), str(len(rows)).encode())
        self._chunk(number, _PART).unlink(missing_ok=True)

    def assemble(self) -> int:
        """Join every chunk into OUTPUT (and OUTPUT.errors.jsonl); remove the directory.

        Returns the number of failed rows.
        """
        numbers = sorted(int(p.name[6:12]) for p in self.directory.glob("chunk-??????.done"))
        if numbers != list(range(len(numbers))):
            raise IncompleteOutput(f"{self.directory} is missing chunks; re-run the same "
                                   "command to finish them")
        failed = self._join_errors(numbers)
        if self.format == "npy":
            self._join_npy(numbers)
        else:
            self._join_files(numbers, ".jsonl", self.output)
        self.close()
        shutil.rmtree(self.directory)
        return failed

    def _chunk(self, number: int, suffix: str) -> Path:
        return self.directory / f"chunk-{number:06d}{suffix}"

    def _join_errors(self, numbers: list[int]) -> int:
        errors_path = self.output.with_name(self.output.name + ".errors.jsonl")
        if self.format == "jsonl":  # errors are in the output itself
            return sum(len(self._chunk(n, ".errors.jsonl").read_bytes().splitlines())
                       for n in numbers)
        failed = self._join_files(numbers, ".errors.jsonl", errors_path)
        if not failed:
            errors_path.unlink(missing_ok=True)
        return failed

    def _join_files(self, numbers: list[int], suffix: str, target: Path) -> int:
        temp = target.with_name(target.name + ".tmp")
        lines = 0
        with temp.open("wb") as out:
            for n in numbers:
                body = self._chunk(n, suffix).read_bytes()
                lines += len(body.splitlines())
                out.write(body)
        os.replace(temp, target)
        return lines

    def _join_npy(self, numbers: list[int]) -> None:
        import numpy as np

        parts = [np.load(self._chunk(n, ".npy"), mmap_mode="r") for n in numbers]
        dim = self.dim or 0
        rows = sum(part.shape[0] for part in parts)
        temp = self.output.with_name(self.output.name + ".tmp.npy")
        matrix = np.lib.format.open_memmap(temp, mode="w+", dtype="<f4", shape=(rows, dim))
        at = 0
        for part in parts:
            n = part.shape[0]
            # A chunk whose every input failed before the width was known is (n, 0).
            matrix[at:at + n] = part if part.shape[1] == dim else np.nan
            at += n
        matrix.flush()
        del matrix
        os.replace(temp, self.output)


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


def _row_record(row: Row) -> dict[str, Any]:
    """Every field of a row, for a ``.part.jsonl`` file (read back by :func:`_row_from_record`)."""
    return {"index": row.index, "id": row.id, "vector": row.vector, "kind": row.kind,
            "tokens": row.tokens, "error_code": row.error_code,
            "error_message": row.error_message}


def _row_from_record(line: bytes) -> Row | None:
    """A saved row, or None for a line that is not one."""
    try:
        record = json.loads(line)
        row = Row(int(record["index"]), record.get("id"), record.get("vector"),
                  str(record.get("kind") or "embedding"), record.get("tokens"),
                  record.get("error_code"), record.get("error_message"))
    except (ValueError, TypeError, KeyError):
        return None
    if (row.vector is None) == (row.error_code is None):  # exactly one of them
        return None
    return row


def _atomic_write(path: Path, data: bytes) -> None:
    temp = path.with_name(path.name + ".tmp")
    with temp.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temp, path)
