"""Token-budgeted batching inside one asyncio process, with no Redis in between.

For an app that hosts the model in its own process (a FastAPI server with a
GPU, a notebook, a batch job): ``await batcher.submit(text)`` from as many
coroutines as you like, and the batcher packs them with the same
:class:`~tokenq.shared.packer.Packer` the Redis worker uses, runs one batch at
a time on the device, and isolates failures with the same
:func:`~tokenq.worker.pipeline.execute.run_isolated`. So a request gets the same
batching, truncation, error codes and exceptions whether it went through Redis
or not.

Two tasks, as in the worker (and TEI's ``infer.rs``), joined by the packer:

* the *tokenizer* task takes what ``submit`` queued, tokenizes it in a thread
  (in chunks, so tokenizing a large ``submit_many`` does not hold up the first
  batch) and adds it to the packer with its exact length;
* the *device* task asks the packer for a batch whenever the device is idle,
  runs it in a thread, and resolves each caller's future. While the device is
  busy, input accumulates in the packer, so the next batch is full; while it
  is idle, an unsealed batch waits until ``packer.ready_at()`` (its oldest
  request's arrival plus ``linger_ms``) for company.

The batcher does not own the backend: ``aclose`` drains what was submitted but
does not close the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, overload

import numpy as np

from tokenq.shared.errors import BadRequest, ConfigError, ErrorCode, remote_error
from tokenq.shared.packer import AdaptiveBudget, Batch, Budget, CostModel, Packer
from tokenq.shared.wire import DEFAULT_MAX_REQUEST_BYTES, validate_text
from tokenq.worker.backends.base import Backend, Encoding, TextInput
from tokenq.worker.pipeline.execute import FailedRun, Failure, adapt_budget, describe, run_isolated

log = logging.getLogger(__name__)

TOKENIZE_CHUNK = 512
"""Most inputs per tokenizer call: big enough to amortise the thread hop,
small enough that the first batch of a huge ``submit_many`` starts soon."""


def _now_ms() -> float:
    return time.monotonic() * 1000.0


@dataclass(slots=True, eq=False)
class _Pending:
    """One submitted input on its way through tokenizer, packer and device."""

    text: str
    text_pair: str | None
    arrived_ms: float
    future: asyncio.Future[np.ndarray]
    encoding: Encoding | None = None


@dataclass(slots=True)
class BatcherStats:
    """Running counts, for metrics and tests; read them from the event loop."""

    submitted: int = 0
    batches: int = 0
    rows: int = 0
    tokens: int = 0
    """Real (unpadded) tokens run."""
    cost_tokens: int = 0
    """Tokens paid under the cost model (rows x longest, or the sum)."""
    oom_events: int = 0
    """Runs that hit out-of-memory (each one split a batch or failed one row)."""
    error_events: int = 0
    """Runs that raised anything else."""
    failed: int = 0
    """Requests answered with an error."""
    failed_runs: list[FailedRun] = field(default_factory=list, repr=False)
    """The last few failed runs, newest last (at most 100)."""


class Batcher:
    """Packs concurrent ``submit`` calls into token-budgeted batches for one backend."""

    def __init__(
        self,
        backend: Backend,
        *,
        max_batch_tokens: int,
        max_batch_size: int,
        linger_ms: float,
        cost_model: CostModel | str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        """``cost_model`` None (or 'auto') follows ``backend.info.padded``."""
        info = backend.info
        if max_batch_tokens < info.max_input_tokens:
            raise ConfigError(
                f"max_batch_tokens ({max_batch_tokens}) is below the model's max input "
                f"length ({info.max_input_tokens}); one full-length input would not fit a batch"
            )
        if cost_model is None or cost_model == "auto":
            model = CostModel.PADDED if info.padded else CostModel.RAGGED
        else:
            try:
                model = CostModel(cost_model)
            except ValueError:
                raise ConfigError(
                    f"cost_model must be 'padded', 'ragged' or 'auto', got {cost_model!r}"
                ) from None
        try:
            budget = Budget(max_batch_tokens, max_batch_size, model)
            self._packer: Packer[_Pending] = Packer(budget, linger_ms)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        # Lowered after an out-of-memory error, raised slowly after clean
        # batches, never below one full-length input (DESIGN.md).
        self._adaptive = AdaptiveBudget(max_batch_tokens, info.max_input_tokens)
        self.backend = backend
        self.max_request_bytes = max_request_bytes
        self.stats = BatcherStats()
        self._incoming: deque[_Pending] = deque()
        self._tokenizing: list[_Pending] = []
        """The chunk the tokenizer thread holds: out of ``_incoming``, not yet in the packer."""
        self._stopped: Failure | None = None
        """Set when a task died; what every later answer becomes."""
        self._in_flight: list[_Pending] = []
        self._abandoned = False
        self._closing = False
        self._wake_tokenizer = asyncio.Event()
        self._wake_device = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def budget(self) -> Budget:
        """The budget now in force (lower than configured for a while after an OOM)."""
        return self._packer.budget

    # ----------------------------------------------------------------- callers

    async def submit(self, text: str, text_pair: str | None = None) -> np.ndarray:
        """The model's output for one input (truncated to the model's max length).

        Raises BadRequest at once for an input tokenq refuses (not a string,
        empty, too large), and a RemoteError with the request's code when the
        backend fails on this input (other requests are not affected).
        """
        self._check(text, text_pair)
        return await self._enqueue(text, text_pair).future

    @overload
    async def submit_many(
        self,
        texts: Sequence[str],
        text_pairs: Sequence[str] | None = None,
        *,
        return_exceptions: Literal[False] = False,
    ) -> list[np.ndarray]: ...

    @overload
    async def submit_many(
        self,
        texts: Sequence[str],
        text_pairs: Sequence[str] | None = None,
        *,
        return_exceptions: Literal[True],
    ) -> list[np.ndarray | BaseException]: ...

    async def submit_many(
        self,
        texts: Sequence[str],
        text_pairs: Sequence[str] | None = None,
        *,
        return_exceptions: bool = False,
    ) -> list[np.ndarray] | list[np.ndarray | BaseException]:
        """Outputs for many inputs, in order; batched together with everyone else's.

        Every input is checked before any is queued, so a BadRequest means
        nothing was submitted. With ``return_exceptions`` a failed input's
        RemoteError takes its place in the list; otherwise the first one is
        raised once all inputs are done.
        """
        if isinstance(texts, str):
            raise BadRequest("submit_many takes a sequence of texts, not one string")
        texts = list(texts)
        pairs: list[str | None] = [None] * len(texts)
        if text_pairs is not None:
            if isinstance(text_pairs, str) or len(text_pairs) != len(texts):
                raise BadRequest("text_pairs must be a sequence as long as texts")
            pairs = list(text_pairs)
        for index, (text, pair) in enumerate(zip(texts, pairs, strict=True)):
            self._check(text, pair, where=f"[{index}]")
        queued = [self._enqueue(text, pair) for text, pair in zip(texts, pairs, strict=True)]
        futures = [pending.future for pending in queued]
        results = await asyncio.gather(*futures, return_exceptions=True)
        if not return_exceptions:
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        return results

    async def aclose(self) -> None:
        """Stop taking input, answer everything already submitted, then return."""
        self._closing = True
        self._wake_tokenizer.set()
        self._wake_device.set()
        if not self._tasks:
            return
        outcomes = await asyncio.gather(*self._tasks, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                log.error("batcher task failed: %s", describe(outcome))

    async def __aenter__(self) -> Batcher:
        self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ---------------------------------------------------------------- queueing

    def _check(self, text: object, text_pair: object, where: str = "") -> None:
        if self._closing:
            raise RuntimeError("Batcher is closed")
        validate_text(text, f"text{where}", self.max_request_bytes)
        if text_pair is not None:
            if not self.backend.info.pairs:
                # The same refusal the Redis worker answers with, raised up front.
                raise BadRequest(
                    f"text_pair{where}: this model ({self.backend.info.model}) takes single "
                    "texts, not (text, text_pair) pairs"
                )
            validate_text(text_pair, f"text_pair{where}", self.max_request_bytes)

    def _enqueue(self, text: str, text_pair: str | None) -> _Pending:
        loop = self._start()
        pending = _Pending(text, text_pair, _now_ms(), loop.create_future())
        pending.future.add_done_callback(self._on_future_done)
        self._incoming.append(pending)
        self.stats.submitted += 1
        self._wake_tokenizer.set()
        return pending

    def _on_future_done(self, future: asyncio.Future[np.ndarray]) -> None:
        # A caller that gave up (cancelled, timed out) leaves its entry behind;
        # the device task drops such entries before costing the next batch.
        if future.cancelled():
            self._abandoned = True

    def _start(self) -> asyncio.AbstractEventLoop:
        """Start the two tasks on the running loop (once)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._tasks = [
                loop.create_task(self._tokenizer_task(), name="tokenq-batcher-tokenize"),
                loop.create_task(self._device_task(), name="tokenq-batcher-device"),
            ]
        elif self._loop is not loop:
            raise RuntimeError("this Batcher is bound to another event loop")
        return loop

    # --------------------------------------------------------------- tokenizer

    async def _tokenizer_task(self) -> None:
        try:
            while True:
                if not self._incoming:
                    if self._closing:
                        return
                    self._wake_tokenizer.clear()
                    await self._wake_tokenizer.wait()
                    continue
                chunk: list[_Pending] = []
                while self._incoming and len(chunk) < TOKENIZE_CHUNK:
                    pending = self._incoming.popleft()
                    if not pending.future.done():
                        chunk.append(pending)
                if not chunk:
                    continue
                self._tokenizing = chunk
                encodings = await asyncio.to_thread(self._tokenize, chunk)
                for pending, encoding in zip(chunk, encodings, strict=True):
                    if isinstance(encoding, Failure) or self._stopped is not None:
                        self._answer(pending, self._stopped or encoding)
                    else:
                        pending.encoding = encoding
                        self._packer.add(encoding.length, pending.arrived_ms, pending)
                self._tokenizing = []
                self._wake_device.set()
        except BaseException as exc:
            self._fail_everything(exc)
            raise

    def _tokenize(self, chunk: list[_Pending]) -> list[Encoding | Failure]:
        """Tokenize a chunk (in a thread); if that raises, one by one to find the culprit."""
        max_length = self.backend.info.max_input_tokens
        inputs = [TextInput(pending.text, pending.text_pair) for pending in chunk]
        try:
            encodings = list(self.backend.tokenize(inputs, max_length))
            if len(encodings) != len(inputs):
                raise RuntimeError(
                    f"tokenize returned {len(encodings)} encodings for {len(inputs)} inputs"
                )
        except Exception as exc:
            if len(inputs) == 1:
                return [_tokenizer_failure(exc)]
            return [self._tokenize_one(item, max_length) for item in inputs]
        return [_checked_encoding(encoding) for encoding in encodings]

    def _tokenize_one(self, item: TextInput, max_length: int) -> Encoding | Failure:
        try:
            (encoding,) = self.backend.tokenize([item], max_length)
        except Exception as exc:
            return _tokenizer_failure(exc)
        return _checked_encoding(encoding)

    # ------------------------------------------------------------------ device

    async def _device_task(self) -> None:
        try:
            while True:
                if self._abandoned:
                    self._abandoned = False
                    self._packer.remove_where(lambda pending: pending.future.done())
                now = _now_ms()
                batch = self._packer.next_batch(now, flush=self._closing)
                if batch is not None:
                    await self._run(batch)
                    continue
                if self._closing and not (self._incoming or self._tokenizing or self._packer):
                    return
                ready = self._packer.ready_at()
                timeout = None if ready is None else max(0.0, (ready - now) / 1000.0)
                self._wake_device.clear()
                await _wait(self._wake_device, timeout)
        except BaseException as exc:
            self._fail_everything(exc)
            raise

    async def _run(self, batch: Batch[_Pending]) -> None:
        pendings = batch.payloads
        encodings = [pending.encoding for pending in pendings]
        events: list[FailedRun] = []
        self._in_flight = pendings
        try:
            results = await asyncio.to_thread(
                run_isolated, self.backend, encodings, on_oom=events.append, on_error=events.append
            )
        finally:
            self._in_flight = []
        stats = self.stats
        stats.batches += 1
        stats.rows += batch.rows
        stats.tokens += batch.tokens
        stats.cost_tokens += batch.cost
        for event in events:
            if event.reason == "oom":
                stats.oom_events += 1
            else:
                stats.error_events += 1
        if events:
            stats.failed_runs = (stats.failed_runs + events)[-100:]
        ooms = [event for event in events if event.reason == "oom"]
        adapt_budget(self._adaptive, self._packer, ooms, "batcher")
        for pending, result in zip(pendings, results, strict=True):
            self._answer(pending, result)

    # ----------------------------------------------------------------- answers

    def _answer(self, pending: _Pending, result: np.ndarray | Failure) -> None:
        if pending.future.done():
            return
        if isinstance(result, Failure):
            self.stats.failed += 1
            pending.future.set_exception(remote_error(result.code, result.message))
        else:
            pending.future.set_result(result)

    def _fail_everything(self, exc: BaseException) -> None:
        """A task died (a bug, or the loop is shutting down): no caller may hang."""
        if not isinstance(exc, asyncio.CancelledError):
            log.error("tokenq batcher stopped: %s", describe(exc), exc_info=exc)
        self._closing = True
        failure = Failure(ErrorCode.INFERENCE_FAILED.value, f"batcher stopped: {describe(exc)}")
        self._stopped = self._stopped or failure
        doomed = [
            *self._incoming,
            *self._tokenizing,
            *self._in_flight,
            *(item.payload for item in self._packer),
        ]
        self._incoming.clear()
        self._tokenizing = []
        self._packer.remove_where(lambda _: True)
        for pending in doomed:
            self._answer(pending, failure)
        # Wake the other task so it notices the shutdown.
        self._wake_tokenizer.set()
        self._wake_device.set()


def _tokenizer_failure(exc: Exception) -> Failure:
    """ValueError is the backend refusing this input (the Backend contract); else a fault."""
    if isinstance(exc, ValueError):
        return Failure(ErrorCode.BAD_REQUEST.value, f"tokenizer refused input: {exc}")
    return Failure(ErrorCode.INFERENCE_FAILED.value, f"tokenizer failed: {describe(exc)}")


def _checked_encoding(encoding: Encoding) -> Encoding | Failure:
    """Refuse an encoding the packer cannot cost (a backend bug, answered per request)."""
    length = getattr(encoding, "length", None)
    if not isinstance(length, int) or length < 1:
        return Failure(
            ErrorCode.INFERENCE_FAILED.value, f"tokenizer returned an encoding of length {length!r}"
        )
    return encoding


async def _wait(event: asyncio.Event, timeout: float | None) -> None:
    """Wait for ``event`` at most ``timeout`` seconds (forever when None)."""
    if timeout is None:
        await event.wait()
        return
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)
