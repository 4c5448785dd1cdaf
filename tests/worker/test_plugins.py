"""Loading a backend from the ``backend`` setting, and every way it can fail."""

from __future__ import annotations

import re
import sys
import textwrap
import types
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenq.shared.errors import ConfigError
from tokenq.worker.backends.base import Backend
from tokenq.worker.backends.plugins import load_backend
from tokenq.worker.backends.sim import SimBackend
from tokenq.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit

WritePlugin = Callable[[str], str]


@pytest.fixture
def write_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> WritePlugin:
    """Write a module with the given source on a fresh sys.path entry; return its name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"tq_plugin_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    return write


def load(spec: str) -> Backend:
    return load_backend(WorkerSettings(backend=spec))


def test_sim_is_built_from_the_settings() -> None:
    backend = load_backend(WorkerSettings(backend="sim", sim_dim=5))
    assert isinstance(backend, SimBackend)
    assert backend.info.dim == 5


def test_plugin_factory_gets_the_settings(write_plugin: WritePlugin) -> None:
    name = write_plugin(
        """
        from tokenq.worker.backends.sim import SimBackend

        def make(settings):
            return SimBackend(dim=settings.sim_dim + 1)
        """
    )
    backend = load_backend(WorkerSettings(backend=f"{name}:make", sim_dim=3))
    assert isinstance(backend, SimBackend)
    assert backend.info.dim == 4


def test_plugin_factory_may_be_a_dotted_attribute(write_plugin: WritePlugin) -> None:
    name = write_plugin(
        """
        from tokenq.worker.backends.sim import SimBackend

        class Factory:
            @staticmethod
            def create(settings):
                return SimBackend()
        """
    )
    assert isinstance(load(f" {name}:Factory.create "), SimBackend)


@pytest.mark.parametrize("spec", ["nocolon", "a:b:c", "mod:", ":factory", "1mod:f", "a-b:f", ""])
def test_bad_format(spec: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("package.module:factory")):
        load(spec)


def test_module_not_found() -> None:
    with pytest.raises(ConfigError, match=r"module 'tq_no_such_module\.sub' not found") as raised:
        load("tq_no_such_module.sub:make")
    assert "tq_no_such_module.sub:make" in str(raised.value)


def test_module_whose_dependency_is_missing(write_plugin: WritePlugin) -> None:
    name = write_plugin("import tq_missing_dependency\n\ndef make(settings): ...\n")
    with pytest.raises(ConfigError, match="needs 'tq_missing_dependency'") as raised:
        load(f"{name}:make")
    assert name in str(raised.value)


def test_module_that_raises_on_import(write_plugin: WritePlugin) -> None:
    name = write_plugin("raise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError, match="RuntimeError: no GPU here"):
        load(f"{name}:make")


def test_attribute_missing(write_plugin: WritePlugin) -> None:
    name = write_plugin("def make(settings): ...\n")
    with pytest.raises(ConfigError, match="has no attribute 'build'") as raised:
        load(f"{name}:build")
    assert f"{name}:build" in str(raised.value)


def test_attribute_not_callable(write_plugin: WritePlugin) -> None:
    name = write_plugin("make = 42\n")
    with pytest.raises(ConfigError, match="is a int, not a callable"):
        load(f"{name}:make")


def test_factory_raised(write_plugin: WritePlugin) -> None:
    name = write_plugin("def make(settings):\n    raise ValueError('model path missing')\n")
    expected = "factory raised ValueError: model path missing"
    with pytest.raises(ConfigError, match=expected) as raised:
        load(f"{name}:make")
    assert f"{name}:make" in str(raised.value)
    assert isinstance(raised.value.__cause__, ValueError)


def test_factory_returned_something_else(write_plugin: WritePlugin) -> None:
    name = write_plugin("def make(settings):\n    return object()\n")
    with pytest.raises(ConfigError, match="lacks info, tokenize, run, close"):
        load(f"{name}:make")


def test_factory_returned_a_backend_without_close(write_plugin: WritePlugin) -> None:
    name = write_plugin(
        """
        from tokenq.worker.backends.sim import SimBackend

        class Partial:
            info = SimBackend().info
            def tokenize(self, inputs, max_length): ...
            def run(self, batch): ...

        def make(settings):
            return Partial()
        """
    )
    with pytest.raises(ConfigError, match="lacks close"):
        load(f"{name}:make")


def test_factory_returned_a_backend_with_bad_info(write_plugin: WritePlugin) -> None:
    name = write_plugin(
        """
        class Odd:
            info = {"name": "odd"}
            def tokenize(self, inputs, max_length): ...
            def run(self, batch): ...
            def close(self): ...

        def make(settings):
            return Odd()
        """
    )
    with pytest.raises(
        ConfigError, match=re.escape("info must be a tokenq.worker.backends.base.BackendInfo")
    ):
        load(f"{name}:make")


def test_a_task_outside_the_one_vocabulary_is_refused(write_plugin: WritePlugin) -> None:
    name = write_plugin(
        """
        from tokenq.worker.backends.base import BackendInfo

        class Old:
            info = BackendInfo(name="old", model="m", task="score", max_input_tokens=8)
            def tokenize(self, inputs, max_length): ...
            def run(self, batch): ...
            def close(self): ...

        def make(settings):
            return Old()
        """
    )
    with pytest.raises(ConfigError, match=r"info\.task must be one of embed, classify, rerank"):
        load(f"{name}:make")


def test_hf_missing_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenq.worker.backends.hf.backend", None)  # not found
    with pytest.raises(ConfigError, match=re.escape("tokenq.worker.backends.hf.backend")):
        load("hf")


def test_hf_is_imported_lazily_and_called(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("tokenq.worker.backends.hf.backend")
    seen: list[WorkerSettings] = []

    def build_hf_backend(settings: WorkerSettings) -> SimBackend:
        seen.append(settings)
        return SimBackend()

    fake.build_hf_backend = build_hf_backend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tokenq.worker.backends.hf.backend", fake)
    settings = WorkerSettings(backend="hf")
    assert isinstance(load_backend(settings), SimBackend)
    assert seen == [settings]
