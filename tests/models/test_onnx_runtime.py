"""``--runtime onnx``: the export cache, and every refusal at start.

That the ONNX runtime answers what the torch runtime answers, family by
family, is tests/models/test_hf_parity.py's job (it runs on both runtimes); here:
an export is written once and reused, its key follows the files and the
options, two workers exporting at once leave one whole entry, and a worker
refuses to start, with the reason named, without the ``onnx`` extra, on
CUDA or in half precision, or on a model family the exporter cannot take or
exports wrongly.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

from tests.tiny_bert import SAMPLE_TEXTS, write_tiny_bert  # noqa: E402
from tests.tiny_models import write_custom_code_bert  # noqa: E402
from tokenq.shared.errors import ConfigError  # noqa: E402
from tokenq.worker.backends.base import TextInput  # noqa: E402
from tokenq.worker.backends.hf import export as export_module  # noqa: E402
from tokenq.worker.backends.hf.backend import HFBackend, HFOptions  # noqa: E402
from tokenq.worker.backends.hf.export import cache_key, default_cache_dir  # noqa: E402
from tokenq.worker.backends.hf.runtime import resolve_runtime  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("onnx") / "bert", seed=7)


def load(path: Path, cache: Path, **options: object) -> HFBackend:
    settings = HFOptions(
        model=str(path), device="cpu", runtime="onnx", onnx_cache_dir=str(cache), **options
    )
    return HFBackend.load(settings)


def rows(backend: HFBackend) -> np.ndarray:
    encodings = backend.tokenize([TextInput(t) for t in SAMPLE_TEXTS], 64)
    return np.stack(backend.run(encodings))


def count_exports(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record every real export (``_write``) from now on."""
    written: list[Path] = []
    real = export_module._write

    def recording(model: object, path: Path, *args: object, **kwargs: object) -> None:
        written.append(path)
        real(model, path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(export_module, "_write", recording)
    return written


# -- the cache --------------------------------------------------------------------


def test_an_export_is_written_once_and_reused(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = count_exports(monkeypatch)
    first = load(bert, tmp_path)
    second = load(bert, tmp_path)
    assert len(written) == 1
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and (entries[0] / "model.onnx").is_file()  # no scratch left
    np.testing.assert_array_equal(rows(first), rows(second))


def test_the_cache_key_follows_the_files_and_the_options(bert: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(bert, tmp_path / "copy")
    facts = {"task": "embed", "inputs": ("input_ids", "attention_mask")}
    key = cache_key(copy, facts)
    assert cache_key(copy, dict(facts)) == key  # stable
    assert cache_key(copy, {**facts, "task": "classify"}) != key
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    assert cache_key(copy, facts) != key  # a rewritten file is a new export


def test_a_hub_cache_link_counts_by_its_blob_name(tmp_path: Path) -> None:
    """A large hub model is not read to be hashed: its blob's name is its content hash."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for digest in ("a" * 64, "b" * 64):
        (blobs / digest).write_bytes(b"same bytes")
    (snapshot / "model.safetensors").symlink_to(blobs / ("a" * 64))
    key = cache_key(snapshot, {})
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(blobs / ("b" * 64))
    assert cache_key(snapshot, {}) != key


def test_cache_folder_default_and_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir(None) == tmp_path / "xdg" / "tokenq" / "onnx"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir(None) == Path.home() / ".cache" / "tokenq" / "onnx"
    assert default_cache_dir(str(tmp_path / "mine")) == tmp_path / "mine"


def test_two_workers_exporting_at_once_leave_one_whole_entry(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loser of the rename race keeps the winner's export and removes its own scratch."""
    real = export_module._write
    racing: list[Path] = []

    def other_worker_wins(model: object, path: Path, *args: object, **kwargs: object) -> None:
        real(model, path, *args, **kwargs)  # type: ignore[arg-type]
        if not racing:  # while this export was written, another worker finished its own
            racing.append(path)
            winner = tmp_path / next(p.name for p in tmp_path.iterdir()).split(".")[1]
            winner.mkdir()
            shutil.copy(path, winner / "model.onnx")
            (winner / "winner").touch()

    monkeypatch.setattr(export_module, "_write", other_worker_wins)
    backend = load(bert, tmp_path)
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert len(entries) == 1, entries  # the winner's, and no scratch folder
    assert (tmp_path / entries[0] / "winner").is_file()
    assert rows(backend).shape[0] == len(SAMPLE_TEXTS)


# -- refusals at start ---------------------------------------------------------------


@pytest.mark.parametrize("missing", ["onnxruntime", "onnx"])
def test_without_the_extra_onnx_is_refused_by_name_and_auto_picks_torch(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # the import fails, as when not installed
    with pytest.raises(ConfigError, match=r"--runtime onnx needs .*pip install 'tokenq\[onnx\]'"):
        load(bert, tmp_path)
    assert resolve_runtime(HFOptions(runtime="auto"), CPU, torch.float32) == "torch"
    backend = HFBackend.load(HFOptions(model=str(bert), device="cpu", runtime="auto"))
    assert backend.info.extra["runtime"] == "torch"
    assert not list(tmp_path.iterdir())


def test_auto_picks_onnx_on_the_cpu_in_fp32_and_torch_otherwise() -> None:
    auto = HFOptions(runtime="auto")
    assert resolve_runtime(auto, CPU, torch.float32) == "onnx"
    assert resolve_runtime(auto, CPU, torch.bfloat16) == "torch"
    assert resolve_runtime(auto, torch.device("cuda", 0), torch.float16) == "torch"
    assert resolve_runtime(HFOptions(runtime="torch"), CPU, torch.float32) == "torch"
    sparse = HFOptions(runtime="auto", task="sparse")  # a SPLADE head runs on torch only
    assert resolve_runtime(sparse, CPU, torch.float32) == "torch"


def test_onnx_is_refused_on_cuda_and_outside_fp32() -> None:
    with pytest.raises(ConfigError, match=r"CPU only, not cuda:0.*--runtime torch"):
        resolve_runtime(HFOptions(runtime="onnx"), torch.device("cuda", 0), torch.float32)
    with pytest.raises(ConfigError, match=r"fp32 only, not bfloat16"):
        resolve_runtime(HFOptions(runtime="onnx"), CPU, torch.bfloat16)


def test_a_family_the_exporter_cannot_take_is_refused_by_name(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Exporting the operator 'aten::weird' to ONNX is not supported")

    monkeypatch.setattr(torch.onnx, "export", refuse)
    with pytest.raises(ConfigError, match=r"cannot take model family 'bert'.*aten::weird"):
        load(bert, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing half-written left in the cache


_SHAPE_DEPENDENT = '''
from transformers import BertModel

from .configuration_tiny_custom import TinyCustomConfig


class TinyCustomModel(BertModel):
    """BERT that shifts its states when a batch has an even number of rows.

    A trace keeps the branch its example batch took, so the export shifts always.
    """

    config_class = TinyCustomConfig

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        if output.last_hidden_state.shape[0] % 2 == 0:
            output.last_hidden_state = output.last_hidden_state + 1.0
        return output
'''


def test_an_export_that_computes_otherwise_is_refused_by_family(bert: Path, tmp_path: Path) -> None:
    path = write_custom_code_bert(tmp_path / "branchy", bert, modeling=_SHAPE_DEPENDENT)
    with pytest.raises(ConfigError, match=r"family 'tiny-custom' does not compute what torch"):
        load(path, tmp_path / "cache", trust_remote_code=True)
    torch_backend = HFBackend.load(
        HFOptions(model=str(path), device="cpu", runtime="torch", trust_remote_code=True)
    )
    assert torch_backend.info.extra["runtime"] == "torch"  # torch still serves it


def test_the_runtime_setting_is_checked_where_settings_are() -> None:
    from types import SimpleNamespace

    from tokenq.worker.settings import WorkerSettings

    assert HFOptions().runtime == "torch"  # the documented default
    with pytest.raises(ConfigError, match=r"runtime"):
        HFOptions.from_settings(SimpleNamespace(runtime="tensorrt"))
    settings = WorkerSettings(runtime="onnx", onnx_cache_dir="/tmp/x")  # type: ignore[call-arg]
    assert HFOptions.from_settings(settings).runtime == "onnx"
