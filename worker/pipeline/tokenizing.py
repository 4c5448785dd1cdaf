"""Tokenizing in child processes (``--tokenize-processes``), for backends whose tokenizer holds
the GIL (docs/decisions/0015-tokenizing-in-child-processes.md)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from tokenq.shared.errors import ConfigError
from tokenq.worker.backends.base import (
    Backend,
    Encoding,
    TextInput,
    Tokenizer,
    tokenizer_source_of,
)

MIN_SLICE = 16
"""Fewest inputs a child is sent at a time (a smaller read uses fewer children)."""
CLOSE_GRACE_S = 2.0
"""How long :meth:`TokenizerPool.close` lets a busy child finish before killing it."""

_tokenizer: Tokenizer | None = None
"""The child process's own tokenizer, built by :func:`_build` when the child starts."""


def _build(factory: Callable[[], Tokenizer], parent: int, use_prctl: bool) -> None:
    """The child's initializer: die with the worker, then build the tokenizer."""
    from tokenq.worker.tooling.children import die_with_parent

    die_with_parent(parent, use_prctl=use_prctl)
    global _tokenizer
    _tokenizer = factory()


def _ready(_: int) -> bool:
    return _tokenizer is not None


def _tokenize(inputs: Sequence[TextInput], max_length: int | None) -> list[Encoding]:
    assert _tokenizer is not None, "the pool's initializer builds the tokenizer first"
    return list(_tokenizer.tokenize(inputs, max_length))


def slices(count: int, processes: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` ranges covering ``count`` inputs, at most one per process."""
    parts = max(1, min(processes, count // MIN_SLICE))
    size, extra = divmod(count, parts)
    bounds, start = [], 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class TokenizerPool:
    """``processes`` children each holding a tokenizer; :meth:`tokenize` as a backend's."""

    def __init__(
        self, factory: Callable[[], Tokenizer], processes: int, *, use_prctl: bool = True
    ) -> None:
        self.factory = factory
        self.processes = processes
        self.use_prctl = use_prctl
        """False: children watch the worker's pid by polling only (the portable way; tests)."""
        self._executor: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start every child and wait until each has built its tokenizer; ConfigError if not."""
        with self._lock:
            self._executor = self._new_executor()
        try:
            list(self._executor.map(_ready, range(self.processes)))  # one call a child: all built
        except BrokenProcessPool as exc:
            self.close()
            raise ConfigError(
                "the backend's tokenizer factory failed in a child process (its traceback "
                f"is above): {exc}"
            ) from None

    def tokenize(self, inputs: Sequence[TextInput], max_length: int | None) -> list[Encoding]:
        """Encodings of ``inputs`` in order, tokenized in the children."""
        if not inputs:
            return []
        executor = self._running()
        try:
            return self._tokenize_on(executor, inputs, max_length)
        except BrokenProcessPool:
            return self._tokenize_on(self._replace(executor), inputs, max_length)

    def close(self) -> None:
        """Stop the children (what they were doing is dropped); safe to call twice. A child
        still busy after :data:`CLOSE_GRACE_S` is killed."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            _stop(executor)

    def pids(self) -> list[int]:
        """The children's process ids (for logs and tests)."""
        executor = self._executor
        return list(executor._processes or {}) if executor is not None else []

    def _running(self) -> ProcessPoolExecutor:
        executor = self._executor
        if executor is None:
            raise RuntimeError("the tokenizer pool is not running (start() it first)")
        return executor

    def _tokenize_on(
        self, executor: ProcessPoolExecutor, inputs: Sequence[TextInput], max_length: int | None
    ) -> list[Encoding]:
        futures = [
            executor.submit(_tokenize, list(inputs[start:stop]), max_length)
            for start, stop in slices(len(inputs), self.processes)
        ]
        return [encoding for future in futures for encoding in future.result()]

    def _replace(self, broken: ProcessPoolExecutor) -> ProcessPoolExecutor:
        """A fresh pool in place of ``broken``, unless the pool was closed or replaced meanwhile
        (no orphan children after :meth:`close`, no double replacement)."""
        with self._lock:
            if self._executor is broken:
                self._executor = self._new_executor()
            current = self._running()
        _stop(broken)
        return current

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.processes, mp_context=multiprocessing.get_context("spawn"),
            initializer=_build, initargs=(self.factory, os.getpid(), self.use_prctl),
        )


def _stop(executor: ProcessPoolExecutor) -> None:
    """Shut ``executor`` down, killing a child not finished in :data:`CLOSE_GRACE_S`
    (``shutdown`` has no time-out before Python 3.14)."""
    children = list((executor._processes or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + CLOSE_GRACE_S
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.kill()
            child.join(5.0)
    executor.shutdown(wait=True)


def pool_for(backend: Backend, processes: int) -> TokenizerPool | None:
    """The pool ``--tokenize-processes`` asks for (None for 0); ConfigError if the backend can't."""
    if processes == 0:
        return None
    source = tokenizer_source_of(backend)
    if source is None:
        raise ConfigError(
            f"--tokenize-processes {processes}: the {backend.info.name} backend offers no "
            "tokenizer factory to run in child processes (a fast tokenizer releases the GIL "
            "and needs none); use 0"
        )
    return TokenizerPool(source.tokenizer_factory(), processes)
