"""The simulated GPU's settings and registration; no numpy, so ``--help`` needs no extra."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from tokenq.shared.settings import BackendSettings
from tokenq.worker.backends.registry import BackendEntry


class SimSettings(BackendSettings):
    """The simulated GPU's options (``--backend sim``): a time and memory model for tests."""

    heading: ClassVar[str] = "--backend sim (a simulated GPU)"

    sim_dim: int = Field(32, ge=1, description="embedding dimension")
    sim_max_input_tokens: int = Field(2048, ge=1, description="the model's max input length")
    sim_batch_ms: float = Field(0.5, ge=0, description="fixed time per batch, ms")
    sim_token_us: float = Field(0.05, ge=0, description="time per padded token, us")
    sim_bytes_per_token: int = Field(4096, ge=1, description="device memory per token, bytes")
    sim_capacity_bytes: int = Field(1 << 30, ge=1, description="device memory; past it, OOM")
    sim_ragged: bool = Field(False, description="behave as a varlen (ragged) model")
    sim_pairs: bool = Field(False, description="take (text, text_pair) inputs like a reranker")
    sim_hang_s: float = Field(
        0.0, ge=0, description="a batch holding <<tokenq-sim-hang>> sleeps this long; 0: off"
    )


BACKEND = BackendEntry(
    name="sim", settings=SimSettings, build="tokenq.worker.backends.sim:build_sim_backend"
)
