"""What README.md and docs/PRODUCTION.md tell an operator to type, typed against the repository.

Every shell line of their fenced blocks: each ``pip install`` names the
checkout or a wheel it builds and extras pyproject.toml has; each
``tokenq …`` (also after ``kubectl exec … --`` or ``VAR=value``) parses with
the real parser, nothing started; each repository path exists; each
``TOKENQ_*`` they name is a setting. docs/OPERATIONS.md's table of what each
command needs lists every subcommand the dispatcher knows, and the docs say
what ``scripts/setup.sh`` installs. No network, no model, no Redis.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from tests.conftest import REPO_ROOT
from tests.project.doc_lines import fenced_blocks, parses, variants
from tokenq.shared import settings as shared_settings
from tokenq.shared.cli import SUBCOMMANDS
from tokenq.shared.settings import env_var
from tokenq.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit

GUIDES = (REPO_ROOT / "README.md", REPO_ROOT / "docs" / "PRODUCTION.md")
SHELL_LANGUAGES = {"bash", "sh", "shell"}
SHELL_ENDS = {"|", "||", "&", "&&", ";"}
REPO_FOLDERS = ("scripts/", "docker/", "docs/", "tests/")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_EXTRA_NAMES = re.compile(r"\[([a-z0-9_,-]+)\]")
_TOKENQ_VAR = re.compile(r"\bTOKENQ_[A-Z0-9_]+\b")
_REPO_PATH = re.compile(r"(?<![\w/.-])((?:scripts|docker|docs|tests)/[\w./-]*\w)")


@cache
def project() -> dict[str, object]:
    """pyproject.toml's ``[project]`` table (tomllib: Python 3.11+, read only where needed)."""
    import tomllib

    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def extras() -> set[str]:
    return set(project()["optional-dependencies"])  # type: ignore[arg-type]


def shell_lines(doc: Path) -> list[tuple[str, list[str]]]:
    """(where, words) of every line of the doc's bash blocks; ``\\`` joins lines, comments go."""
    found = []
    for language, block in fenced_blocks(doc):
        if language not in SHELL_LANGUAGES:
            continue
        at = 0
        while at < len(block):
            number, text = block[at][0], block[at][1].strip()
            while text.endswith("\\") and at + 1 < len(block):
                at += 1
                text = text[:-1] + " " + block[at][1].strip()
            words = shlex.split(text, comments=True)
            if words:
                found.append((f"{doc.name}:{number}", words))
            at += 1
    return found


def commands(words: list[str]) -> list[list[str]]:
    """Each simple command of a line: split at ``|``, ``&&``, ``;``, ``&``."""
    out: list[list[str]] = [[]]
    for word in words:
        if word in SHELL_ENDS:
            out.append([])
        else:
            out[-1].append(word)
    return [command for command in out if command]


def tokenq_invocations(words: list[str]) -> list[tuple[dict[str, str], list[str]]]:
    """The ``tokenq`` argvs of a line: a command's first word past ``VAR=value``, or the
    word after ``--`` (``kubectl exec … -- tokenq top``); with the variables set before it."""
    found = []
    for command in commands(words):
        start = 0
        while start < len(command) and _ASSIGNMENT.match(command[start]):
            start += 1
        env = dict(word.split("=", 1) for word in command[:start])
        heads = [start] + [i + 1 for i, word in enumerate(command) if word == "--"]
        found += [(env if head == start else {}, command[head:]) for head in heads
                  if head < len(command) and command[head] == "tokenq"]
    return found


def every_line() -> list[tuple[str, list[str]]]:
    return [line for doc in GUIDES for line in shell_lines(doc)]


def known_variables() -> set[str]:
    """Every ``TOKENQ_*`` a tokenq process reads: each settings class's fields."""
    classes = [cls for cls in vars(shared_settings).values()
               if inspect.isclass(cls) and issubclass(cls, BaseSettings)]
    return {env_var(field) for cls in [*classes, WorkerSettings] for field in cls.model_fields}


# ----------------------------------------------------------------- the extraction itself


def test_the_extraction_reads_both_guides():
    lines = every_line()
    assert any(where.startswith("PRODUCTION.md") for where, _ in lines)
    assert any(words[:2] == ["pip", "install"] for _, words in lines)
    assert tokenq_invocations(shlex.split(
        "kubectl -n tokenq exec -it deploy/w -- tokenq top --queue embed | head")) == [
        ({}, ["tokenq", "top", "--queue", "embed"])]
    assert tokenq_invocations(shlex.split("FOO=1 tokenq stats && tokenq --version")) == [
        ({"FOO": "1"}, ["tokenq", "stats"]), ({}, ["tokenq", "--version"])]


# ----------------------------------------------------------------- install lines


def install_problems(words: list[str], doc_text: str) -> list[str]:
    """What is wrong with one ``pip install`` command's targets (empty: nothing)."""
    wrong = []
    for word in words[2:]:
        if word.startswith("-"):
            continue
        name, _, extra = word.partition("[")
        asked = set(extra.rstrip("]").split(",")) - {""}
        if name == "tokenq" or name.startswith("tokenq="):
            wrong.append(f"{word}: no package index has tokenq")
        elif name.endswith(".whl"):
            built = f"dist/tokenq-{project()['version']}-py3-none-any.whl"
            if name != built:
                wrong.append(f"{word}: `pip wheel . -w dist` builds {built}")
            if not re.search(r"pip wheel [^\n]*-w dist", doc_text):
                wrong.append(f"{word}: the doc never builds it (pip wheel --no-deps . -w dist)")
        elif name.startswith((".", "/")):
            if not (REPO_ROOT / name / "pyproject.toml").is_file():
                wrong.append(f"{word}: {name} is not this project's folder")
        elif asked:
            wrong.append(f"{word}: extras on a package that is not tokenq")
        if asked - extras():
            wrong.append(f"{word}: no extra {sorted(asked - extras())} in pyproject.toml")
    return wrong


def test_every_install_line_names_this_checkout_or_its_wheel_and_real_extras():
    wrong, seen = [], 0
    for doc in GUIDES:
        text = doc.read_text(encoding="utf-8")
        for where, words in shell_lines(doc):
            for command in commands(words):
                if command[:2] == ["pip", "install"]:
                    seen += 1
                    wrong += [f"{where}: {why}" for why in install_problems(command, text)]
    assert seen >= 3, "the guides' install lines were not found"
    assert not wrong, "\n".join(wrong)


def test_the_install_check_catches_what_it_is_for():
    text = "pip wheel --no-deps . -w dist"
    assert install_problems(["pip", "install", "-e", ".[worker,serve]"], text) == []
    assert install_problems(["pip", "install", "tokenq[worker]"], text)
    assert install_problems(["pip", "install", "-e", ".[gpu]"], text)
    assert install_problems(["pip", "install", "nowhere/[worker]"], text)
    assert install_problems(["pip", "install", "dist/tokenq-0.0.1-py3-none-any.whl"], text)


# ----------------------------------------------------------------- tokenq command lines


def test_every_tokenq_command_parses(monkeypatch, capsys):
    """Each ``tokenq …`` of both guides, through the real parser; nothing is started."""
    for name in [name for name in os.environ if name.startswith("TOKENQ_")]:
        monkeypatch.delenv(name)
    wrong, seen = [], 0
    for where, words in every_line():
        for env, argv in tokenq_invocations(words):
            seen += 1
            for variant in variants(shlex.join(argv)):
                with monkeypatch.context() as scoped:
                    for name, value in env.items():
                        scoped.setenv(name, value)
                    why = parses(variant, scoped, capsys)
                if why is not None:
                    wrong.append(f"{where}: tokenq {shlex.join(variant)}\n    {why}")
    assert seen >= 10, "the guides' tokenq lines were not found"
    assert not wrong, "command lines that do not parse:\n" + "\n".join(wrong)


def test_an_unknown_flag_is_caught(monkeypatch, capsys):
    assert parses(["serve", "--queue", "embed"], monkeypatch, capsys) is None
    assert parses(["serve", "--queue", "embed", "--tls-cert", "x"], monkeypatch, capsys)
    assert parses(["sevre", "--queue", "embed"], monkeypatch, capsys)


# ----------------------------------------------------------------- paths and variables


def test_every_repository_path_the_guides_name_exists():
    """``bash scripts/x.sh``, ``-f docker/Dockerfile``, ``docs/…``: in code blocks and in prose."""
    wrong, seen = [], 0
    for doc in GUIDES:
        for path in _REPO_PATH.findall(doc.read_text(encoding="utf-8")):
            seen += 1
            if not (REPO_ROOT / path.split("::")[0]).exists():
                wrong.append(f"{doc.name}: {path}")
    for where, words in every_line():
        for command in commands(words):
            if command[0] in ("bash", "sh") and len(command) > 1:
                script = REPO_ROOT / command[1]
                if not script.is_file():
                    wrong.append(f"{where}: bash {command[1]}")
    assert seen >= 5
    assert not wrong, "paths that do not exist:\n" + "\n".join(wrong)


def test_every_tokenq_variable_the_guides_name_is_a_setting():
    known = known_variables()
    named = {(doc.name, name) for doc in GUIDES
             for name in _TOKENQ_VAR.findall(doc.read_text(encoding="utf-8"))}
    assert named, "no TOKENQ_* variable found"
    unknown = sorted(f"{doc}: {name}" for doc, name in named if name not in known)
    assert not unknown, "TOKENQ_* variables no setting reads:\n" + "\n".join(unknown)


# ----------------------------------------------------------------- docs/OPERATIONS.md's needs table


def needs_table() -> dict[str, tuple[str, str]]:
    """``{command: (side, needs)}`` from OPERATIONS.md's ``| command | side | needs |`` table."""
    rows, inside = {}, False
    for line in (REPO_ROOT / "docs" / "OPERATIONS.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells == ["command", "side", "needs"]:
            inside = True
        elif inside and not line.startswith("|"):
            break
        elif inside and cells[0].startswith("`tokenq "):
            rows[cells[0].strip("`").split()[1]] = (cells[1], cells[2])
    return rows


def test_the_needs_table_lists_every_subcommand_with_its_side_and_extra():
    """Derived from the dispatcher: every subcommand, the side its module lives on, the
    extra the dispatcher names when it is missing, and every extra its own module's
    error messages tell the user to install."""
    table = needs_table()
    assert set(table) == set(SUBCOMMANDS), (
        f"missing: {sorted(set(SUBCOMMANDS) - set(table))}, "
        f"not a subcommand: {sorted(set(table) - set(SUBCOMMANDS))}")
    wrong = []
    for name, command in SUBCOMMANDS.items():
        module = command.module
        side, needs = table[name]
        if side != module.split(".")[1]:
            wrong.append(f"tokenq {name}: side {side!r}, its module is {module}")
        named = set(re.findall(r"tokenq\[(\w+)\]", needs))
        if named - extras():
            wrong.append(f"tokenq {name}: no extra {sorted(named - extras())}")
        if command.extra is not None and command.extra not in named:
            wrong.append(f"tokenq {name}: the dispatcher says it needs tokenq[{command.extra}], "
                         f"the table {needs!r}")
        source = Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8")
        told = set(re.findall(r"pip install '?tokenq\[(\w+)\]", source))
        if told - named:
            wrong.append(f"tokenq {name}: its module says install {sorted(told)}, "
                         f"the table {sorted(named) or needs!r}")
    assert not wrong, "\n".join(wrong)


# ----------------------------------------------------------------- what set-up installs


def test_the_docs_say_what_setup_installs():
    """Every doc's ``[worker,dev…]`` is the extras scripts/setup.sh installs, which the demo
    and the test script run."""
    setup = (REPO_ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    [installed] = re.findall(r"-e '\.\[([\w,]+)\]'", setup)
    wanted = set(installed.split(","))
    assert wanted <= extras()
    for script in ("demo.sh", "test.sh"):
        assert "bash scripts/setup.sh" in (REPO_ROOT / "scripts" / script).read_text()
    wrong = []
    for doc in (REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))):
        for found in _EXTRA_NAMES.findall(doc.read_text(encoding="utf-8")):
            stated = set(found.split(","))
            if "dev" in stated and stated != wanted:
                wrong.append(f"{doc.name}: [{found}], setup.sh installs [{installed}]")
    assert not wrong, "\n".join(wrong)


def test_the_production_guide_is_linked():
    assert "docs/PRODUCTION.md" in (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    other = (REPO_ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert re.search(r"Other docs:[^\n]*PRODUCTION\.md", other)
