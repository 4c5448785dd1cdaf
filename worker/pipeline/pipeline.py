"""One request pipeline for both batching loops: admission (deadline, pairs, exact tokenization,
over-length policy), a batch run with failures isolated, replies. No I/O: callers use a thread."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, Literal, TypeVar

import numpy as np

from tokenq.shared import wire
from tokenq.shared.errors import ConfigError, ErrorCode
from tokenq.shared.packer import Budget, CostModel
from tokenq.shared.request_options import NO_OPTIONS, RequestOptions, parse_options, prompt_of
from tokenq.worker.backends.base import (
    Backend,
    BackendInfo,
    Encoding,
    TextInput,
    Tokenizer,
    windowing_of,
)
from tokenq.worker.pipeline.digest import request_digest
from tokenq.worker.pipeline.execute import (
    MAX_MESSAGE_CHARS,
    FailedRun,
    Failure,
    describe,
    run_isolated,
)
from tokenq.worker.pipeline.finisher import Finisher, facts_of, sparse_entries

K = TypeVar("K")

# Admit, Job and Outcome are made per request on the hot path: slotted, not frozen.

OverLength = Literal["truncate", "reject", "chunk"]
"""What happens to an input longer than the model takes (``--policy``)."""


@dataclass(slots=True)
class ChunkGroup:
    """The windows of one over-long request under the ``chunk`` policy."""

    lengths: list[int]
    results: dict[int, np.ndarray] = field(default_factory=dict)
    failure: Failure | None = None

    @property
    def complete(self) -> bool:
        return self.failure is not None or len(self.results) == len(self.lengths)


@dataclass(slots=True, eq=False)
class Admit(Generic[K]):
    """One request offered to :meth:`Pipeline.admit`: its deadline in epoch ms on the caller's
    clock (Redis's, for the worker) or None, and the monotonic ms it arrived (the packer's
    arrival time: linger and age count from it)."""

    ref: K
    request: wire.Request
    deadline_ms: int | None
    arrived_ms: float
    digest: bytes | None = field(default=None, kw_only=True)
    """What the answer depends on, hashed (:meth:`Pipeline.digest`), when the caller already
    has it (a cache lookup); None: not shared, or computed by :meth:`Pipeline.admit`."""


@dataclass(slots=True, eq=False)
class Job(Admit[K]):
    """A request (or one window of a chunked request) that is ready to be packed."""

    encoding: Encoding
    chunk: ChunkGroup | None = None
    chunk_index: int = 0
    options: RequestOptions = NO_OPTIONS
    truncated: bool = False
    """The encoding is the input cut to the model's limit (the reply says so)."""


@dataclass(slots=True, eq=False)
class Outcome(Generic[K]):
    """A finished request: its result or why it failed, and the tokens it took."""

    ref: K
    request: wire.Request
    result: np.ndarray | Failure
    tokens: int = 0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return not isinstance(self.result, Failure)

    @property
    def code(self) -> str:
        """``ok`` or the error code (what metrics count)."""
        return self.result.code if isinstance(self.result, Failure) else "ok"


@dataclass(slots=True)
class Admitted(Generic[K]):
    """What :meth:`Pipeline.admit` made of a read: jobs, answers now, and what it could not take."""

    jobs: list[Job[K]] = field(default_factory=list)
    answered: list[Outcome[K]] = field(default_factory=list)
    broken: list[tuple[Admit[K], str]] = field(default_factory=list)


@dataclass(slots=True)
class BatchOutcome(Generic[K]):
    """What one packed batch came to."""

    answered: list[Outcome[K]]
    """Requests finished by this batch (a chunked one only with its last window)."""
    failed_runs: list[FailedRun]
    """Every ``backend.run`` that raised (the batch was split, or a row failed)."""
    device_ms: float
    """Wall time on the device (0 when every job had expired)."""

    @property
    def ooms(self) -> list[FailedRun]:
        return [run for run in self.failed_runs if run.reason == "oom"]

    @property
    def oom_splits(self) -> int:
        return sum(run.rows > 1 for run in self.ooms)


def budget_for(info: BackendInfo, max_batch_tokens: int, max_batch_size: int,
               cost_model: CostModel | str | None, reason: str) -> Budget:
    """The batch budget both loops run under; a ConfigError for one the model cannot honour."""
    if max_batch_tokens < info.max_input_tokens:
        raise ConfigError(
            f"max_batch_tokens ({max_batch_tokens}) is below the model's maximum input length "
            f"({info.max_input_tokens} tokens): one full-length input would not fit in a "
            f"batch; raise --max-batch-tokens to at least {info.max_input_tokens} ({reason})"
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
        return Budget(max_batch_tokens, max_batch_size, model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class Pipeline(Generic[K]):
    """Every per-request rule between a decoded request and its answer, for one backend."""

    def __init__(self, backend: Backend, *, policy: OverLength = "truncate",
                 chunk_overlap: int = 0, tokenizer: Tokenizer | None = None) -> None:
        """``tokenizer`` tokenizes in the backend's place (a ``TokenizerPool``); default: it."""
        info = backend.info
        self.backend = backend
        self.tokenizer: Tokenizer = backend if tokenizer is None else tokenizer
        self.info = info
        self.policy: OverLength = policy
        self.chunk_overlap = chunk_overlap
        if policy not in ("truncate", "reject", "chunk"):
            raise ConfigError(f"policy must be truncate, reject or chunk, got {policy!r}")
        self._windowing = windowing_of(backend) if info.embeds else None
        self.facts = facts_of(info)
        self.finisher = Finisher(info)
        self.pair_refusal = None if info.pairs else (
            f"this queue's model ({info.model}) takes single texts, "
            "but the request carries a text_pair")
        """Why this model cannot take a (text, text_pair) request, or None when it can."""
        self.cache_scope: Callable[[K], bytes] | None = None
        """A request's scope by its key: the namespace (its tenant), model identity and policy
        its digest is keyed with (32 bytes); None: no digests, so nothing cached or coalesced."""
        if policy == "chunk" and self._windowing is None:
            raise ConfigError(
                f"policy 'chunk' needs an embedding backend that can split inputs into windows; "
                f"{info.name} ({info.model}, task {info.task}) cannot: use truncate or reject"
            )

    # ------------------------------------------------------------------ admit

    def admit(self, items: Sequence[Admit[K]], now_epoch_ms: int) -> Admitted[K]:
        """Jobs for the requests worth running; an answer now for the rest. Tokenizes in one
        call per truncation length (one call unless requests differ)."""
        out: Admitted[K] = Admitted()
        cut: list[tuple[Admit[K], RequestOptions, bytes | None]] = []  # to the model's limit
        whole: list[tuple[Admit[K], RequestOptions, bytes | None]] = []  # chunked when over it
        for item in items:
            if item.deadline_ms is not None and item.deadline_ms <= now_epoch_ms:
                late = now_epoch_ms - item.deadline_ms
                out.answered.append(self._failed(
                    item, ErrorCode.DEADLINE_EXCEEDED,
                    f"deadline passed {late} ms before the request could run",
                ))
                continue
            if item.request.text_pair is not None and self.pair_refusal is not None:
                out.answered.append(self._failed(item, ErrorCode.BAD_REQUEST, self.pair_refusal))
                continue
            opts = item.request.opts
            try:
                options = parse_options(opts, self.facts) if opts else NO_OPTIONS
            except ValueError as exc:
                out.answered.append(self._failed(item, ErrorCode.BAD_REQUEST, f"opts: {exc}",
                                                 getattr(exc, "param", None)))
                continue
            truncates = self._truncates(options)
            chunks = self.policy == "chunk" and not truncates
            digest = item.digest if item.digest is not None else self._digest(
                item.ref, item.request, options, truncates)
            (whole if chunks else cut).append((item, options, digest))
        if cut:
            self._tokenize_with(cut, self.info.max_input_tokens, out)
        if whole:
            self._tokenize_with(whole, None, out)
        return out

    def digest(self, ref: K, request: wire.Request) -> bytes | None:
        """The request's digest (None: not shared, or options :meth:`admit` refuses)."""
        try:
            options = parse_options(request.opts, self.facts) if request.opts else NO_OPTIONS
        except ValueError:
            return None
        truncating = self.policy == "truncate"
        return self._digest(ref, request, options,
                            truncating if options.truncate is None else options.truncate)

    def _digest(self, ref: K, request: wire.Request, options: RequestOptions,
                truncates: bool) -> bytes | None:
        if self.cache_scope is None or not options.cache:
            return None
        return request_digest(self.cache_scope(ref), request, options,
                              prompt_of(options, self.facts), truncates)

    def _tokenize_with(
        self, items: Sequence[tuple[Admit[K], RequestOptions, bytes | None]],
        max_length: int | None,
        out: Admitted[K],
    ) -> None:
        default = prompt_of(NO_OPTIONS, self.facts)
        inputs = [
            TextInput(item.request.text, item.request.text_pair,
                      default if options.prompt is None else options.prompt, options.output_tokens)
            for item, options, _ in items
        ]
        try:
            encodings = list(self.tokenizer.tokenize(inputs, max_length))
            if len(encodings) != len(inputs):
                raise RuntimeError(
                    f"tokenize returned {len(encodings)} encodings for {len(inputs)} inputs"
                )
        except Exception as exc:
            if len(items) > 1:
                for item in items:
                    self._tokenize_with([item], max_length, out)
                return
            if isinstance(exc, ValueError):  # the backend refusing this input (its contract)
                failure = ErrorCode.BAD_REQUEST, f"tokenizer refused input: {exc}"
            else:
                failure = ErrorCode.INFERENCE_FAILED, f"tokenizer failed: {describe(exc)}"
            out.answered.append(self._failed(items[0][0], *failure))
            return
        cut = self._cut(inputs, encodings, max_length)
        limit, jobs = self.info.max_input_tokens, out.jobs
        for index, ((item, options, digest), encoding) in enumerate(
                zip(items, encodings, strict=True)):
            length = getattr(encoding, "length", None)
            if type(length) is int and 0 < length <= limit and index not in cut \
                    and not options.output_tokens:  # the common case, as _place takes it
                jobs.append(Job(item.ref, item.request, item.deadline_ms, item.arrived_ms,
                                encoding, None, 0, options, False, digest=digest))
            else:
                self._place(item, options, encoding, out, truncated=index in cut, digest=digest)

    def _cut(self, inputs: Sequence[TextInput], encodings: Sequence[Encoding],
             max_length: int | None) -> set[int]:
        """The indices of the inputs ``max_length`` cut."""
        if max_length is None:
            return set()
        cut: set[int] = set()
        unknown: list[int] = []
        for index, encoding in enumerate(encodings):
            if getattr(encoding, "length", 0) < max_length:
                continue
            known = getattr(encoding, "truncated", None)
            if known is None:
                unknown.append(index)
            elif known:
                cut.add(index)
        if not unknown:
            return cut
        try:
            whole = self.tokenizer.tokenize([inputs[index] for index in unknown], None)
            return cut | {index for index, encoding in zip(unknown, whole, strict=True)
                          if encoding.length > max_length}
        except Exception:  # a backend's tokenizer failing here must not fail the request
            return cut | set(unknown)

    def _place(
        self, item: Admit[K], options: RequestOptions, encoding: Encoding, out: Admitted[K],
        truncated: bool = False, digest: bytes | None = None,
    ) -> None:
        """Apply the over-length policy to one tokenized request."""
        length = getattr(encoding, "length", None)
        if not isinstance(length, int) or length < 1:
            out.broken.append((item, f"the tokenizer gave an encoding of length {length!r}"))
            return
        limit = self.info.max_input_tokens
        if length <= limit and not (truncated and not self._truncates(options)):
            if options.output_tokens and length * (self.info.token_dim or 0) > \
                    wire.MAX_TOKEN_EMBEDDING_FLOATS:
                out.answered.append(self._failed(
                    item, ErrorCode.BAD_REQUEST,
                    f"output tokens: {length} tokens x {self.info.token_dim} dims is over the "
                    f"reply's limit of {wire.MAX_TOKEN_EMBEDDING_FLOATS} floats: send less text",
                ))
                return
            out.jobs.append(self._job(item, options, encoding, truncated=truncated, digest=digest))
            return
        if self._windowing is not None and self.policy == "chunk" and not options.output_tokens \
                and item.request.text_pair is None and options.truncate is not True:
            try:
                windows = self._windowing.windows(encoding, limit, self.chunk_overlap)
            except ValueError as exc:
                out.answered.append(self._failed(
                    item, ErrorCode.BAD_REQUEST, f"input cannot be chunked: {exc}"
                ))
                return
            group = ChunkGroup(lengths=[window.length for window in windows])
            out.jobs += [
                self._job(item, options, window, chunk=group, chunk_index=index, digest=digest)
                for index, window in enumerate(windows)
            ]
            return
        why = "the request asked truncate: false" if options.truncate is False \
            else f"queue policy: {self.policy}"
        out.answered.append(self._failed(
            item, ErrorCode.TOO_LONG,
            f"input is more than {limit} tokens, the model's limit ({why})",
        ))

    def _truncates(self, options: RequestOptions) -> bool:
        """Whether an input over the limit is cut to it (else refused, or chunked)."""
        return self.policy == "truncate" if options.truncate is None else options.truncate

    @staticmethod
    def _job(item: Admit[K], options: RequestOptions, encoding: Encoding,
             chunk: ChunkGroup | None = None, chunk_index: int = 0,
             truncated: bool = False, digest: bytes | None = None) -> Job[K]:
        return Job(item.ref, item.request, item.deadline_ms, item.arrived_ms, encoding,
                   chunk, chunk_index, options, truncated, digest=digest)

    @staticmethod
    def _failed(
        item: Admit[K], code: ErrorCode, message: str, param: str | None = None
    ) -> Outcome[K]:
        failure = Failure(code.value, message[:MAX_MESSAGE_CHARS], param)
        return Outcome(item.ref, item.request, failure)

    # -------------------------------------------------------------- run a batch

    def run_batch(self, jobs: Sequence[Job[K]], now_epoch_ms: int) -> BatchOutcome[K]:
        """Run one packed batch and settle what it finishes (synchronous: call it in a thread)."""
        expired: list[Job[K]] = []
        live: list[Job[K]] = []
        for job in jobs:
            deadline = job.deadline_ms
            (live if deadline is None or deadline > now_epoch_ms else expired).append(job)
        answered = self.settle(expired, [_DEADLINE] * len(expired)) if expired else []
        failed_runs: list[FailedRun] = []
        device_ms = 0.0
        if live:
            started = time.perf_counter()
            results = run_isolated(self.backend, [job.encoding for job in live], failed_runs)
            device_ms = (time.perf_counter() - started) * 1000.0
            answered += self.settle(live, results)
        return BatchOutcome(answered, failed_runs, device_ms)

    def settle(self, jobs: Sequence[Job[K]],
               results: Sequence[np.ndarray | Failure]) -> list[Outcome[K]]:
        """Outcomes for finished jobs; a chunked request finishes with its last window."""
        if isinstance(results, np.ndarray) and (self.policy != "chunk" or all(
                job.chunk is None for job in jobs)):  # every request whole, answered alike
            whole: Sequence[int] = range(len(jobs))
        else:
            whole = [i for i, (job, result) in enumerate(zip(jobs, results, strict=True))
                     if job.chunk is None and not isinstance(result, Failure)]
        if len(whole) == len(jobs):  # the common case: every request whole and answered
            rows = self.finisher.finish(results, [job.options for job in jobs])  # type: ignore[arg-type]
            return [Outcome(job.ref, job.request, row, job.encoding.length, job.truncated)
                    for job, row in zip(jobs, rows, strict=True)]
        finished: dict[int, np.ndarray] = {}
        if whole:
            rows = self.finisher.finish(
                [results[i] for i in whole],  # type: ignore[misc]
                [jobs[i].options for i in whole],
            )
            finished = dict(zip(whole, rows, strict=True))
        out: list[Outcome[K]] = []
        for index, (job, result) in enumerate(zip(jobs, results, strict=True)):
            group = job.chunk
            if group is None:
                answer = finished.get(index, result)
                out.append(Outcome(job.ref, job.request, answer, job.encoding.length,
                                   job.truncated))
                continue
            if group.complete:
                continue  # an earlier window already failed the request
            if isinstance(result, Failure):
                group.failure = result
                out.append(Outcome(job.ref, job.request, result, sum(group.lengths)))
                continue
            group.results[job.chunk_index] = result
            if group.complete:
                windows = [group.results[index] for index in range(len(group.lengths))]
                combined = self.finisher.combine(windows, group.lengths, job.options)
                out.append(Outcome(job.ref, job.request, combined, sum(group.lengths)))
        return out

    # ------------------------------------------------------------------ reply

    def encoded_replies(self, outcomes: Sequence[Outcome[K]]) -> list[tuple[bytes, bool]]:
        """:meth:`encoded_reply` of each outcome, in order, with one float32 conversion and
        one :func:`~tokenq.shared.wire.encode_embedding_replies` per embedding width."""
        replies: list[tuple[bytes, bool] | None] = [None] * len(outcomes)
        if self.info.embeds:
            by_width: dict[int, list[int]] = {}
            for index, outcome in enumerate(outcomes):
                result = outcome.result
                if isinstance(result, np.ndarray) and result.ndim == 1 and result.shape[0] \
                        and not outcome.truncated:  # a cut input's reply says so: one by one
                    by_width.setdefault(result.shape[0], []).append(index)
            for indices in by_width.values():
                if len(indices) == len(outcomes):  # one width for all: nothing to scatter
                    return [(payload, True) for payload in self._embedding_replies(outcomes)]
                payloads = self._embedding_replies([outcomes[index] for index in indices])
                for index, payload in zip(indices, payloads, strict=True):
                    replies[index] = (payload, True)
        return [self.encoded_reply(outcome) if reply is None else reply
                for outcome, reply in zip(outcomes, replies, strict=True)]

    @staticmethod
    def _embedding_replies(outcomes: Sequence[Outcome[K]]) -> list[bytes]:
        """The replies of outcomes whose results are vectors of one width."""
        vectors = [outcome.result for outcome in outcomes]
        # concatenate, not stack: the same bytes at a third of the cost per row
        rows = np.concatenate(vectors).astype("<f4", copy=False)  # type: ignore[arg-type]
        return wire.encode_embedding_replies(  # the rows' bytes read in place, not copied
            [outcome.request.id for outcome in outcomes], memoryview(rows.view(np.uint8)),
            int(vectors[0].shape[0]),  # type: ignore[union-attr]
            [outcome.tokens for outcome in outcomes],
        )

    def encoded_reply(self, outcome: Outcome[K]) -> tuple[bytes, bool]:
        """The reply's msgpack bytes, and whether it is a success; a cut input's says so."""
        request, result, tokens = outcome.request, outcome.result, outcome.tokens
        if isinstance(result, Failure):
            failed = wire.error_reply(request.id, result.code, result.message, result.param)
            return wire.encode_reply(failed), False
        if self.info.embeds and result.ndim == 1:
            vector = np.ascontiguousarray(result, dtype="<f4")
            return wire.encode_embedding_reply(
                request.id, vector.tobytes(), int(vector.shape[0]), tokens=tokens,
                truncated=outcome.truncated,
            ), True
        if result.ndim == 2:  # output: tokens (Finisher.one): one vector per token
            rows = np.ascontiguousarray(result, dtype="<f4")
            reply = wire.token_embeddings_reply(request.id, rows.tobytes(), int(rows.shape[1]),
                                                tokens=tokens)
        elif self.info.task == "sparse":
            indices, values = sparse_entries(result)
            reply = wire.sparse_reply(request.id, indices, values, int(np.size(result)),
                                      tokens=tokens)
        else:
            scores = np.ravel(result).tolist()
            labels = self.info.labels if len(self.info.labels) == len(scores) else None
            reply = wire.scores_reply(request.id, scores, tokens=tokens, labels=labels)
        if outcome.truncated:
            reply = replace(reply, truncated=True)
        return wire.encode_reply(reply), True


_DEADLINE = Failure(ErrorCode.DEADLINE_EXCEEDED.value, "deadline passed before the request ran")
