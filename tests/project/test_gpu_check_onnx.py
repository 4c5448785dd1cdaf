"""``scripts/gpu_check.py`` check e (ONNX Runtime's CUDA provider against torch fp16), on the CPU.

Why: the check only ever runs on a CUDA machine with onnxruntime-gpu, where
its answer decides whether ``--runtime onnx`` is offered on CUDA
(docs/decisions/0040-onnx-runtime.md). Everything in it but the provider is checked here, on a
tiny random BERT with the CPU provider: the worker's exporter under the
worker's cache key, the session run through I/O binding on torch tensors'
memory, padding and mean pooling equal to the hf backend's own vectors,
the race's token count and ratio, the fp16 export and its fp32 fallback
(which must say so), the verdict line, and the skip without onnxruntime-gpu.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
onnxruntime = pytest.importorskip("onnxruntime")
if importlib.util.find_spec("onnx") is None:  # looked up, not imported (~1 s of CPU)
    pytest.skip("onnx is not installed", allow_module_level=True)

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import gpu_check  # noqa: E402  (scripts/ is not a package)

from tests.tiny_bert import write_tiny_bert  # noqa: E402
from tokenq.worker.backends.hf.backend import HFBackend, HFOptions  # noqa: E402
from tokenq.worker.backends.hf.load import pad_token_id  # noqa: E402
from tokenq.worker.backends.hf.runtime import TorchEncoder  # noqa: E402

CPU = torch.device("cpu")
BUDGET, MAX_ROWS = 512, 32


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("gpu_check") / "bert", seed=5)


@pytest.fixture(scope="module")
def backend(bert: Path) -> Any:
    loaded = HFBackend.load(HFOptions(model=str(bert), device="cpu", dtype="fp32"))
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def batches(backend: Any) -> list[Any]:
    """The sample texts packed as check d packs them, under a budget the tiny model fits."""
    return gpu_check.packed_batches(backend, BUDGET, MAX_ROWS, repeat=1)


def encoders(bert: Path, cache: Path, dtype: str) -> tuple[Any, Any, Any]:
    """Torch and ONNX encoders of the model in ``dtype`` (CPU provider), and its tokenizer."""
    tokenizer, model, model_dir = gpu_check.load_torch_model(str(bert), dtype)
    uses_type_ids = "token_type_ids" in tokenizer.model_input_names
    path = gpu_check.export_onnx(model, model_dir, uses_type_ids=uses_type_ids,
                                 cache_dir=str(cache))
    session = gpu_check.open_onnx_session(onnxruntime, path, CPU)
    onnx_encoder = gpu_check.BoundOnnxEncoder(session, CPU, int(model.config.hidden_size))
    return TorchEncoder(model, uses_type_ids=uses_type_ids, logits=False), onnx_encoder, tokenizer


@pytest.fixture(scope="module")
def fp32_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export cache of the fp32 tests: one export, shared (each costs seconds of CPU)."""
    return tmp_path_factory.mktemp("onnx-fp32")


@pytest.fixture(scope="module")
def fp32_encoders(bert: Path, fp32_cache: Path) -> tuple[Any, Any, Any]:
    return encoders(bert, fp32_cache, "fp32")


def test_the_race_agrees_and_counts_every_real_token(
    bert: Path, batches: list[Any], fp32_cache: Path, fp32_encoders: tuple[Any, Any, Any],
) -> None:
    torch_encoder, onnx_encoder, tokenizer = fp32_encoders
    padded = [gpu_check.pad(b.payloads, pad_token_id(tokenizer)) for b in batches]
    race = gpu_check.race_runtimes(torch_encoder, onnx_encoder, padded, CPU, rounds=1)
    assert len(batches) > 1 and sum(b.rows for b in batches) == len(gpu_check.all_texts())
    assert race.tokens == sum(b.tokens for b in batches)
    assert race.min_cosine >= 0.9999, race
    assert race.torch_tps > 0 and race.onnx_tps > 0
    assert race.ratio == pytest.approx(race.torch_seconds / race.onnx_seconds)
    # Under the worker's own key: a worker on the same model and dtype reuses the export.
    exported = list(fp32_cache.glob("*/model.onnx"))
    worker = HFBackend.load(HFOptions(
        model=str(bert), device="cpu", dtype="fp32", runtime="onnx",
        onnx_cache_dir=str(fp32_cache),
    ))
    worker.close()
    assert len(exported) == 1 and list(fp32_cache.glob("*/model.onnx")) == exported


def test_padding_and_pooling_are_the_backends(
    backend: Any, batches: list[Any], fp32_encoders: tuple[Any, Any, Any]
) -> None:
    """The vectors the race compares are the worker's (mean pooling, then unit length), on
    every eighth batch: short to long, each padded to its longest row."""
    torch_encoder, onnx_encoder, tokenizer = fp32_encoders
    batches = batches[::8]
    assert len(batches) > 2
    padded = [gpu_check.pad(b.payloads, pad_token_id(tokenizer)) for b in batches]
    expected = np.concatenate([np.stack(backend.run(b.payloads)) for b in batches])
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    for encoder in (torch_encoder, onnx_encoder):
        _seconds, vectors = gpu_check.embed_all(encoder, padded, CPU)
        assert vectors.shape == expected.shape
        np.testing.assert_allclose(vectors, expected, atol=1e-5)


def test_the_fp16_export_is_used_and_a_failed_one_falls_back_to_fp32_saying_so(
    bert: Path, tmp_path: Path, fp32_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer, fp16_model, model_dir = gpu_check.load_torch_model(str(bert), "fp16")
    uses_type_ids = "token_type_ids" in tokenizer.model_input_names
    encoder, note = gpu_check.onnx_encoder_for(
        str(bert), fp16_model, model_dir, uses_type_ids, CPU, str(tmp_path)
    )
    assert encoder.dtype == torch.float16 and note.startswith("fp16 export "), note
    ids = torch.tensor([[2, 10, 11, 3], [2, 12, 3, 0]])
    mask = (ids != 0).long()
    hidden = encoder(ids, mask, torch.zeros_like(ids))
    assert hidden.dtype == torch.float16 and hidden.shape == (2, 4, 32)

    real = gpu_check.export_onnx

    def no_half(model: Any, *args: Any, **kwargs: Any) -> Path:
        if next(model.parameters()).dtype == torch.float16:
            raise RuntimeError("half precision refused\nsecond line")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(gpu_check, "export_onnx", no_half)
    encoder, note = gpu_check.onnx_encoder_for(
        str(bert), fp16_model, model_dir, uses_type_ids, CPU, str(fp32_cache)
    )  # the fp32 export the tests above made (or this makes for them)
    assert encoder.dtype == torch.float32
    assert "NOT fp16" in note and "RuntimeError: half precision refused)" in note, note


@pytest.mark.parametrize(
    ("ratio", "min_cosine", "line"),
    [
        (1.234, 0.9999, "onnx-cuda faster than torch fp16: yes (1.23x)"),
        (0.8, 0.9999, "onnx-cuda faster than torch fp16: no (0.80x)"),
        (1.0, 0.9999, "onnx-cuda faster than torch fp16: no (1.00x)"),
        (
            1.5,
            0.95,
            "onnx-cuda faster than torch fp16: yes (1.50x), "
            "but the vectors disagree (min cosine 0.950000 < 0.999)",
        ),
    ],
)
def test_the_verdict_line(ratio: float, min_cosine: float, line: str) -> None:
    assert gpu_check.verdict(ratio, min_cosine) == line


def test_without_onnxruntime_gpu_the_check_is_skipped_not_failed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    checks: list[Any] = []
    gpu_check.run_check(
        checks, "onnx-cuda vs torch fp16",
        lambda: gpu_check.check_onnx_cuda(None, None, 0, 1, 1, 1, None),
    )
    assert checks[0].skipped and checks[0].ok
    printed = capsys.readouterr().out
    assert printed.startswith(
        "[SKIP] onnx-cuda vs torch fp16: "
        "skipped: onnxruntime-gpu not installed (pip install onnxruntime-gpu)"
    ), printed


def test_the_script_still_skips_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert gpu_check.main([]) == 0
    assert "no CUDA device; skipped" in capsys.readouterr().out
