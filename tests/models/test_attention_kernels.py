"""The torch runtime's forward on CUDA runs without cuDNN's fused attention.

Why it matters (measured on an H200, docs/BENCHMARKS.md, "gpu"): cuDNN builds
an execution plan for each new (rows, length) shape, and a worker's
token-budget batches are nearly all new shapes, so each batch paid ~50 ms
of planning for a 4-7 ms forward. These tests run without a GPU: entering
the context only sets torch's backend flags, and the encoder's wiring is
checked by telling it its model lives on CUDA.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tokenq.worker.backends.hf.runtime import TorchEncoder, attention_kernels  # noqa: E402

FLAGS = {
    "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
    "flash": torch.backends.cuda.flash_sdp_enabled,
    "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    "math": torch.backends.cuda.math_sdp_enabled,
}


def flags() -> dict[str, bool]:
    return {name: read() for name, read in FLAGS.items()}


def test_on_cuda_every_attention_kernel_but_cudnns_stays_allowed_and_all_come_back() -> None:
    before = flags()
    assert before["cudnn"], "torch's default allows cuDNN attention; the test needs that"
    with attention_kernels(torch.device("cuda", 0))():
        inside = flags()
    assert inside == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert flags() == before


def test_on_the_cpu_nothing_changes() -> None:
    before = flags()
    with attention_kernels(torch.device("cpu"))():
        assert flags() == before
    assert flags() == before


class Recorder(torch.nn.Module):
    """A stand-in transformer that notes whether cuDNN attention was allowed when called."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.cudnn_allowed: list[bool] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple:
        self.cudnn_allowed.append(torch.backends.cuda.cudnn_sdp_enabled())
        return (input_ids.float() * self.weight,)


def test_the_torch_encoder_runs_a_cuda_models_forward_without_cudnn_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = torch.tensor([[1, 2, 3]])
    mask = torch.ones_like(ids)
    on_cpu = Recorder()
    TorchEncoder(on_cpu, uses_type_ids=False, logits=False)(ids, mask, mask)
    on_cuda = Recorder()
    on_cuda_weights = SimpleNamespace(device=torch.device("cuda", 0))  # where the encoder looks
    monkeypatch.setattr(on_cuda, "parameters", lambda: iter([on_cuda_weights]))
    output = TorchEncoder(on_cuda, uses_type_ids=False, logits=False)(ids, mask, mask)
    assert on_cpu.cudnn_allowed == [True]
    assert on_cuda.cudnn_allowed == [False]
    assert torch.equal(output, ids.float())
    assert torch.backends.cuda.cudnn_sdp_enabled()
