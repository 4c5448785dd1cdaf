"""One behaviour suite, two batching loops: the Redis worker and the in-process batcher.

Both loops call the same request pipeline (``worker/pipeline``), and this
suite is how that stays true: every test runs once against a real
:class:`~tokenq.worker.loop.Worker` on the test redis-server (requests are
XADDed as the protocol says and replies BLPOPped) and once against a
:class:`~tokenq.worker.local.Batcher`, with the same backend object, and
asserts the same outcome: the over-length policies (reject, truncate,
chunk), deadlines, the padding guard, OOM splitting, a tokenizer's refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pytest
import redis.asyncio as aioredis

from tokenq.shared import keys, wire
from tokenq.shared.errors import (
    BadRequest,
    DeviceOutOfMemory,
    ErrorCode,
    RemoteError,
    remote_error,
)
from tokenq.worker.backends.base import Encoding, TextInput
from tokenq.worker.backends.sim import SimBackend, expected_chunked_vector, expected_vector
from tokenq.worker.local import Batcher, BatcherOptions
from tokenq.worker.loop.worker import Worker
from tokenq.worker.pipeline.feed import Aborted
from tokenq.worker.settings import WorkerSettings

DIM = 16
MAX_INPUT = 24


class Recording(SimBackend):
    """The sim, recording every batch's lengths; texts with 'slow' hold the device,
    texts with 'refuse me' are refused by the tokenizer, and a batch padded past
    ``oom_above`` tokens runs out of memory."""

    def __init__(self, *, oom_above: int | None = None, slow_s: float = 0.6) -> None:
        super().__init__(dim=DIM, max_input_tokens=MAX_INPUT, batch_ms=0.0, token_us=0.0)
        self.shapes: list[list[int]] = []
        self.max_lengths: list[int | None] = []  # each tokenize call's
        self.oom_above = oom_above
        self.slow_s = slow_s
        self._slow: set[int] = set()
        self._lock_shapes = threading.Lock()

    def tokenize(self, inputs: Sequence[TextInput], max_length: int | None) -> list[Encoding]:
        if any("refuse me" in item.text for item in inputs):
            raise ValueError("unsupported characters")
        self.max_lengths.append(max_length)
        encodings = super().tokenize(inputs, max_length)
        for item, encoding in zip(inputs, encodings, strict=True):
            if "slow" in item.text:
                self._slow.add(id(encoding))
        return encodings

    def run(self, batch: Sequence[Encoding]) -> list[np.ndarray]:
        lengths = [encoding.length for encoding in batch]
        if self.oom_above is not None and len(lengths) * max(lengths) > self.oom_above:
            raise DeviceOutOfMemory(f"{len(lengths)} x {max(lengths)} > {self.oom_above}")
        with self._lock_shapes:
            self.shapes.append(lengths)
        if any(id(encoding) in self._slow for encoding in batch):
            time.sleep(self.slow_s)
        return super().run(batch)


@dataclass(frozen=True)
class Knobs:
    """The settings both loops take under the same names."""

    policy: str = "truncate"
    chunk_overlap: int = 0
    max_batch_tokens: int = 4096
    max_batch_size: int = 64
    linger_ms: float = 30.0
    max_padding_ratio: float = 1.0
    aging_ms: float = 1000.0


Answer = np.ndarray | BaseException


class Loop(Protocol):
    async def submit_all(
        self, texts: Sequence[str], *, pairs: Sequence[str | None] | None = None,
        timeout_s: float | None = None, priority: int = 0, **opts: Any,
    ) -> list[Answer]: ...


class BatcherLoop:
    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher

    async def submit_all(self, texts, *, pairs=None, timeout_s=None, priority=0, **opts):
        pairs = pairs or [None] * len(texts)

        async def one(text: str, pair: str | None) -> Answer:
            try:
                return await self.batcher.submit(
                    text, pair, timeout_s=timeout_s, priority=priority, **opts
                )
            except Exception as exc:  # the outcome under test
                return exc

        return list(await asyncio.gather(*(one(t, p) for t, p in zip(texts, pairs, strict=True))))


class RedisLoop:
    """Requests XADDed as docs/PROTOCOL.md says; replies BLPOPped and decoded."""

    def __init__(self, client: aioredis.Redis, q: keys.QueueRef) -> None:
        self.client = client
        self.q = q

    async def submit_all(self, texts, *, pairs=None, timeout_s=None, priority=0, **opts):
        pairs = pairs or [None] * len(texts)
        ids = [uuid.uuid4().hex for _ in texts]
        for request_id, text, pair in zip(ids, texts, pairs, strict=True):
            timeout_ms = deadline_ms = None
            if timeout_s is not None and timeout_s > 0:
                timeout_ms = int(timeout_s * 1000)
            elif timeout_s is not None:  # already past: an absolute deadline behind us
                deadline_ms = int((time.time() + timeout_s) * 1000)
            request = wire.Request(
                id=request_id, text=text, tokens=0, reply_to=keys.reply(self.q, request_id),
                text_pair=pair, timeout_ms=timeout_ms, deadline_ms=deadline_ms,
                priority=priority, opts=opts,
            )
            await self.client.xadd(keys.requests(self.q), wire.encode_request(request))
        return [await self._reply(keys.reply(self.q, request_id)) for request_id in ids]

    async def _reply(self, key: str) -> Answer:
        popped = await self.client.blpop([key], timeout=20)
        assert popped is not None, f"no reply on {key}"
        reply = wire.decode_reply(popped[1])
        if reply.error is not None:
            return remote_error(reply.error.code, reply.error.message, reply.id)
        assert reply.embedding is not None
        return np.frombuffer(reply.embedding, dtype="<f4")


@contextlib.asynccontextmanager
async def batcher_loop(backend: Recording, knobs: Knobs, redis_url: str) -> AsyncIterator[Loop]:
    async with Batcher(
        backend, max_batch_tokens=knobs.max_batch_tokens, max_batch_size=knobs.max_batch_size,
        linger_ms=knobs.linger_ms, options=BatcherOptions(
            policy=knobs.policy, chunk_overlap=knobs.chunk_overlap,
            max_padding_ratio=knobs.max_padding_ratio, aging_ms=knobs.aging_ms),
    ) as batcher:
        yield BatcherLoop(batcher)


@contextlib.asynccontextmanager
async def redis_loop(backend: Recording, knobs: Knobs, redis_url: str) -> AsyncIterator[Loop]:
    queue = f"behaviour-{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings(
        redis_url=redis_url, queue=queue, backend="sim", policy=knobs.policy,
        chunk_overlap=knobs.chunk_overlap, max_batch_tokens=knobs.max_batch_tokens,
        max_batch_size=knobs.max_batch_size, linger_ms=knobs.linger_ms,
        max_padding_ratio=knobs.max_padding_ratio, aging_ms=knobs.aging_ms, block_ms=100,
        heartbeat_s=1.0,
    )
    worker = Worker(settings, backend)
    running = asyncio.create_task(worker.run())
    client = aioredis.Redis.from_url(redis_url)
    q = keys.QueueRef(queue)
    try:
        for _ in range(200):
            if await client.exists(keys.config(q)):
                break
            await asyncio.sleep(0.02)
        yield RedisLoop(client, q)
    finally:
        worker.stop()
        await asyncio.wait_for(running, 30)
        await client.aclose()


LOOPS = {"redis-worker": redis_loop, "in-process": batcher_loop}


@pytest.fixture(params=sorted(LOOPS))
def open_loop(request: pytest.FixtureRequest, redis_url: str):
    factory = LOOPS[request.param]

    def opener(backend: Recording, knobs: Knobs = Knobs()) -> Any:
        return factory(backend, knobs, redis_url)

    return opener


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, 60))


LONG = " ".join(f"word{i}" for i in range(60))  # 62 sim tokens, over MAX_INPUT
SHORT = "a short text"


def assert_error(answer: Answer, code: ErrorCode, *fragments: str) -> None:
    assert isinstance(answer, RemoteError), answer
    assert answer.code == code.value, answer
    for fragment in fragments:
        assert fragment in answer.message, answer.message


def test_reject_answers_too_long_with_the_limit(open_loop) -> None:
    async def main() -> None:
        backend = Recording()
        async with open_loop(backend, Knobs(policy="reject")) as loop:
            long, short = await loop.submit_all([LONG, SHORT])
        assert_error(long, ErrorCode.TOO_LONG, f"more than {MAX_INPUT} tokens", "reject")
        assert set(backend.max_lengths) == {MAX_INPUT}  # no text read past the limit
        np.testing.assert_allclose(short, expected_vector(SHORT, DIM), rtol=1e-6)

    run(main())


def test_truncate_embeds_the_first_tokens(open_loop) -> None:
    async def main() -> None:
        async with open_loop(Recording(), Knobs(policy="truncate")) as loop:
            (long,) = await loop.submit_all([LONG])
        np.testing.assert_allclose(long, expected_vector(LONG, DIM, MAX_INPUT), rtol=1e-6)

    run(main())


def test_chunk_answers_the_mean_of_the_windows(open_loop) -> None:
    async def main() -> None:
        backend = Recording()
        async with open_loop(backend, Knobs(policy="chunk", chunk_overlap=4)) as loop:
            long, short = await loop.submit_all([LONG, SHORT])
        np.testing.assert_allclose(
            long, expected_chunked_vector(LONG, DIM, MAX_INPUT, 4), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(short, expected_vector(SHORT, DIM), rtol=1e-6)
        assert sum(len(shape) for shape in backend.shapes) > 2  # the windows ran as rows

    run(main())


def test_a_deadline_that_passes_while_waiting_is_answered_without_running(open_loop) -> None:
    async def main() -> None:
        backend = Recording(slow_s=0.8)
        async with open_loop(backend, Knobs(max_batch_size=1, linger_ms=0)) as loop:
            slow = asyncio.ensure_future(loop.submit_all(["slow one"]))
            await asyncio.sleep(0.2)  # the slow batch is on the device now
            (late,) = await loop.submit_all(["in a hurry"], timeout_s=0.3)
            (in_time,) = await loop.submit_all(["patient"], timeout_s=30)
            (slow_answer,) = await slow
        assert_error(late, ErrorCode.DEADLINE_EXCEEDED, "deadline passed")
        np.testing.assert_allclose(in_time, expected_vector("patient", DIM), rtol=1e-6)
        np.testing.assert_allclose(slow_answer, expected_vector("slow one", DIM), rtol=1e-6)
        ran = [length for shape in backend.shapes for length in shape]
        assert len(ran) == 2  # "in a hurry" never reached the device

    run(main())


def test_an_expired_request_is_refused_before_tokenizing(open_loop) -> None:
    async def main() -> None:
        backend = Recording()
        async with open_loop(backend) as loop:
            (expired,) = await loop.submit_all(["too late"], timeout_s=-1.0)
        assert_error(expired, ErrorCode.DEADLINE_EXCEEDED, "before the request could run")
        assert backend.shapes == []

    run(main())


def test_the_padding_guard_keeps_short_and_long_apart(open_loop) -> None:
    async def main() -> None:
        backend = Recording()
        # 3 and 22 tokens; distinct, as identical requests would run as one row
        texts = [f"q{i}" for i in range(4)] + [" ".join([f"w{i}"] * 20) for i in range(4)]
        async with open_loop(backend, Knobs(max_padding_ratio=1.0, linger_ms=200)) as loop:
            answers = await loop.submit_all(texts)
        assert all(isinstance(answer, np.ndarray) for answer in answers)
        for shape in backend.shapes:
            assert max(shape) - min(shape) <= 1.0 * min(shape), backend.shapes

    run(main())


def test_queries_read_during_a_long_batch_go_before_the_passages_read_with_it(
        open_loop) -> None:
    """On a device whose batches outlast aging_ms (a CPU), passages read ahead have waited past
    aging_ms when the batch on the device ends, yet the queries that came meanwhile take the
    next batch; the passages go after them."""
    async def main() -> None:
        backend = Recording(slow_s=0.8)
        passages = [" ".join([f"slow{i}"] * 20) for i in range(8)]  # 22 tokens each
        queries = [f"q{i}" for i in range(3)]  # 3 tokens each
        knobs = Knobs(max_batch_size=4, aging_ms=200.0)
        async with open_loop(backend, knobs) as loop:
            read_ahead = asyncio.ensure_future(loop.submit_all(passages))
            while not backend.shapes:  # until four passages are on the device, four waiting
                await asyncio.sleep(0.005)
            answered = await loop.submit_all(queries)
            answers = [*answered, *await read_ahead]
        for text, answer in zip([*queries, *passages], answers, strict=True):
            np.testing.assert_allclose(answer, expected_vector(text, DIM), rtol=1e-6)
        first, after, *rest = backend.shapes
        assert after == [3] * 3, backend.shapes  # the queries' batch, next after the first
        assert {*first, *(length for shape in rest for length in shape)} == {22}

    run(main())


def test_out_of_memory_splits_the_batch_and_answers_every_row(open_loop) -> None:
    async def main() -> None:
        backend = Recording(oom_above=4 * 12)
        texts = [" ".join([f"t{i}"] * 10) for i in range(8)]  # 12 tokens each
        async with open_loop(backend, Knobs(max_batch_tokens=4096, linger_ms=200)) as loop:
            answers = await loop.submit_all(texts)
        for text, answer in zip(texts, answers, strict=True):
            np.testing.assert_allclose(answer, expected_vector(text, DIM), rtol=1e-6)
        assert all(len(shape) <= 4 for shape in backend.shapes)

    run(main())


def test_a_row_that_never_fits_fails_alone_with_out_of_memory(open_loop) -> None:
    async def main() -> None:
        backend = Recording(oom_above=20)
        async with open_loop(backend, Knobs(linger_ms=100)) as loop:
            big, small = await loop.submit_all([" ".join(["x"] * 21), "tiny"])
        assert_error(big, ErrorCode.OUT_OF_MEMORY)
        np.testing.assert_allclose(small, expected_vector("tiny", DIM), rtol=1e-6)

    run(main())


def test_a_tokenizer_refusal_fails_only_that_request(open_loop) -> None:
    async def main() -> None:
        async with open_loop(Recording(), Knobs(linger_ms=50)) as loop:
            first, refused, last = await loop.submit_all(["ok", "refuse me", "ok too"])
        assert_error(refused, ErrorCode.BAD_REQUEST, "unsupported characters")
        np.testing.assert_allclose(first, expected_vector("ok", DIM), rtol=1e-6)
        np.testing.assert_allclose(last, expected_vector("ok too", DIM), rtol=1e-6)

    run(main())


def test_a_pair_for_a_single_text_model_is_refused(open_loop) -> None:
    async def main() -> None:
        async with open_loop(Recording()) as loop:
            try:
                answers = await loop.submit_all(["query"], pairs=["passage"])
            except Exception as exc:  # the batcher refuses before queueing anything
                answers = [exc]
        (answer,) = answers
        assert isinstance(answer, Exception) and "single texts" in str(answer)
        assert getattr(answer, "code", ErrorCode.BAD_REQUEST.value) == ErrorCode.BAD_REQUEST.value

    run(main())


def test_a_higher_priority_goes_into_the_next_batch_first(open_loop) -> None:
    """A request of priority 1 that arrives behind buffered priority-0 work runs before it."""

    async def main() -> None:
        backend = Recording(slow_s=0.6)
        async with open_loop(backend, Knobs(max_batch_size=1, linger_ms=0)) as loop:
            slow = asyncio.ensure_future(loop.submit_all(["slow one"]))
            await asyncio.sleep(0.2)  # the slow batch is on the device now
            low = asyncio.ensure_future(loop.submit_all([f"low {i}" for i in range(4)]))
            await asyncio.sleep(0.15)  # the four are buffered behind it
            (urgent,) = await loop.submit_all(["urgent"], priority=1)
            lows, (slow_answer,) = await low, await slow
        np.testing.assert_allclose(urgent, expected_vector("urgent", DIM), rtol=1e-6)
        for index, answer in enumerate(lows):
            np.testing.assert_allclose(answer, expected_vector(f"low {index}", DIM), rtol=1e-6)
        np.testing.assert_allclose(slow_answer, expected_vector("slow one", DIM), rtol=1e-6)
        # "urgent" is 3 sim tokens, each "low i" 4: the urgent one ran right after the slow one.
        assert [shape for shape in backend.shapes[1:]] == [[3], [4], [4], [4], [4]]

    run(main())


# ---------------------------------------------------------------- request options


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


def test_a_prompt_is_embedded_with_the_text_and_its_tokens_count(open_loop) -> None:
    """The prompt's tokens count toward the limit: a text that fits alone is too long with it."""
    fits = " ".join(f"w{i}" for i in range(MAX_INPUT - 2))  # exactly the limit with [CLS]/[SEP]
    prompt = "query : "

    async def main() -> None:
        async with open_loop(Recording(), Knobs(policy="reject")) as loop:
            (prompted,) = await loop.submit_all([SHORT], prompt=prompt)
            (alone,) = await loop.submit_all([fits])
            (over,) = await loop.submit_all([fits], prompt=prompt)
        np.testing.assert_allclose(prompted, expected_vector(prompt + SHORT, DIM), rtol=1e-6)
        np.testing.assert_allclose(alone, expected_vector(fits, DIM), rtol=1e-6)
        assert_error(over, ErrorCode.TOO_LONG, f"more than {MAX_INPUT} tokens")

    run(main())


def test_dimensions_keep_the_first_values_renormalised(open_loop) -> None:
    async def main() -> None:
        async with open_loop(Recording()) as loop:
            (short,) = await loop.submit_all([SHORT], dimensions=4)
            (chunked,) = await loop.submit_all([LONG], dimensions=5, truncate=False)
        np.testing.assert_allclose(short, unit(expected_vector(SHORT, DIM)[:4]), rtol=1e-6)
        assert short.shape == (4,)
        # truncate false on a truncate queue without chunking: refused, not cut
        assert_error(chunked, ErrorCode.TOO_LONG, "truncate: false")

    run(main())


def test_truncate_option_overrides_the_queue_policy(open_loop) -> None:
    async def main() -> None:
        async with open_loop(Recording(), Knobs(policy="reject")) as loop:
            (cut,) = await loop.submit_all([LONG], truncate=True)
        np.testing.assert_allclose(cut, expected_vector(LONG, DIM, MAX_INPUT), rtol=1e-6)
        async with open_loop(Recording(), Knobs(policy="chunk")) as loop:
            (cut,) = await loop.submit_all([LONG], truncate=True)
            (chunked,) = await loop.submit_all([LONG], truncate=False, dimensions=6)
        np.testing.assert_allclose(cut, expected_vector(LONG, DIM, MAX_INPUT), rtol=1e-6)
        whole = expected_chunked_vector(LONG, DIM, MAX_INPUT, 0)
        np.testing.assert_allclose(chunked, unit(whole[:6]), rtol=1e-5, atol=1e-6)

    run(main())


@pytest.mark.parametrize(
    ("opts", "fragment"),
    [
        ({"normalize": False}, "only answers unit-length"),
        ({"raw_scores": True}, "raw_scores applies to classifiers"),
        ({"dimensions": DIM + 1}, f"more than the model's {DIM}"),
        ({"dimensions": 0}, "from 1 to 65536"),
        ({"prompt_name": "query"}, "it has no named prompts"),
        ({"prompt": "a", "prompt_name": "b"}, "not both"),
        ({"truncate": "yes"}, "truncate must be true or false"),
    ],
)
def test_a_bad_option_is_refused_by_name_and_nothing_else_is_lost(
    open_loop, opts: dict[str, Any], fragment: str
) -> None:
    async def main() -> list[Answer]:
        async with open_loop(Recording()) as loop:
            bad = await loop.submit_all([SHORT], **opts)
            good = await loop.submit_all([SHORT])
        return bad + good

    bad, good = run(main())
    if isinstance(bad, BadRequest):  # the in-process batcher refuses at submit
        assert fragment in str(bad), bad
    else:  # the worker answers the request
        assert_error(bad, ErrorCode.BAD_REQUEST, fragment)
    np.testing.assert_allclose(good, expected_vector(SHORT, DIM), rtol=1e-6)


class Custom(BaseException):
    """A BaseException that is no Exception, as a plugin may raise."""


class Stopping(Recording):
    """A backend whose ``tokenize`` or ``run`` raises ``error``, which is no ordinary Exception."""

    def __init__(self, error: BaseException, where: str) -> None:
        super().__init__()
        self.error = error
        self.where = where

    def tokenize(self, inputs: Sequence[TextInput], max_length: int | None) -> list[Encoding]:
        if self.where == "tokenize":
            raise self.error
        return super().tokenize(inputs, max_length)

    def run(self, batch: Sequence[Encoding]) -> list[np.ndarray]:
        if self.where == "run":
            raise self.error
        return super().run(batch)


@pytest.mark.parametrize("where", ["tokenize", "run"])
@pytest.mark.parametrize("error", [asyncio.CancelledError("plugin"), Custom("custom")],
                         ids=lambda error: type(error).__name__)
def test_a_worker_whose_backend_raises_a_base_exception_stops_and_leaves_the_entry_pending(
    redis_url: str, error: BaseException, where: str,
) -> None:
    """The worker ends with an ordinary error (exit 4 from the command) rather than
    hanging with a dead task while it keeps its claim fresh; the entry stays pending
    for another worker."""
    queue = f"stopping-{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings(redis_url=redis_url, queue=queue, backend="sim", block_ms=100,
                              heartbeat_s=1.0, linger_ms=1)
    q = keys.QueueRef(queue)

    async def main() -> None:
        worker = Worker(settings, Stopping(error, where))
        running = asyncio.create_task(worker.run())
        client = aioredis.Redis.from_url(redis_url)
        try:
            for _ in range(200):
                if await client.exists(keys.config(q)):
                    break
                await asyncio.sleep(0.02)
            request = wire.Request(id="r1", text=SHORT, tokens=0, reply_to=keys.reply(q, "r1"))
            await client.xadd(keys.requests(q), wire.encode_request(request))
            with pytest.raises(Aborted, match=type(error).__name__):
                await asyncio.wait_for(running, 20)
            pending = await client.xpending(keys.requests(q), keys.GROUP)
            assert pending["pending"] == 1
            assert not await client.exists(keys.reply(q, "r1"))
        finally:
            if not running.done():
                worker.stop()
                running.cancel()
            await client.aclose()

    run(main())
