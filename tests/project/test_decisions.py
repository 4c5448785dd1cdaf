"""docs/decisions/ holds one short record per decision, and every reference to one resolves.

Each record is ``NNNN-slug.md`` (numbers in order from 0001) with a title, a status
(``accepted`` or ``superseded by`` an existing, later record), context, decision and
consequences, and no work-log references; the README's index lists each record once with
its title and status. Any ``docs/decisions/NNNN-*.md`` named in the code or the docs exists,
and nothing names the notebook the records replaced. Nothing but CHANGELOG.md says which
issue, stop or round produced something: that history belongs in commit messages.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "docs" / "decisions"
NAME = re.compile(r"(\d{4})-[a-z0-9]+(?:-[a-z0-9]+)*\.md")
STATUS = re.compile(r"Status: (accepted|superseded by \[(\d{4})\]\((\d{4}-[a-z0-9-]+\.md)\))$")
WORK_LOG = re.compile(
    r"\bissues? \d+|\bstop \d+|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth"
    r"|tenth|eleventh|twelfth|hardening|adversary's) round\b|\bround (?:one|two|three|four|five)\b"
    r"|\(round \d|\b\d{1,2} (?:November|December)\b",
    re.IGNORECASE,
)
SOURCES = ("*.py", "*.md", "*.sh", "*.lua", "*.toml", "*.yaml")
SKIP = {".venv", ".git", "node_modules"}
NOTEBOOK = "DECISIONS" + ".md"  # the notebook the records replaced (spelt so this file passes)


def records() -> list[Path]:
    return sorted(p for p in FOLDER.glob("*.md") if p.name != "README.md")


def test_records_are_numbered_in_order() -> None:
    names = [p.name for p in records()]
    assert len(names) > 20
    assert [n for n in names if not NAME.fullmatch(n)] == []
    numbers = [NAME.fullmatch(n).group(1) for n in names]
    assert numbers == [f"{i:04d}" for i in range(1, len(names) + 1)]


@pytest.mark.parametrize("path", records(), ids=lambda p: p.name[:4])
def test_a_record_has_its_parts(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith(f"# {path.name[:4]}. ")
    status = STATUS.fullmatch(lines[1])
    assert status, f"{path.name}: second line is not a status: {lines[1]!r}"
    if status.group(2):
        replacement = FOLDER / status.group(3)
        assert replacement.exists() and status.group(3).startswith(status.group(2))
        assert status.group(2) > path.name[:4], "a record is superseded by a later one"
    text = "\n".join(lines)
    parts = ("**Context.**", "**Decision.**", "**Consequences.**")
    assert [part for part in parts if part not in text] == []
    assert 8 <= len(lines) <= 40
    assert WORK_LOG.findall(text) == []


def test_the_index_lists_every_record_with_its_title_and_status() -> None:
    index = (FOLDER / "README.md").read_text(encoding="utf-8")
    for path in records():
        lines = path.read_text(encoding="utf-8").splitlines()
        title = lines[0].split(". ", 1)[1]
        status = STATUS.fullmatch(lines[1])
        shown = "accepted" if status.group(1) == "accepted" else f"superseded by {status.group(2)}"
        row = f"| [{path.name[:4]}]({path.name}) | {title} | {shown} |"
        assert index.count(row) == 1, row
    assert index.count("\n| [") == len(records())


def repository_texts() -> list[Path]:
    found = []
    for pattern in SOURCES:
        found += [p for p in REPO.rglob(pattern) if not SKIP & set(p.relative_to(REPO).parts)]
    # CHANGELOG.md is history and may name the notebook the records replaced.
    return [p for p in found if p != REPO / "CHANGELOG.md"]


def test_every_reference_to_a_record_resolves() -> None:
    named = set()
    stale = []
    for path in repository_texts():
        text = path.read_text(encoding="utf-8", errors="replace")
        named |= set(re.findall(r"docs/decisions/(\d{4}-[a-z0-9-]+\.md)", text))
        if NOTEBOOK in text:
            stale.append(str(path.relative_to(REPO)))
    assert named, "no code or doc names a record: the pattern broke"
    assert sorted(n for n in named if not (FOLDER / n).exists()) == []
    assert stale == []


def test_no_work_log_reference_outside_the_changelog() -> None:
    """Code, tests, scripts and docs say what and why; which piece of work made them is history."""
    # Spelt in pieces so this file passes its own test.
    samples = ("as issue" + " 25", "the third" + " round", "stop" + " 4")
    assert all(WORK_LOG.search(sample) for sample in samples)
    assert not WORK_LOG.search("filled around one request; preStop 5 s; rounds of runs")
    texts = repository_texts()
    assert len(texts) > 100, "the walk found too few files: the pattern broke"
    found = []
    for path in texts:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        found += [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
                  for number, line in enumerate(lines, 1) if WORK_LOG.search(line)]
    assert found == []
