"""Token-budgeted batching inside one asyncio process, with no Redis in between."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from tokenq.shared import wire
from tokenq.shared.errors import BadRequest, ConfigError, ErrorCode, remote_error
from tokenq.shared.packer import DEFAULT_AGING_MS, AdaptiveBudget, Batch, Budget, CostModel, Packer
from tokenq.shared.request_options import WorkerOptions, parse_options
from tokenq.shared.wire import DEFAULT_MAX_REQUEST_BYTES, validate_priority, validate_text
from tokenq.worker.backends.base import Backend
from tokenq.worker.pipeline.execute import FailedRun, Failure, adapt_budget, describe
from tokenq.worker.pipeline.feed import DeviceFeed, Rules, in_thread, monotonic_ms
from tokenq.worker.pipeline.pipeline import (
    Admit,
    BatchOutcome,
    Job,
    OverLength,
    Pipeline,
    budget_for,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)

TOKENIZE_CHUNK = 512
"""Most inputs per tokenizer call: big enough to amortise the thread hop,
small enough that the first batch of a huge ``submit_many`` starts soon."""


def _epoch_ms() -> int:
    return int(time.time() * 1000)


_Future = asyncio.Future[np.ndarray]
"""Each request's reference through the pipeline: what its caller awaits."""


@dataclass(slots=True)
class BatcherStats:
    """Running counts, for metrics and tests; read them from the event loop."""

    submitted: int = 0
    batches: int = 0
    rows: int = 0
    tokens: int = 0  # real (unpadded) tokens run
    cost_tokens: int = 0  # tokens paid under the cost model (rows x longest, or the sum)
    oom_events: int = 0  # runs that hit out-of-memory (each split a batch or failed one row)
    error_events: int = 0  # runs that raised anything else
    failed: int = 0  # requests answered with an error
    failed_runs: list[FailedRun] = field(default_factory=list, repr=False)  # last 100, newest last


@dataclass(frozen=True, slots=True)
class BatcherOptions:
    """The rest of ``tokenq worker``'s knobs of the same names, with the same defaults
    (``cost_model`` None or 'auto' follows ``backend.info.padded``)."""

    cost_model: CostModel | str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    policy: OverLength = "truncate"
    chunk_overlap: int = 0
    max_padding_ratio: float = 1.0
    aging_ms: float = DEFAULT_AGING_MS
    max_batch_ms: float | None = None


class Batcher:
    """Packs concurrent ``submit`` calls into token-budgeted batches for one backend."""

    def __init__(
        self, backend: Backend, *, max_batch_tokens: int, max_batch_size: int, linger_ms: float,
        options: BatcherOptions = BatcherOptions(),
    ) -> None:
        info = backend.info
        budget = budget_for(info, max_batch_tokens, max_batch_size, options.cost_model,
                            "set by max_batch_tokens")
        self._pipeline: Pipeline[_Future] = Pipeline(
            backend, policy=options.policy, chunk_overlap=options.chunk_overlap)
        try:
            self._packer: Packer[Job[_Future]] = Packer(
                budget, linger_ms, max_padding_ratio=options.max_padding_ratio,
                aging_ms=options.aging_ms, max_batch_ms=options.max_batch_ms)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        # Lowered after an OOM, raised slowly, never below one full-length input.
        self._adaptive = AdaptiveBudget(max_batch_tokens, info.max_input_tokens)
        self._feed: DeviceFeed[Job[_Future], BatchOutcome[_Future]] = DeviceFeed(
            self._packer, self._execute, _Rules(self), name="tokenq-batcher-device")
        self.backend = backend
        self.max_request_bytes = options.max_request_bytes
        self.stats = BatcherStats()
        self._incoming: deque[Admit[_Future]] = deque()
        self._ids = itertools.count()
        self._tokenizing: list[Admit[_Future]] = []
        """The chunk the tokenizer thread holds: out of ``_incoming``, not yet in the packer."""
        self._stopped: Failure | None = None
        """Set when a task died; what every later answer becomes."""
        self._abandoned = False
        self._closing = False
        self._wake_tokenizer = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def budget(self) -> Budget:
        """The budget now in force (lower than configured for a while after an OOM)."""
        return self._packer.budget

    # ----------------------------------------------------------------- callers

    async def submit(
        self, text: str, text_pair: str | None = None, *, timeout_s: float | None = None,
        priority: int = 0, **options: Unpack[WorkerOptions],
    ) -> np.ndarray:
        """The model's output for one input."""
        self._check(text, text_pair)
        opts = self._opts(options)
        return await self._enqueue(text, text_pair, timeout_s, validate_priority(priority),
                                   opts).ref

    @overload
    async def submit_many(
        self, texts: Sequence[str], text_pairs: Sequence[str] | None = None, *,
        return_exceptions: Literal[False] = False, timeout_s: float | None = None,
        priority: int = 0, **options: Unpack[WorkerOptions],
    ) -> list[np.ndarray]: ...

    @overload
    async def submit_many(
        self, texts: Sequence[str], text_pairs: Sequence[str] | None = None, *,
        return_exceptions: Literal[True], timeout_s: float | None = None, priority: int = 0,
        **options: Unpack[WorkerOptions],
    ) -> list[np.ndarray | BaseException]: ...

    async def submit_many(
        self, texts: Sequence[str], text_pairs: Sequence[str] | None = None, *,
        return_exceptions: bool = False, timeout_s: float | None = None, priority: int = 0,
        **options: Unpack[WorkerOptions],
    ) -> list[np.ndarray] | list[np.ndarray | BaseException]:
        """Outputs for many inputs, in order; batched together with everyone else's."""
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
        priority = validate_priority(priority)
        opts = self._opts(options)
        queued = [self._enqueue(text, pair, timeout_s, priority, opts)
                  for text, pair in zip(texts, pairs, strict=True)]
        results = await asyncio.gather(*(pending.ref for pending in queued),
                                       return_exceptions=True)
        if not return_exceptions:
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        return results

    async def aclose(self) -> None:
        """Stop taking input, answer everything already submitted, then return."""
        self._closing = True
        self._wake_tokenizer.set()
        self._feed.wake()
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
            if self._pipeline.pair_refusal is not None:  # the Redis worker's refusal, up front
                raise BadRequest(f"text_pair{where}: {self._pipeline.pair_refusal}")
            validate_text(text_pair, f"text_pair{where}", self.max_request_bytes)

    def _opts(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The request's ``opts``: the options given, refused now if the pipeline would."""
        unknown = sorted(set(options) - WorkerOptions.__optional_keys__)
        if unknown:
            raise TypeError(f"submit() got an unexpected keyword argument {unknown[0]!r}")
        opts = {name: value for name, value in options.items() if value is not None}
        try:
            parse_options(opts, self._pipeline.facts)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return opts

    def _enqueue(
        self, text: str, text_pair: str | None, timeout_s: float | None, priority: int,
        opts: Mapping[str, Any],
    ) -> Admit[_Future]:
        loop = self._start()
        deadline = None if timeout_s is None else _epoch_ms() + int(timeout_s * 1000)
        request = wire.Request(id=str(next(self._ids)), text=text, tokens=0, reply_to="",
                               text_pair=text_pair, priority=priority, opts=opts)
        pending = Admit(loop.create_future(), request, deadline, monotonic_ms())
        pending.ref.add_done_callback(self._on_future_done)
        self._incoming.append(pending)
        self.stats.submitted += 1
        self._wake_tokenizer.set()
        return pending

    def _on_future_done(self, future: _Future) -> None:
        # A caller that gave up leaves its entry; the device task drops it before the next pick.
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
                chunk: list[Admit[_Future]] = []
                while self._incoming and len(chunk) < TOKENIZE_CHUNK:
                    pending = self._incoming.popleft()
                    if not pending.ref.done():
                        chunk.append(pending)
                if not chunk:
                    continue
                self._tokenizing = chunk
                admitted = await asyncio.to_thread(in_thread, self._pipeline.admit, chunk,
                                                   _epoch_ms())
                for outcome in admitted.answered:
                    self._answer(outcome.ref, outcome.result)
                for item, why in admitted.broken:
                    self._answer(item.ref, Failure(ErrorCode.BAD_REQUEST.value,
                                                   f"the batcher could not take this input: {why}"))
                if self._stopped is not None:
                    for job in admitted.jobs:
                        self._answer(job.ref, self._stopped)
                else:
                    self._feed.add(admitted.jobs)
                self._tokenizing = []
        except BaseException as exc:
            self._fail_everything(exc)
            raise

    # ------------------------------------------------------------------ device

    async def _device_task(self) -> None:
        try:
            await self._feed.run(self._settle)
        except BaseException as exc:
            self._fail_everything(exc)
            raise

    def _execute(self, batch: Batch[Job[_Future]]) -> BatchOutcome[_Future]:
        """Run one batch and adapt the budget (in the device thread, which alone changes it)."""
        outcome = self._pipeline.run_batch(batch.payloads, _epoch_ms())
        adapt_budget(self._adaptive, self._packer, outcome.ooms, "batcher")
        return outcome

    async def _settle(self, batch: Batch[Job[_Future]], outcome: BatchOutcome[_Future]) -> None:
        stats, events = self.stats, outcome.failed_runs
        stats.batches += 1
        stats.rows += batch.rows
        stats.tokens += batch.tokens
        stats.cost_tokens += batch.cost
        ooms = sum(event.reason == "oom" for event in events)
        stats.oom_events += ooms
        stats.error_events += len(events) - ooms
        if events:
            stats.failed_runs = (stats.failed_runs + events)[-100:]
        for done in outcome.answered:
            self._answer(done.ref, done.result)

    # ----------------------------------------------------------------- answers

    def _answer(self, future: _Future, result: np.ndarray | Failure) -> None:
        if future.done():
            return
        if isinstance(result, Failure):
            self.stats.failed += 1
            future.set_exception(remote_error(result.code, result.message, param=result.param))
        else:
            future.set_result(result)

    def _fail_everything(self, exc: BaseException) -> None:
        """A task died (a bug, or the loop is shutting down): no caller may hang."""
        if not isinstance(exc, asyncio.CancelledError):
            log.error("tokenq batcher stopped: %s", describe(exc), exc_info=exc)
        self._closing = True
        failure = Failure(ErrorCode.INFERENCE_FAILED.value, f"batcher stopped: {describe(exc)}")
        self._stopped = self._stopped or failure
        doomed = [*(pending.ref for pending in (*self._incoming, *self._tokenizing)),
                  *(job.ref for job in self._feed.held())]
        self._incoming.clear()
        self._tokenizing = []
        self._feed.remove_where(lambda _: True)
        for future in doomed:
            self._answer(future, failure)
        # Wake the other task so it notices the shutdown.
        self._wake_tokenizer.set()
        self._feed.wake()


@dataclass
class _Rules(Rules):
    """What the device thread asks a :class:`Batcher`."""

    batcher: Batcher

    def flushing(self) -> bool:
        return self.batcher._closing

    def finished(self) -> bool:
        batcher = self.batcher
        return batcher._closing and not (
            batcher._incoming or batcher._tokenizing or batcher._packer)

    def prune(self) -> None:
        """Drop what callers gave up on before costing a batch (device thread, feed's lock held)."""
        batcher = self.batcher
        if batcher._abandoned:
            batcher._abandoned = False
            batcher._packer.remove_where(lambda job: job.ref.done())
