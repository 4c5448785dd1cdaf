"""Tokenizing in child processes, for backends whose tokenizer holds the GIL.

The pipeline tokenizes each read off the event loop, in a thread. A fast
(Rust) tokenizer releases the GIL for its batch call, so the loop keeps
reading and publishing and the device thread keeps feeding the device while
it works. A tokenizer written in Python holds the GIL for the whole call: a
read of long passages then stalls the loop and, worse, the device thread,
whose next batch waits for the interpreter. ``--tokenize-processes N`` moves
that work into N child processes, each holding its own copy of the tokenizer
(built from the backend's :class:`~tokenq.worker.backends.base.TokenizerSource`
factory): a read is cut into up to N contiguous slices tokenized side by
side, and the encodings come back in input order.

Decisions:

* **spawn, not fork**: the worker process holds threads (the device's, redis
  connections) and maybe a CUDA context, neither of which survives a fork.
* **Started and checked at worker start** (:meth:`TokenizerPool.start`): a
  factory that fails in a child fails the start with the reason, not the
  first read.
* **A child that dies** (the OOM killer, a crash in native code) breaks the
  pool; the call is retried once on a fresh pool, so one lost process costs
  one retry, not every request of the read. A second failure is raised.
* **Errors keep their type**: a ``ValueError`` for a bad input comes back as
  a ``ValueError``, so the pipeline's rule (retry input by input, answer
  ``bad_request`` for the one refused) is unchanged.
* **Small reads stay in one slice**: below :data:`MIN_SLICE` inputs per
  child, the cost of shipping inputs across is more than the split saves.
* **Children never outlive the worker**: each child asks, as it starts, to
  be SIGKILLed when the worker exits (``PR_SET_PDEATHSIG`` on Linux, a thread
  polling the parent's pid elsewhere: ``tooling.children.die_with_parent``),
  so a worker SIGKILLed while a child hangs leaves no child behind; and
  :meth:`TokenizerPool.close` kills a child still busy after
  :data:`CLOSE_GRACE_S` instead of waiting for it (a hung tokenizer would hold
  the worker's exit forever). A tokenizing call that never returns is the
  worker's watchdog's (``worker/stages.py``): the worker exits 3.
"""

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


def _ready() -> bool:
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
        if processes < 1:
            raise ConfigError(f"tokenize processes must be at least 1, got {processes}")
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
            # One call per child: the pool starts a process per pending call
            # while it has fewer than ``processes``, so all of them get built.
            checks = [self._executor.submit(_ready) for _ in range(self.processes)]
            for check in checks:
                check.result()
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
        """Stop the children (what they were doing is dropped); safe to call twice.

        A child still busy after :data:`CLOSE_GRACE_S` is killed: the worker
        closes the pool on its way out, and a hung tokenizer must not hold that.
        """
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
        """A fresh pool in place of ``broken``, unless the pool was closed or replaced meanwhile.

        Why compare: a call that finds the pool broken after :meth:`close`
        must not start children nobody will stop, and two calls that broke
        on the same pool must not both replace it.
        """
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
    """Shut ``executor`` down, killing a child that has not finished in :data:`CLOSE_GRACE_S`.

    ``ProcessPoolExecutor.shutdown`` waits for the calls children are running
    and has no time-out (Python 3.14 adds ``kill_workers``); hence the
    children, taken before the shutdown forgets them, are joined and killed here.
    """
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
