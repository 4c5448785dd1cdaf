"""A backend owns its settings: a plugin declares a flag, and ``tokenq worker`` has it.

The plugin is ``tests.plugins_for_tests:greeter``, a ``BackendEntry`` whose
``GreeterSettings`` declare ``--greeter-dim``; nothing in ``shared/`` names
it. Its flag is listed under its own heading in ``--help`` (with its
``TOKENQ_*`` variable), read from the command line and from the
environment, and the flags of the other backends are refused under it (and
its own under them).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.plugins_for_tests import GREETER, GreeterSettings
from tokenq.shared.flags import UsageError, parse_settings
from tokenq.worker.backends.plugins import load_backend
from tokenq.worker.backends.registry import registered
from tokenq.worker.settings import WorkerSettings, chosen_backend, settings_class_for

pytestmark = pytest.mark.unit

PROG = "tokenq worker"


@pytest.fixture(autouse=True)
def _no_tokenq_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("TOKENQ_")]:
        monkeypatch.delenv(name)


def parse(argv: list[str]) -> object:
    """What ``tokenq worker ARGV`` parses to, with the class ``tokenq worker`` picks."""
    return parse_settings(settings_class_for(argv), argv, PROG)


def test_the_plugins_flag_and_variable_are_listed_under_its_heading(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tokenq.worker import cli as worker_cli

    with pytest.raises(SystemExit) as exited:
        worker_cli.main(["--backend", GREETER, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    heading = f"{GreeterSettings.heading}:"
    assert heading in text
    section = text.split(heading, 1)[1].split("\n\n", 2)
    own = "\n".join(section[:2])
    assert "TOKENQ_GREETER_DIM" in own and "--greeter-dim" in own
    assert "size of the greeter's vectors (default: 3)" in " ".join(own.split())
    # The built-in backends keep their own headings.
    assert "--backend sim (a simulated GPU):" in text and "--backend hf" in text


def test_the_plugins_flag_is_read_from_the_command_line() -> None:
    settings = parse(["--backend", GREETER, "--greeter-dim", "7"])
    assert settings.greeter_dim == 7  # type: ignore[attr-defined]
    assert load_backend(settings).info.dim == 7


def test_the_plugins_variable_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENQ_BACKEND", GREETER)
    monkeypatch.setenv("TOKENQ_GREETER_DIM", "5")
    assert chosen_backend([]) == GREETER
    settings = parse([])
    assert settings.greeter_dim == 5  # type: ignore[attr-defined]
    assert load_backend(settings).info.dim == 5


def test_the_plugins_flag_is_checked_by_its_own_bounds() -> None:
    with pytest.raises(UsageError, match=r"--greeter-dim / TOKENQ_GREETER_DIM"):
        parse(["--backend", GREETER, "--greeter-dim", "0"])


def test_another_backends_flag_is_refused_by_name() -> None:
    with pytest.raises(UsageError, match=r"--backend tests.plugins_for_tests:greeter ignores "
                                         r"--sim-dim: it is an option of --backend sim"):
        parse(["--backend", GREETER, "--sim-dim", "4"])
    with pytest.raises(UsageError, match=r"--backend sim ignores --model"):
        parse(["--backend", "sim", "--model", "x"])


def test_the_plugins_flag_does_not_exist_under_another_backend(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(["--backend", "sim", "--greeter-dim", "4"])
    assert exited.value.code == 2
    assert "--greeter-dim" in capsys.readouterr().err


def test_the_built_in_backends_are_registered_with_their_settings() -> None:
    names = {entry.name: entry for entry in registered()}
    assert {"hf", "sim"} <= set(names)
    for entry in names.values():
        assert issubclass(WorkerSettings, entry.settings)
        assert entry.settings.heading


def test_shared_names_no_backend() -> None:
    """Adding a backend edits no file of ``shared/``: none names one."""
    for path in Path(REPO_ROOT, "shared").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for word in ("greeter", "sim_dim", "HFSettings", "SimSettings", "trust_remote_code"):
            assert word not in text, f"{path.name} names {word}"
