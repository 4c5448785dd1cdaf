"""Backend plugins the end-to-end tests load with ``--backend tests.plugins_for_tests:NAME``.

Why a plugin and not a monkeypatch: the worker under test is a real
``python -m tokenq.worker`` process, so the only way to give it a backend
that misbehaves on purpose is the plugin hook a user would use. The worker
runs with the repository root as its working directory (and the tests put it
on ``PYTHONPATH``), so ``tests.plugins_for_tests`` is importable there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from tokenq.shared.errors import DeviceOutOfMemory
from tokenq.shared.settings import BackendSettings
from tokenq.worker.backends.base import Encoding
from tokenq.worker.backends.registry import BackendEntry

OOM_ABOVE_ENV = "TOKENQ_TESTS_OOM_ABOVE_TOKENS"
"""Padded tokens (rows x longest) above which :class:`OomAbove` refuses a batch."""


class OomAbove:
    """A real backend whose device "has room" for at most ``limit`` padded tokens.

    Every batch whose ``rows x longest`` is above ``limit`` raises
    :class:`DeviceOutOfMemory` before reaching the model, exactly as an
    allocation failure would; smaller batches run on the real model. So the
    results of a run that went through OOM splits can be compared with
    direct forwards of the same model. Everything but ``run`` is the wrapped
    backend's (``info``, ``tokenize``, ``windows``, ``normalize``, ...).
    """

    def __init__(self, inner: Any, limit: int) -> None:
        self._inner = inner
        self.limit = limit

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the wrapper itself.
        return getattr(self._inner, name)

    def run(self, batch: Sequence[Encoding]) -> list[np.ndarray]:
        """Refuse batches over the limit; run the rest on the wrapped backend."""
        if batch:
            padded = len(batch) * max(encoding.length for encoding in batch)
            if padded > self.limit:
                raise DeviceOutOfMemory(
                    f"test plugin: {len(batch)} rows x {padded // len(batch)} tokens = "
                    f"{padded} padded tokens, over the {self.limit} that fit"
                )
        return self._inner.run(batch)

    def close(self) -> None:
        self._inner.close()


def hf_oom_above(settings: Any) -> OomAbove:
    """``--backend tests.plugins_for_tests:hf_oom_above``: the HF backend, OOM over a limit.

    The limit comes from the ``TOKENQ_TESTS_OOM_ABOVE_TOKENS`` environment
    variable (WorkerSettings has no field for it, and should not).
    """
    from tokenq.worker.backends.hf.backend import build_hf_backend

    raw = os.environ.get(OOM_ABOVE_ENV)
    if raw is None:
        raise ValueError(f"set {OOM_ABOVE_ENV} to the padded tokens a batch may hold")
    return OomAbove(build_hf_backend(settings), int(raw))


ZERO_LENGTH_MARKER = "<<zero-length>>"


class ZeroLengthTokens:
    """The sim backend, except that a text holding :data:`ZERO_LENGTH_MARKER` tokenizes to
    an encoding of length 0 — output no packer can take, as a tokenizer bug would give."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def tokenize(self, inputs: Sequence[Any], max_length: int | None) -> list[Encoding]:
        import dataclasses

        encodings = self._inner.tokenize(inputs, max_length)
        return [
            dataclasses.replace(encoding, length=0) if ZERO_LENGTH_MARKER in item.text else encoding
            for item, encoding in zip(inputs, encodings, strict=True)
        ]


def sim_zero_length(settings: Any) -> ZeroLengthTokens:
    """``--backend tests.plugins_for_tests:sim_zero_length``."""
    from tokenq.worker.backends.sim import build_sim_backend

    return ZeroLengthTokens(build_sim_backend(settings))


class PickyTokenizer:
    """The sim's tokenizer, except that it refuses any text holding ``refuse me``
    (``ValueError``, as the Backend contract says) and names the process it ran in."""

    def tokenize(self, inputs: Sequence[Any], max_length: int | None) -> list[Encoding]:
        from tokenq.worker.backends.sim import SimTokenizer

        if any("refuse me" in item.text for item in inputs):
            raise ValueError("this tokenizer refuses 'refuse me'")
        return SimTokenizer.tokenize(inputs, max_length)


def broken_tokenizer_factory() -> PickyTokenizer:
    """A tokenizer factory that fails in the child, as a missing vocabulary file would."""
    raise RuntimeError("vocabulary file not found (a test's broken factory)")


class SimClassifier:
    """The sim backend claiming to be a classifier: replies carry its vectors as scores."""

    def __init__(self, inner: Any) -> None:
        import dataclasses

        self._inner = inner
        self.info = dataclasses.replace(inner.info, task="classify", normalized=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def sim_classifier(settings: Any) -> SimClassifier:
    """``--backend tests.plugins_for_tests:sim_classifier``."""
    from tokenq.worker.backends.sim import build_sim_backend

    return SimClassifier(build_sim_backend(settings))


def sim_reranker(settings: Any) -> SimClassifier:
    """``--backend tests.plugins_for_tests:sim_reranker``: the sim claiming to be a
    cross-encoder (``--sim-dim 1``: one score a pair)."""
    import dataclasses

    from tokenq.worker.backends.sim import build_sim_backend

    backend = SimClassifier(build_sim_backend(settings))
    backend.info = dataclasses.replace(backend.info, task="rerank", pairs=True)
    return backend


LOAD_GATE_ENV = "TOKENQ_TESTS_LOAD_GATE"
"""A path: :func:`sim_gated_load` does not finish loading until a file exists there."""


def sim_gated_load(settings: Any) -> Any:
    """``--backend tests.plugins_for_tests:sim_gated_load``: the sim backend, whose "model
    load" lasts until the test creates the file ``TOKENQ_TESTS_LOAD_GATE`` names (at most
    60 s), so a test can look at the worker while it is still loading, for as long as it needs."""
    import time
    from pathlib import Path

    from tokenq.worker.backends.sim import build_sim_backend

    gate = Path(os.environ[LOAD_GATE_ENV])
    deadline = time.monotonic() + 60
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return build_sim_backend(settings)


TOKENIZE_HANG_MARKER = "<<tokenize-hang>>"
TOKENIZER_PIDS_ENV = "TOKENQ_TESTS_TOKENIZER_PIDS"
"""A directory: a :class:`HangingTokenizer` about to hang creates a file named by its pid there."""


class HangingTokenizer:
    """The sim's tokenizer, except that a read holding :data:`TOKENIZE_HANG_MARKER` never
    returns, as a tokenizer stuck in a loop or a lock would; it first names its process in
    the directory ``TOKENQ_TESTS_TOKENIZER_PIDS`` names, so a test can watch that process."""

    def tokenize(self, inputs: Sequence[Any], max_length: int | None) -> list[Encoding]:
        import time
        from pathlib import Path

        from tokenq.worker.backends.sim import SimTokenizer

        if any(TOKENIZE_HANG_MARKER in item.text for item in inputs):
            directory = os.environ.get(TOKENIZER_PIDS_ENV)
            if directory:
                Path(directory, str(os.getpid())).touch()
            while True:
                time.sleep(3600)
        return SimTokenizer.tokenize(inputs, max_length)


class SimHangingTokenizer:
    """The sim backend with a :class:`HangingTokenizer`, in the worker's thread and in
    ``--tokenize-processes`` children alike."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def tokenize(self, inputs: Sequence[Any], max_length: int | None) -> list[Encoding]:
        return HangingTokenizer().tokenize(inputs, max_length)

    def tokenizer_factory(self) -> type[HangingTokenizer]:
        return HangingTokenizer


def sim_hanging_tokenizer(settings: Any) -> SimHangingTokenizer:
    """``--backend tests.plugins_for_tests:sim_hanging_tokenizer``."""
    from tokenq.worker.backends.sim import build_sim_backend

    return SimHangingTokenizer(build_sim_backend(settings))


COMPUTE_US_ENV = "TOKENQ_TESTS_COMPUTE_US_PER_TOKEN"
"""Microseconds of CPU time a :class:`ComputingDevice` spends per padded token of a batch."""


class ComputingDevice:
    """The wrapped backend, whose batches first spend CPU time as a real forward does:
    ``TOKENQ_TESTS_COMPUTE_US_PER_TOKEN`` microseconds of the device thread's own CPU time
    per padded token. Unlike the sim's sleep, which ends on time however long the process
    was stopped, a batch stopped midway (SIGSTOP) still owes the rest once continued."""

    def __init__(self, inner: Any, us_per_token: float) -> None:
        self._inner = inner
        self.us_per_token = us_per_token

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def run(self, batch: Sequence[Encoding]) -> list[np.ndarray]:
        import time

        padded = len(batch) * max((encoding.length for encoding in batch), default=0)
        done = time.thread_time() + padded * self.us_per_token / 1e6
        while time.thread_time() < done:
            pass
        return self._inner.run(batch)


def sim_computing_hanging_tokenizer(settings: Any) -> ComputingDevice:
    """``--backend tests.plugins_for_tests:sim_computing_hanging_tokenizer``: the sim with a
    :class:`HangingTokenizer` and a :class:`ComputingDevice` (its CPU time from
    ``TOKENQ_TESTS_COMPUTE_US_PER_TOKEN``)."""
    return ComputingDevice(sim_hanging_tokenizer(settings), float(os.environ[COMPUTE_US_ENV]))


GREETER = "tests.plugins_for_tests:greeter"
"""The ``--backend`` value of :data:`greeter`."""


class GreeterSettings(BackendSettings):
    """A plugin's own settings: ``--greeter-dim`` / ``TOKENQ_GREETER_DIM``, and nothing in
    ``shared/`` names them."""

    heading: ClassVar[str] = f"--backend {GREETER} (a test plugin)"

    greeter_dim: int = Field(3, ge=1, le=4096, description="size of the greeter's vectors")


def _build_greeter(settings: Any) -> Any:
    from tokenq.worker.backends.sim import SimBackend

    return SimBackend(dim=settings.greeter_dim)


greeter = BackendEntry(name="greeter", settings=GreeterSettings, build=_build_greeter)
"""``--backend tests.plugins_for_tests:greeter``: the sim, sized by its own flag."""
