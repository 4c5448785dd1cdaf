"""run_isolated: one bad row or one too-big batch fails alone; every other row is answered."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.shared.errors import ErrorCode
from tokenq.worker.backends.base import Encoding, TextInput
from tokenq.worker.backends.sim import (
    SIM_FAIL_MARKER,
    SIM_NAN_MARKER,
    SimBackend,
    SimEncoding,
    encode,
    expected_vector,
)
from tokenq.worker.pipeline.execute import FailedRun, Failure, is_out_of_memory, run_isolated

pytestmark = pytest.mark.unit

DIM = 8


class CountingSim(SimBackend):
    """The sim with no modelled time, recording the size of every run attempt."""

    def __init__(self, **kwargs: object) -> None:
        kwargs.setdefault("batch_ms", 0.0)
        kwargs.setdefault("token_us", 0.0)
        kwargs.setdefault("dim", DIM)
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.attempts: list[int] = []

    def run(self, batch: Sequence[Encoding]) -> list[np.ndarray]:
        self.attempts.append(len(batch))
        return super().run(batch)


def encode_all(backend: SimBackend, texts: list[str]) -> list[Encoding]:
    return backend.tokenize([TextInput(t) for t in texts], backend.info.max_input_tokens)


def assert_answers(texts: list[str], results: list[np.ndarray | Failure], bad: set[int]) -> None:
    assert len(results) == len(texts)
    for index, (text, result) in enumerate(zip(texts, results, strict=True)):
        if index in bad:
            assert isinstance(result, Failure), index
        else:
            assert isinstance(result, np.ndarray), (index, result)
            assert np.array_equal(result, expected_vector(text, DIM, 2048)), index


def test_oom_splits_until_every_row_is_answered() -> None:
    # 16 rows of 10 tokens; the device holds 4 rows (40 tokens) at most.
    backend = CountingSim(bytes_per_token=1, capacity_bytes=40)
    texts = [f"row {i} " + "w " * 6 for i in range(16)]
    events: list[FailedRun] = []
    results = run_isolated(backend, encode_all(backend, texts), events)
    assert_answers(texts, results, bad=set())
    assert [e.rows for e in events] == [16, 8, 8]
    assert all(e.reason == "oom" and e.longest == 10 for e in events)
    assert events[0].padded_tokens == 160
    assert backend.attempts == [16, 8, 4, 4, 8, 4, 4]


def test_single_row_that_does_not_fit_fails_with_out_of_memory() -> None:
    backend = CountingSim(bytes_per_token=1, capacity_bytes=20)
    texts = ["small", "big " * 30, "tiny"]
    results = run_isolated(backend, encode_all(backend, texts))
    assert_answers(texts, results, bad={1})
    failure = results[1]
    assert isinstance(failure, Failure)
    assert failure.code == ErrorCode.OUT_OF_MEMORY.value
    assert "DeviceOutOfMemory" in failure.message


def test_poison_row_fails_alone_among_16() -> None:
    backend = CountingSim()
    texts = [f"text number {i}" for i in range(16)]
    texts[11] = f"poisoned {SIM_FAIL_MARKER}"
    errors: list[FailedRun] = []
    results = run_isolated(backend, encode_all(backend, texts), errors)
    assert_answers(texts, results, bad={11})
    failure = results[11]
    assert isinstance(failure, Failure)
    assert failure.code == ErrorCode.INFERENCE_FAILED.value
    assert failure.message.startswith("ValueError:") and SIM_FAIL_MARKER in failure.message
    # 16 -> 8 bad -> 4 bad -> 2 bad -> 1 bad: one failed run per level.
    assert [e.rows for e in errors] == [16, 8, 4, 2, 1]
    assert len(backend.attempts) == 9


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=40),
    data=st.data(),
)
def test_random_poison_positions_fail_exactly_those_rows(n: int, data: st.DataObject) -> None:
    bad = data.draw(st.sets(st.integers(0, n - 1), max_size=n))
    backend = CountingSim()
    texts = [f"{SIM_FAIL_MARKER} {i}" if i in bad else f"good {i}" for i in range(n)]
    results = run_isolated(backend, encode_all(backend, texts))
    assert_answers(texts, results, bad=bad)
    assert all(isinstance(results[i], Failure) for i in bad)
    # Isolation costs at most a full binary tree of runs.
    assert len(backend.attempts) <= 2 * n - 1


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=60), min_size=1, max_size=30),
    capacity=st.integers(min_value=10, max_value=400),
)
def test_oom_never_fails_a_row_that_fits_alone(lengths: list[int], capacity: int) -> None:
    backend = CountingSim(bytes_per_token=1, capacity_bytes=capacity)
    texts = [f"t{i} " + "w " * (length - 1) for i, length in enumerate(lengths)]
    encodings = encode_all(backend, texts)
    too_big = {i for i, e in enumerate(encodings) if e.length > capacity}
    results = run_isolated(backend, encodings)
    assert_answers(texts, results, bad=too_big)
    for i in too_big:
        result = results[i]
        assert isinstance(result, Failure) and result.code == ErrorCode.OUT_OF_MEMORY.value


def test_alike_rows_of_one_run_come_back_as_one_2d_array() -> None:
    backend = CountingSim()
    texts = [f"text {i}" for i in range(5)]
    results = run_isolated(backend, encode_all(backend, texts))
    assert isinstance(results, np.ndarray) and results.shape == (5, DIM)
    assert_answers(texts, list(results), set())


def test_nan_output_fails_only_its_row() -> None:
    backend = CountingSim()
    texts = ["fine", f"{SIM_NAN_MARKER}", "also fine"]
    results = run_isolated(backend, encode_all(backend, texts))
    assert_answers(texts, results, bad={1})
    failure = results[1]
    assert isinstance(failure, Failure)
    assert failure.code == ErrorCode.INFERENCE_FAILED.value and "NaN" in failure.message
    assert backend.attempts == [3]  # a bad output is not a reason to rerun the batch


class ScriptedBackend(CountingSim):
    """Returns what a test scripts, to reach the checks the sim never trips."""

    def __init__(self, answer: object) -> None:
        super().__init__()
        self.answer = answer

    def run(self, batch: Sequence[Encoding]) -> list[np.ndarray]:
        self.attempts.append(len(batch))
        return self.answer(batch)  # type: ignore[operator,no-any-return]


def test_infinite_and_misshapen_outputs_fail() -> None:
    outputs = [np.ones(DIM), np.array([1.0, np.inf]), np.ones((2, 2)), "text", [0.5, 0.25]]
    backend = ScriptedBackend(lambda batch: outputs)
    results = run_isolated(backend, encode_all(backend, ["a", "b", "c", "d", "e"]))
    assert isinstance(results[0], np.ndarray) and results[0].dtype == np.float32
    assert [type(r) for r in results[1:4]] == [Failure, Failure, Failure]
    assert "infinity" in results[1].message  # type: ignore[union-attr]
    assert "(2, 2)" in results[2].message  # type: ignore[union-attr]
    assert isinstance(results[4], np.ndarray) and results[4].tolist() == [0.5, 0.25]


def test_wrong_number_of_outputs_is_treated_as_an_error() -> None:
    backend = ScriptedBackend(lambda batch: [])
    results = run_isolated(backend, encode_all(backend, ["a", "b", "c"]))
    assert all(isinstance(r, Failure) and "returned 0 outputs" in r.message for r in results)


class OutOfMemoryError(RuntimeError):
    """Named like torch.cuda.OutOfMemoryError, which run_isolated must treat as OOM."""


def test_framework_oom_is_recognised_by_name() -> None:
    def answer(batch: Sequence[SimEncoding]) -> list[np.ndarray]:
        if len(batch) > 2:
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [np.ones(DIM, dtype=np.float32) for _ in batch]

    backend = ScriptedBackend(answer)
    runs: list[FailedRun] = []
    results = run_isolated(backend, encode_all(backend, list("abcdefg")), runs)
    assert all(isinstance(r, np.ndarray) for r in results)
    assert [(e.reason, e.rows) for e in runs] == [("oom", 7), ("oom", 3), ("oom", 4)]
    assert is_out_of_memory(OutOfMemoryError()) and is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("out of memory"))


def test_long_messages_are_capped() -> None:
    def answer(batch: Sequence[SimEncoding]) -> list[np.ndarray]:
        raise RuntimeError("x" * 10_000)

    (failure,) = run_isolated(ScriptedBackend(answer), [encode("a")])
    assert isinstance(failure, Failure) and len(failure.message) <= 1000


def test_empty_batch_runs_nothing() -> None:
    backend = CountingSim()
    assert run_isolated(backend, []) == []
    assert backend.attempts == []


@pytest.mark.parametrize("code", [ErrorCode.OUT_OF_MEMORY, ErrorCode.INFERENCE_FAILED])
def test_failure_codes_are_plain_strings(code: ErrorCode) -> None:
    # Failure.code goes on the wire as is; a plain str packs everywhere.
    assert type(Failure(code.value, "m").code) is str
