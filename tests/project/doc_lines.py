"""The command lines of README.md and docs/*.md, read out of their fenced blocks.

``tests/project/test_first_day.py`` parses every ``tokenq …`` line with the
real argument parser; ``tests/project/test_docs_commands.py`` checks the
install lines, script paths and ``TOKENQ_*`` names beside them. Both read
the docs through :func:`fenced_blocks` and parse through :func:`parses`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

DOCS = (REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")))
_FENCE = re.compile(r"^\s*```")
_SHELL_ENDS = {"|", "||", "&", "&&", ";"}
_FENCE_OPEN = re.compile(r"^\s*```\s*([\w-]*)")


def fenced_blocks(doc: Path) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    """(language, [(line number, line)]) for every fenced block of ``doc``."""
    inside, language, block = False, "", []
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        opened = _FENCE_OPEN.match(line)
        if opened and not inside:
            inside, language, block = True, opened.group(1), []
        elif _FENCE.match(line):
            inside = False
            yield language, block
        elif inside:
            block.append((number, line))


class _Parsed(BaseException):
    """Raised by the patched parser: the line parsed, and nothing must run (BaseException,
    so no ``except Exception`` on the way out turns it into an exit status)."""


def doc_command_lines() -> list[tuple[str, str]]:
    """(where, line) for every ``tokenq …`` command in a fenced block of README.md and docs/*.md.

    In a block with ``$`` prompts only the prompted lines are commands (the
    rest is output, which may start with ``tokenq stats:``); in one without,
    every line that starts with ``tokenq``. A trailing ``\\`` joins lines.
    """
    found = []
    for doc in DOCS:
        for _, block in fenced_blocks(doc):
            found += _commands_in(doc.name, block)
    return found


def _commands_in(name: str, block: list[tuple[int, str]]) -> list[tuple[str, str]]:
    prompted = any(line.lstrip().startswith("$ ") for _, line in block)
    out, at = [], 0
    while at < len(block):
        number, line = block[at]
        text = line.strip()
        if prompted:
            if not text.startswith("$ "):
                at += 1
                continue
            text = text[2:].strip()
        while text.endswith("\\") and at + 1 < len(block):
            at += 1
            text = text[:-1] + " " + block[at][1].strip()
        if text.startswith("tokenq ") or text == "tokenq":
            out.append((f"{name}:{number}", text))
        at += 1
    return out


def variants(line: str) -> list[list[str]]:
    """The argv lists a documented line stands for: ``[--json]`` with and without,
    ``list|retry|purge`` each; cut at a pipe, ``&`` or redirection."""
    words = []
    for word in shlex.split(line, comments=True)[1:]:
        if word in _SHELL_ENDS or word.startswith((">", "2>")):
            break
        words.append(word)
    argvs: list[list[str]] = [[]]
    for word in words:
        if word.startswith("[") and word.endswith("]"):
            argvs = [*argvs, *[[*argv, word[1:-1]] for argv in argvs]]
        elif "|" in word and not word.startswith("-") and "/" not in word:
            argvs = [[*argv, choice] for argv in argvs for choice in word.split("|")]
        else:
            argvs = [[*argv, word] for argv in argvs]
    return argvs


def parses(argv: list[str], monkeypatch: pytest.MonkeyPatch,
           capsys: pytest.CaptureFixture[str]) -> str | None:
    """None when ``tokenq ARGV`` parses with the real parser (nothing is run), else why not."""
    from tokenq.shared import cli
    from tokenq.worker import cli as worker_cli

    real = cli.parse_settings

    def parse_only(*args: object, **kwargs: object) -> object:
        real(*args, **kwargs)  # type: ignore[arg-type]
        raise _Parsed

    monkeypatch.setattr(cli, "parse_settings", parse_only)
    monkeypatch.setattr(worker_cli, "parse_settings", parse_only)
    capsys.readouterr()
    try:
        status = cli.main(argv)
    except _Parsed:
        return None
    except SystemExit as exc:
        status = exc.code  # type: ignore[assignment]
    said = capsys.readouterr()
    if argv[:1] in (["--version"], ["--help"]) and status == 0:
        return None
    return f"exit {status}: {(said.err or said.out).strip()[-400:]}"


