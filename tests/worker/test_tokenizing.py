"""Tokenizing in child processes (``--tokenize-processes``): same encodings, same errors.

The pool is held to the in-process tokenizer on the sim backend (a Python
tokenizer, the case the pool exists for): equal encodings in input order for
any read, a refused input refused as a ``ValueError`` so the pipeline answers
it alone, a factory that fails refused at start, a child killed mid-life
replaced, and no child left once the pool closes. End to end, a worker with
``--tokenize-processes 2`` answers with the sim's exact vectors.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.plugins_for_tests import (
    TOKENIZE_HANG_MARKER,
    HangingTokenizer,
    PickyTokenizer,
    broken_tokenizer_factory,
)
from tests.support import wait_for
from tests.worker.test_e2e_core import DIM, MAX_INPUT, assert_vector, start_worker  # noqa: F401
from tokenq.producer import Client
from tokenq.shared import wire
from tokenq.shared.errors import ConfigError
from tokenq.worker.backends.base import TextInput, tokenizer_source_of
from tokenq.worker.backends.sim import SimBackend, SimTokenizer
from tokenq.worker.pipeline.pipeline import Admit, Pipeline
from tokenq.worker.pipeline.tokenizing import (
    CLOSE_GRACE_S,
    MIN_SLICE,
    TokenizerPool,
    pool_for,
    slices,
)


@given(st.integers(0, 2000), st.integers(1, 16))
def test_slices_cover_every_input_once_in_order(count: int, processes: int) -> None:
    bounds = slices(count, processes)
    assert 1 <= len(bounds) <= processes
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    if len(bounds) > 1:
        assert min(stop - start for start, stop in bounds) >= MIN_SLICE
        sizes = [stop - start for start, stop in bounds]
        assert max(sizes) - min(sizes) <= 1


def _children() -> set[int]:
    return {child.pid for child in multiprocessing.active_children()}


@pytest.fixture
def pool():
    started = TokenizerPool(SimTokenizer, 2)
    started.start()
    yield started
    started.close()


def inputs_of(texts: list[str]) -> list[TextInput]:
    return [TextInput(text) for text in texts]


MIXED = [
    "a short query",
    "万物 皆有 裂痕 , that is how the light gets in " * 40,
    "plain words " * 700,  # over the limit: truncated when max_length is given
    "émigré naïve café — “quoted” text with punctuation!",
] * 20


@pytest.mark.parametrize("max_length", [None, 64, MAX_INPUT])
def test_the_pool_tokenizes_as_the_backend_does_in_input_order(pool, max_length) -> None:
    inputs = inputs_of(MIXED)
    assert pool.tokenize(inputs, max_length) == SimBackend().tokenize(inputs, max_length)
    pairs = [TextInput("which one?", text) for text in MIXED[:40]]
    assert pool.tokenize(pairs, max_length) == SimBackend().tokenize(pairs, max_length)


def test_a_refused_input_is_refused_as_a_value_error_and_the_pipeline_answers_it_alone() -> None:
    backend = SimBackend(dim=DIM)
    picky = TokenizerPool(PickyTokenizer, 2)
    picky.start()
    try:
        with pytest.raises(ValueError, match="refuses 'refuse me'"):
            picky.tokenize(inputs_of(["fine", "please refuse me"]), None)
        pipeline: Pipeline[int] = Pipeline(backend, tokenizer=picky)
        texts = [f"request number {i}" for i in range(40)] + ["refuse me"]
        items = [
            Admit(ref=i, request=wire.Request(id=f"r{i}", text=text, tokens=0, reply_to="x"),
                  deadline_ms=None, arrived_ms=0.0)
            for i, text in enumerate(texts)
        ]
        admitted = pipeline.admit(items, now_epoch_ms=0)
        assert [answer.ref for answer in admitted.answered] == [40]
        refused = admitted.answered[0].result
        assert isinstance(refused, wire.ErrorInfo)
        assert refused.code == "bad_request" and "refuse me" in refused.message
        assert sorted(job.ref for job in admitted.jobs) == list(range(40))
    finally:
        picky.close()


def test_a_factory_that_fails_in_the_child_fails_the_start_and_leaves_no_child() -> None:
    before = _children()
    broken = TokenizerPool(broken_tokenizer_factory, 2)
    with pytest.raises(ConfigError, match="tokenizer factory failed in a child process"):
        broken.start()
    # The broken pool's own manager thread ends its children; a loaded machine can
    # take a moment to reap the last.
    wait_for(lambda: _children() <= before, 10.0, "the failed pool's children gone")


def test_a_killed_child_is_replaced_and_the_read_still_tokenized(pool) -> None:
    inputs = inputs_of(MIXED)
    expected = SimBackend().tokenize(inputs, None)
    assert pool.tokenize(inputs, None) == expected
    victim = next(iter(pool._executor._processes))
    os.kill(victim, signal.SIGKILL)
    assert pool.tokenize(inputs, None) == expected
    assert pool.tokenize(inputs, None) == expected


def test_closing_the_pool_stops_its_children(pool) -> None:
    children = set(pool._executor._processes)
    assert len(children) == 2
    pool.close()
    # close() has joined or killed each child; the parent reaps a killed one when its
    # exit is seen, which a loaded machine can put off for a moment.
    wait_for(lambda: not children & _children(), 10.0, "the pool's children reaped")
    pool.close()  # twice is fine
    with pytest.raises(RuntimeError, match="not running"):
        pool.tokenize(inputs_of(["after close"]), None)


def test_closing_kills_a_child_whose_tokenizer_hangs_instead_of_waiting_for_it() -> None:
    """The worker closes its pool on the way out: a hung child must not hold its exit."""
    hanging = TokenizerPool(HangingTokenizer, 1)
    hanging.start()
    child = hanging.pids()[0]
    errors: list[BaseException] = []

    def call() -> None:
        try:
            hanging.tokenize(inputs_of([TOKENIZE_HANG_MARKER]), None)
        except Exception as exc:
            errors.append(exc)

    stuck = threading.Thread(target=call, daemon=True)
    stuck.start()
    time.sleep(0.5)  # the call is in the child
    started = time.monotonic()
    hanging.close()
    assert time.monotonic() - started < CLOSE_GRACE_S + 5
    # close() has killed the child; its reaping can land a moment later on a loaded
    # machine (the executor's own thread may be the one that collects its exit).
    wait_for(lambda: child not in _children(), 10.0, "the hung child reaped")
    stuck.join(10)
    assert not stuck.is_alive() and errors  # the caller got an error, not a hang


def test_a_backend_without_a_tokenizer_factory_is_refused_by_name() -> None:
    class FastOnly:
        info = SimBackend().info

        def tokenize(self, inputs, max_length):
            return []

    assert pool_for(SimBackend(), 0) is None
    assert tokenizer_source_of(SimBackend()) is not None
    with pytest.raises(ConfigError, match="sim backend offers no tokenizer factory"):
        pool_for(FastOnly(), 2)  # type: ignore[arg-type]


def test_a_worker_with_tokenize_processes_answers_exact_vectors(
    start_worker, redis_url, queue_name  # noqa: F811
) -> None:
    worker = start_worker("--tokenize-processes", "2")
    texts = [f"passage {i} " + "word " * (i * 7 % 400) for i in range(120)]
    with Client(redis_url=redis_url, queue=queue_name) as client:
        results = client.infer_many(texts, timeout_s=60)
    for text, result in zip(texts, results, strict=True):
        assert_vector(list(result.embedding), text)
    assert worker.terminate() == 0
    assert "stopped" in worker.output()
