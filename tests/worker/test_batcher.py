"""The in-process asyncio Batcher, driven against the sim backend."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

import numpy as np
import pytest

from tokenq.shared.errors import BadRequest, ConfigError, DeviceLost, ErrorCode, RemoteError
from tokenq.shared.packer import CostModel
from tokenq.worker.backends.base import Encoding, TextInput
from tokenq.worker.backends.sim import SIM_FAIL_MARKER, SIM_NAN_MARKER, SimBackend, expected_vector
from tokenq.worker.local.batcher import Batcher, BatcherOptions

pytestmark = pytest.mark.unit

T = TypeVar("T")
DIM = 16


def run(awaitable: Awaitable[T]) -> T:
    async def main() -> T:
        return await awaitable

    return asyncio.run(main())


class SpySim(SimBackend):
    """The sim, recording the token lengths of every batch it is asked to run."""

    def __init__(self, **kwargs: object) -> None:
        kwargs.setdefault("dim", DIM)
        kwargs.setdefault("batch_ms", 0.2)
        kwargs.setdefault("token_us", 0.01)
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.shapes: list[list[int]] = []

    def run(self, batch: Sequence[Encoding]) -> list[np.ndarray]:
        self.shapes.append([encoding.length for encoding in batch])
        return super().run(batch)


async def on_the_device(backend: SpySim) -> None:
    """Return once the backend has started its first batch."""
    while not backend.shapes:
        await asyncio.sleep(0.001)


def mixed_texts(count: int, seed: int = 7) -> list[str]:
    """English and CJK texts from 1 to ~400 tokens, some over the model's limit."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "naïve", "x1", "?", "日本", "한국어", "テスト"]
    return [
        " ".join(rng.choice(words) for _ in range(rng.choice([1, 3, 10, 40, 120, 400])))
        for _ in range(count)
    ]


def test_500_concurrent_submits_get_their_own_vectors_within_budget() -> None:
    backend = SpySim(max_input_tokens=256)
    texts = mixed_texts(500)

    async def main() -> list[np.ndarray]:
        async with Batcher(
            backend, max_batch_tokens=1024, max_batch_size=32, linger_ms=2
        ) as batcher:
            return await asyncio.gather(*(batcher.submit(text) for text in texts))

    vectors = run(main())
    for text, vector in zip(texts, vectors, strict=True):
        assert np.array_equal(vector, expected_vector(text, DIM, max_input_tokens=256))
    assert sum(len(shape) for shape in backend.shapes) == 500
    assert max(max(shape) for shape in backend.shapes) == 256  # truncated, not refused
    for shape in backend.shapes:
        assert len(shape) <= 32
        assert len(shape) * max(shape) <= 1024
    assert len(backend.shapes) < 250  # batched, not one by one


def test_ragged_backend_budgets_the_sum() -> None:
    backend = SpySim(max_input_tokens=128, ragged=True)
    texts = mixed_texts(200, seed=3)

    async def main() -> Batcher:
        async with Batcher(backend, max_batch_tokens=300, max_batch_size=64, linger_ms=1) as b:
            assert b.budget.cost_model is CostModel.RAGGED
            await b.submit_many(texts)
            return b

    batcher = run(main())
    assert all(sum(shape) <= 300 for shape in backend.shapes)
    assert batcher.stats.rows == 200 and batcher.stats.failed == 0


def test_lone_request_waits_about_linger_then_goes() -> None:
    async def main() -> float:
        async with Batcher(SpySim(), max_batch_tokens=4096, max_batch_size=8, linger_ms=80) as b:
            started = time.monotonic()
            await b.submit("all alone")
            return time.monotonic() - started

    elapsed = run(main())
    assert 0.07 <= elapsed < 2.0


def test_sealed_batch_does_not_linger() -> None:
    async def main() -> float:
        async with Batcher(
            SpySim(), max_batch_tokens=4096, max_batch_size=1, linger_ms=10_000
        ) as b:
            started = time.monotonic()
            await b.submit("fills the batch by itself")
            return time.monotonic() - started

    assert run(main()) < 2.0


def test_input_accumulates_while_the_device_is_busy() -> None:
    backend = SpySim(batch_ms=200)

    async def main() -> None:
        async with Batcher(backend, max_batch_tokens=4096, max_batch_size=64, linger_ms=0) as b:
            first = asyncio.ensure_future(b.submit("first"))
            await on_the_device(backend)
            await asyncio.gather(first, *(b.submit(f"later {i}") for i in range(20)))

    run(main())
    assert [len(shape) for shape in backend.shapes] == [1, 20]


def test_poison_input_raises_only_for_itself() -> None:
    backend = SpySim()
    texts = [f"good {i}" for i in range(30)]
    texts[17] = f"bad {SIM_FAIL_MARKER}"

    async def main() -> list[np.ndarray | BaseException]:
        async with Batcher(backend, max_batch_tokens=4096, max_batch_size=64, linger_ms=5) as b:
            results = await asyncio.gather(*(b.submit(t) for t in texts), return_exceptions=True)
            assert b.stats.error_events >= 1 and b.stats.failed == 1
            return results

    results = run(main())
    error = results[17]
    assert isinstance(error, RemoteError)
    assert error.code == ErrorCode.INFERENCE_FAILED.value
    assert "ValueError" in error.message
    for index, (text, result) in enumerate(zip(texts, results, strict=True)):
        if index != 17:
            assert isinstance(result, np.ndarray)
            assert np.array_equal(result, expected_vector(text, DIM))


def test_nan_output_raises_inference_failed() -> None:
    async def main() -> None:
        async with Batcher(SpySim(), max_batch_tokens=4096, max_batch_size=8, linger_ms=1) as b:
            with pytest.raises(RemoteError) as raised:
                await b.submit(SIM_NAN_MARKER)
            assert raised.value.code == ErrorCode.INFERENCE_FAILED.value
            assert isinstance(await b.submit("still fine"), np.ndarray)

    run(main())


def test_oom_splits_and_only_an_oversized_row_fails() -> None:
    # Each row alone fits (<= 64 tokens); the device holds 128 padded tokens,
    # but the budget (the user's guess) allows 512.
    backend = SpySim(max_input_tokens=64, bytes_per_token=1, capacity_bytes=128)
    texts = [" ".join(["w"] * 40) + f" {i}" for i in range(12)]

    async def main() -> Batcher:
        async with Batcher(backend, max_batch_tokens=512, max_batch_size=64, linger_ms=5) as b:
            vectors = await b.submit_many(texts)
            for text, vector in zip(texts, vectors, strict=True):
                assert np.array_equal(vector, expected_vector(text, DIM, 64))
            return b

    batcher = run(main())
    assert batcher.stats.oom_events >= 1 and batcher.stats.failed == 0
    # The budget came down after the OOM, but not below one full-length input.
    assert 64 <= batcher.budget.max_batch_tokens < 512

    tiny = SpySim(max_input_tokens=64, bytes_per_token=1, capacity_bytes=10)

    async def too_big() -> None:
        async with Batcher(tiny, max_batch_tokens=64, max_batch_size=8, linger_ms=1) as b:
            with pytest.raises(RemoteError) as raised:
                await b.submit("this text has more than ten tokens in it for sure, yes")
            assert raised.value.code == ErrorCode.OUT_OF_MEMORY.value

    run(too_big())


def test_budget_settles_below_the_device_after_repeated_ooms() -> None:
    backend = SpySim(max_input_tokens=64, bytes_per_token=1, capacity_bytes=128)
    texts = [" ".join(["w"] * 40) + f" {i}" for i in range(12)]  # 43 tokens each

    async def main() -> list[int]:
        ooms_per_round = []
        async with Batcher(backend, max_batch_tokens=512, max_batch_size=64, linger_ms=1) as b:
            for _ in range(8):
                before = b.stats.oom_events
                await b.submit_many(texts)
                ooms_per_round.append(b.stats.oom_events - before)
            assert b.budget.max_batch_tokens <= 128
        return ooms_per_round

    ooms_per_round = run(main())
    assert ooms_per_round[0] > 0 and ooms_per_round[-1] == 0


def test_budget_below_max_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as raised:
        Batcher(SpySim(max_input_tokens=512), max_batch_tokens=256, max_batch_size=8, linger_ms=1)
    assert "256" in str(raised.value) and "512" in str(raised.value)
    with pytest.raises(ConfigError):
        Batcher(SpySim(), max_batch_tokens=4096, max_batch_size=0, linger_ms=1)
    with pytest.raises(ConfigError):
        Batcher(SpySim(), max_batch_tokens=4096, max_batch_size=8, linger_ms=1,
                options=BatcherOptions(cost_model="flat"))


@pytest.mark.parametrize("bad", [None, 42, b"bytes", "", "   \n"])
def test_bad_input_raises_bad_request_at_once(bad: object) -> None:
    async def main() -> None:
        batcher = Batcher(SpySim(pairs=True), max_batch_tokens=4096, max_batch_size=8, linger_ms=1)
        with pytest.raises(BadRequest):
            await batcher.submit(bad)  # type: ignore[arg-type]
        with pytest.raises(BadRequest):
            await batcher.submit("fine", bad if bad is not None else 3)  # type: ignore[arg-type]
        with pytest.raises(BadRequest):
            await batcher.submit_many(["fine", bad])  # type: ignore[list-item]
        assert batcher.stats.submitted == 0  # nothing was queued
        await batcher.aclose()

    run(main())


def test_submit_many_keeps_order_and_can_return_exceptions() -> None:
    texts = ["one", f"two {SIM_FAIL_MARKER}", "three 三"]

    async def main() -> None:
        async with Batcher(SpySim(), max_batch_tokens=4096, max_batch_size=8, linger_ms=1) as b:
            results = await b.submit_many(texts, return_exceptions=True)
            assert np.array_equal(results[0], expected_vector("one", DIM))
            assert isinstance(results[1], RemoteError)
            assert np.array_equal(results[2], expected_vector("three 三", DIM))
            with pytest.raises(RemoteError):
                await b.submit_many(texts)
            with pytest.raises(BadRequest):
                await b.submit_many("not a list")

    run(main())


def test_pairs_go_to_a_pair_model_only() -> None:
    async def main() -> None:
        async with Batcher(
            SpySim(pairs=True), max_batch_tokens=4096, max_batch_size=8, linger_ms=1
        ) as b:
            scores = await b.submit_many(["q", "q"], ["passage one", "passage two"])
            assert np.array_equal(scores[0], expected_vector("q", DIM, text_pair="passage one"))
            single = await b.submit("q", "passage two")
            assert np.array_equal(single, scores[1])
        async with Batcher(SpySim(), max_batch_tokens=4096, max_batch_size=8, linger_ms=1) as b:
            with pytest.raises(BadRequest, match="single texts"):
                await b.submit("q", "passage")

    run(main())


def test_close_drains_what_was_submitted() -> None:
    async def main() -> None:
        batcher = Batcher(SpySim(), max_batch_tokens=4096, max_batch_size=64, linger_ms=60_000)
        tasks = [asyncio.ensure_future(batcher.submit(f"text {i}")) for i in range(10)]
        await asyncio.sleep(0.01)
        started = time.monotonic()
        await batcher.aclose()
        assert time.monotonic() - started < 2.0  # no lingering on the way out
        assert all(task.done() and not task.exception() for task in tasks)
        with pytest.raises(RuntimeError, match="closed"):
            await batcher.submit("too late")

    run(main())


def test_a_cancelled_caller_does_not_disturb_the_others() -> None:
    backend = SpySim(batch_ms=200)

    async def main() -> None:
        async with Batcher(backend, max_batch_tokens=4096, max_batch_size=64, linger_ms=0) as b:
            busy = asyncio.ensure_future(b.submit("keeps the device busy"))
            await on_the_device(backend)
            doomed = asyncio.ensure_future(b.submit("nobody waits for me"))
            kept = [asyncio.ensure_future(b.submit(f"wanted {i}")) for i in range(3)]
            await asyncio.sleep(0.01)
            doomed.cancel()
            await asyncio.gather(busy, *kept)

    run(main())
    assert sorted(len(shape) for shape in backend.shapes) == [1, 3]  # the cancelled one never ran


class PickySim(SpySim):
    """A backend whose tokenizer refuses one input, as a real one may."""

    def tokenize(self, inputs: Sequence[TextInput], max_length: int | None) -> list[Encoding]:
        if any("refuse me" in item.text for item in inputs):
            raise ValueError("unsupported characters")
        return super().tokenize(inputs, max_length)


def test_tokenizer_refusal_fails_only_that_request() -> None:
    async def main() -> None:
        async with Batcher(PickySim(), max_batch_tokens=4096, max_batch_size=8, linger_ms=1) as b:
            results = await b.submit_many(["ok", "refuse me", "ok too"], return_exceptions=True)
            assert isinstance(results[0], np.ndarray) and isinstance(results[2], np.ndarray)
            error = results[1]
            assert isinstance(error, RemoteError) and error.code == ErrorCode.BAD_REQUEST.value
            assert "unsupported characters" in error.message

    run(main())


@pytest.mark.parametrize("broken", ["add_all", "next_batch"])  # the tokenizer's, the device's
def test_a_dying_task_fails_callers_instead_of_hanging(broken: str) -> None:
    async def main() -> None:
        batcher = Batcher(SpySim(), max_batch_tokens=4096, max_batch_size=8, linger_ms=1)
        packer = batcher._packer

        def bug(*args: object, **kwargs: object) -> None:
            if broken == "add_all" or len(packer):
                raise RuntimeError("packer bug")

        setattr(packer, broken, bug)  # simulate a tokenq bug in one of the two tasks
        with pytest.raises(RemoteError, match="batcher stopped: RuntimeError: packer bug"):
            await asyncio.wait_for(batcher.submit("anything"), timeout=5)
        await asyncio.wait_for(batcher.aclose(), timeout=5)  # logs the dead task, no raise
        with pytest.raises(RuntimeError, match="closed"):
            await batcher.submit("after the crash")

    run(main())


@pytest.mark.parametrize("bad", [-1, 10, True, 0.5])
def test_a_bad_priority_raises_bad_request_and_queues_nothing(bad: object) -> None:
    async def main() -> None:
        batcher = Batcher(SpySim(), max_batch_tokens=4096, max_batch_size=8, linger_ms=1)
        with pytest.raises(BadRequest, match="priority"):
            await batcher.submit("fine", priority=bad)  # type: ignore[arg-type]
        with pytest.raises(BadRequest, match="priority"):
            await batcher.submit_many(["fine", "also fine"], priority=bad)  # type: ignore[arg-type]
        assert batcher.stats.submitted == 0
        await batcher.aclose()

    run(main())


class Interrupted(BaseException):
    """A BaseException that is no Exception, as a plugin may raise."""


class StoppingSim(SpySim):
    """A backend whose second batch raises ``error`` from ``run`` (it has started others)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(batch_ms=20)
        self.error = error

    def run(self, batch: Sequence[Encoding]) -> list[np.ndarray]:
        rows = super().run(batch)
        if len(self.shapes) == 2:
            raise self.error
        return rows


@pytest.mark.parametrize("error", [
    asyncio.CancelledError("from an async plugin"), Interrupted("custom"),
    KeyboardInterrupt(), SystemExit(3), DeviceLost("sticky CUDA error"),
], ids=lambda error: type(error).__name__)
def test_a_batch_whose_run_raises_anything_answers_every_caller(error: BaseException) -> None:
    backend = StoppingSim(error)

    async def main() -> None:
        batcher = Batcher(backend, max_batch_tokens=4096, max_batch_size=4, linger_ms=1)
        callers = [asyncio.ensure_future(batcher.submit(f"text {i}")) for i in range(12)]
        _, waiting = await asyncio.wait(callers, timeout=10)
        assert not waiting, f"{len(waiting)} of 12 callers still waiting"
        await asyncio.wait_for(batcher.aclose(), timeout=5)
        failed = [caller.exception() for caller in callers if caller.exception() is not None]
        answered = [caller.result() for caller in callers if caller.exception() is None]
        # The first batch ran before the failure; the failed batch and all behind it fail.
        assert len(answered) == 4 and len(failed) == 8
        assert all(isinstance(exc, RemoteError) and exc.code == ErrorCode.INFERENCE_FAILED.value
                   and "batcher stopped" in exc.message and type(error).__name__ in exc.message
                   for exc in failed)
        with pytest.raises(RuntimeError, match="closed"):
            await batcher.submit("after the failure")

    run(main())  # the event loop survives: nothing escapes it
    assert len(backend.shapes) == 2


class RefusingSim(SpySim):
    """A backend whose tokenizer raises ``error`` (no ordinary Exception) on one input."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def tokenize(self, inputs: Sequence[TextInput], max_length: int | None) -> list[Encoding]:
        if any("poison" in item.text for item in inputs):
            raise self.error
        return super().tokenize(inputs, max_length)


@pytest.mark.parametrize("error", [
    asyncio.CancelledError("from an async plugin"), Interrupted("custom"), KeyboardInterrupt(),
], ids=lambda error: type(error).__name__)
def test_a_tokenizer_that_raises_anything_fails_the_callers_and_spares_the_loop(
    error: BaseException,
) -> None:
    async def main() -> None:
        batcher = Batcher(RefusingSim(error), max_batch_tokens=4096, max_batch_size=4,
                          linger_ms=1)
        callers = [asyncio.ensure_future(batcher.submit(text))
                   for text in ["fine", "poison", "also fine"]]
        _, waiting = await asyncio.wait(callers, timeout=10)
        assert not waiting
        await asyncio.wait_for(batcher.aclose(), timeout=5)
        assert all(isinstance(caller.exception(), RemoteError) for caller in callers)

    run(main())  # returns: nothing escaped the event loop
