"""A suite against a baseline commit: ``run.py SUITE --baseline REV [--rounds N]``.

Why interleaved: the machine is shared, so its speed drifts by more than most
changes move a figure. Running baseline, current, baseline, current … puts
both sides under the same drift, and the median over rounds of each side
drops a round that a neighbour's test run slowed down.

How the baseline runs without being installed: REV is checked out with
``git worktree add --detach`` into a temporary folder, and an overlay
``overlay/tokenq/{producer,worker,shared}`` of symlinks to that checkout's
folders is put first on ``PYTHONPATH``. ``tokenq`` is a namespace package, so
the overlay's portions are found before the editable install's finder, and the
worker processes a suite starts inherit the variable.

Which libraries the baseline gets: the ones it declared. Both sides share
this environment, which was installed for the working tree; a library that
this tree's pyproject.toml asks for and REV's does not (hiredis, say, which
redis-py uses whenever it can import it) would otherwise speed up the
baseline with this work's own dependency and hide what the work did. For
each such library that is importable under its distribution name, the
overlay holds a module of that name whose import raises ImportError, which
is what REV's users saw; the notes name them. The baseline runs its
*own* ``scripts/bench/run.py`` (its suites and harness as they were), unless
the suite is newer than REV: then it runs this tree's suite on REV's package
(said in the notes). The current side runs this working tree's, with the
environment as it is. Before
anything runs, each side's environment is asked where ``tokenq`` resolves
and the comparison stops if a side would import the other's tree. The
worktree is removed at the end, on error and on Ctrl-C or SIGTERM too.

What is compared: every numeric figure of every row (bools, strings and
nested values are not figures), rows matched across runs by the suite's first
column. Each side's figure is the median over its rounds of the runs that
reported a number; the ratio is current / baseline, and there is none when
either side has no number or the baseline is zero. Whether a ratio above 1
is good depends on the figure (requests/s: yes; p99_ms: no).

The top half of this module is pure (runs in, comparison out); the bottom
half owns the worktree and the subprocesses.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import tomllib

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent.parent
PACKAGES = ("producer", "worker", "shared")
"""The folders installed as ``tokenq.<name>``; each gets a symlink in the overlay."""
COLUMNS = ["setting", "figure", "baseline", "current", "ratio"]
DEFAULT_ROUNDS = 2
STOP_GRACE_S = 60.0
"""How long an interrupted suite gets to stop its workers and redis-server before SIGKILL."""

Result = dict[str, Any]


class CompareError(Exception):
    """Why a comparison cannot go on, in one line a user can act on."""


# ------------------------------------------------------------------ pure part


_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def declared_libraries(pyproject: str) -> set[str]:
    """Every distribution a pyproject.toml names, its extras included, normalised.

    Normalised as an import name would be spelled: lower case, ``-`` and
    ``.`` as ``_`` (``pydantic-settings`` is ``pydantic_settings``).
    """
    project = tomllib.loads(pyproject).get("project", {})
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    names = set()
    for requirement in requirements:
        match = _REQUIREMENT_NAME.match(requirement)
        if match:
            names.add(re.sub(r"[-.]", "_", match.group(1).lower()))
    return names


def newly_declared(baseline_pyproject: str, current_pyproject: str) -> list[str]:
    """The libraries the current tree declares and the baseline did not, sorted."""
    return sorted(declared_libraries(current_pyproject) - declared_libraries(baseline_pyproject))


def is_figure(value: object) -> bool:
    """A finite int or float that is not a bool: the only values that get a ratio."""
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    )


def keyed_rows(result: Result) -> dict[str, dict[str, Any]]:
    """A run's rows by their first column; a repeated key gets `` #2``, `` #3`` …"""
    columns = result.get("columns") or []
    rows: dict[str, dict[str, Any]] = {}
    for row in result.get("rows", []):
        key_column = columns[0] if columns else next(iter(row), None)
        base = str(row.get(key_column)) if key_column is not None else "?"
        key, seen = base, 1
        while key in rows:
            seen += 1
            key = f"{base} #{seen}"
        rows[key] = row
    return rows


def figure_order(runs: Sequence[Result]) -> list[str]:
    """Figure names: the suite's columns first, then other numeric keys as rows list them."""
    names: list[str] = []
    for run in runs:
        key_column = (run.get("columns") or [None])[0]
        for name in [*run.get("columns", [])[1:], *(k for r in run.get("rows", []) for k in r)]:
            if name != key_column and name not in names:
                names.append(name)
    return names


def median_figures(runs: Sequence[Result]) -> dict[str, dict[str, float | None]]:
    """Setting -> figure -> median over the runs that gave a number (None if none did).

    Settings keep the order of their first appearance; a figure appears once
    any run gave a number for it in any setting.
    """
    order = figure_order(runs)
    values: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for setting, row in keyed_rows(run).items():
            per_figure = values.setdefault(setting, {})
            for name, value in row.items():
                if name in order and is_figure(value):
                    per_figure.setdefault(name, []).append(value)
    figures = [name for name in order if any(name in v for v in values.values())]
    return {
        setting: {
            name: statistics.median(per_figure[name]) if name in per_figure else None
            for name in figures
        }
        for setting, per_figure in values.items()
    }


def ratio(baseline: float | None, current: float | None) -> float | None:
    """current / baseline, or None when either is missing or the baseline is zero."""
    if baseline is None or current is None or baseline == 0:
        return None
    if not (is_figure(baseline) and is_figure(current)):
        return None
    return current / baseline


def compare(baseline_runs: Sequence[Result], current_runs: Sequence[Result]) -> list[dict]:
    """One row per (setting, figure) either side reported, current's settings first.

    A figure is listed for a setting when at least one side has a number for
    it; the other side's value is then None, as is the ratio.
    """
    base = median_figures(baseline_runs)
    current = median_figures(current_runs)
    settings = [*current, *(s for s in base if s not in current)]
    figures = figure_order([*current_runs, *baseline_runs])
    rows = []
    for setting in settings:
        for name in figures:
            b = base.get(setting, {}).get(name)
            c = current.get(setting, {}).get(name)
            if b is None and c is None:
                continue
            rows.append({
                "setting": setting, "figure": name, "baseline": b, "current": c,
                "ratio": None if (r := ratio(b, c)) is None else round(r, 4),
            })
    return rows


def unmatched(baseline_runs: Sequence[Result], current_runs: Sequence[Result]) -> list[str]:
    """Notes for settings that only one side reported (renamed, added or dropped rows)."""
    base = {s for run in baseline_runs for s in keyed_rows(run)}
    current = {s for run in current_runs for s in keyed_rows(run)}
    notes = [f"only in baseline: {s}" for s in sorted(base - current)]
    return notes + [f"only in current: {s}" for s in sorted(current - base)]


def format_comparison(rows: Sequence[dict[str, Any]]) -> str:
    """The printed table: names left, numbers right, a setting written once per block."""
    cells = []
    previous = None
    for row in rows:
        setting = "" if row["setting"] == previous else row["setting"]
        previous = row["setting"]
        cells.append([setting, row["figure"], _number(row["baseline"]), _number(row["current"]),
                      "-" if row["ratio"] is None else f"{row['ratio']:.3f}"])
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(COLUMNS)]

    def line(values: Sequence[str]) -> str:
        pairs = enumerate(zip(values, widths, strict=True))
        return "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in pairs).rstrip()

    return "\n".join([line(COLUMNS), line(["-" * w for w in widths]), *map(line, cells)])


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if value == int(value):
        return str(int(value))
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


# ------------------------------------------------------ worktree and processes


def git(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def resolve_commit(rev: str) -> str:
    """The full hash of REV, or CompareError if it does not name a commit here."""
    found = git("rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if found.returncode != 0 or not rev or rev.startswith("-"):
        raise CompareError(f"--baseline {rev!r} is not a commit in {REPO_ROOT}")
    return found.stdout.strip()


@contextlib.contextmanager
def baseline_tree(commit: str) -> Iterator[tuple[Path, Path]]:
    """A detached worktree of ``commit`` and its import overlay; both gone on the way out.

    Yields (worktree, overlay); the overlay's ``tokenq/<package>`` symlinks
    point into the worktree, so ``PYTHONPATH=overlay`` imports the baseline.
    """
    scratch = Path(tempfile.mkdtemp(prefix="tokenq-baseline-"))
    tree = scratch / "tree"
    try:
        added = git("worktree", "add", "--detach", "--quiet", str(tree), commit)
        if added.returncode != 0:
            raise CompareError(f"git worktree add failed: {added.stderr.strip()}")
        overlay = scratch / "overlay"
        (overlay / "tokenq").mkdir(parents=True)
        for package in PACKAGES:
            if not (tree / package / "__init__.py").is_file():
                raise CompareError(f"{commit[:10]} has no {package}/__init__.py to import")
            (overlay / "tokenq" / package).symlink_to(tree / package)
        hide_undeclared(tree, overlay)
        yield tree, overlay
    finally:
        removed = git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(scratch, ignore_errors=True)
        if removed.returncode != 0:
            git("worktree", "prune")  # drops the entry of a tree add left half made


_HIDDEN = (
    "raise ImportError({name!r} + ' is hidden from the baseline: its pyproject.toml '\n"
    "                  'does not declare it (scripts/bench/compare.py)')\n"
)


def hidden_libraries(overlay: Path) -> list[str]:
    """The names ``hide_undeclared`` put in the overlay, sorted."""
    return sorted(path.stem for path in overlay.glob("*.py"))


def hide_undeclared(tree: Path, overlay: Path) -> None:
    """Shadow, in the overlay, each library this tree declares and ``tree`` does not.

    Only names importable here under the distribution's own name are
    shadowed; a distribution whose module is named otherwise is left alone
    (none of tokenq's are).
    """
    baseline_pyproject = tree / "pyproject.toml"
    if not baseline_pyproject.is_file():
        return
    for name in newly_declared(
        baseline_pyproject.read_text(), (REPO_ROOT / "pyproject.toml").read_text()
    ):
        if importlib.util.find_spec(name) is not None:
            (overlay / f"{name}.py").write_text(_HIDDEN.format(name=name))


def side_env(overlay: Path | None) -> dict[str, str]:
    """This process's environment, with the overlay (if any) first on PYTHONPATH."""
    env = dict(os.environ)
    if overlay is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(overlay), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
    return env


_WHERE = (
    "import importlib, pathlib\n"
    "for name in {packages!r}:\n"
    "    module = importlib.import_module('tokenq.' + name)\n"
    "    for path in module.__path__:\n"
    "        print(pathlib.Path(path).resolve())\n"
)


def check_imports(label: str, env: dict[str, str], root: Path) -> None:
    """Fail unless every ``tokenq.<package>`` resolves inside ``root`` with ``env``.

    Run from ``scripts/bench`` of that tree, which is where ``run.py``'s own
    first ``sys.path`` entry points, so the answer is the one the suite gets.
    """
    code = _WHERE.format(packages=PACKAGES)
    found = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root / "scripts" / "bench",
        capture_output=True, text=True,
    )
    if found.returncode != 0:
        raise CompareError(f"{label}: importing tokenq failed: {found.stderr.strip()[-500:]}")
    root = root.resolve()
    for line in found.stdout.split():
        if not Path(line).is_relative_to(root):
            raise CompareError(f"{label}: tokenq resolves to {line}, not into {root}")


def run_once(
    label: str, run_py: Path, suite: str, size: str, env: dict[str, str], out: Path
) -> Result:
    """One ``run.py SUITE --size S --json out`` in a subprocess; its result.

    The run gets a session of its own, so a Ctrl-C or an error here reaches it
    as a SIGINT to the whole group (the suite's own ``finally`` stops its
    workers and redis-server), and SIGKILL only if it has not gone in
    ``STOP_GRACE_S``. Its output goes to a log next to ``out``, shown if it fails.
    """
    log_path = out.with_suffix(".log")
    command = [sys.executable, str(run_py), suite, "--size", size, "--json", str(out)]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, env=env, cwd=run_py.parent.parent.parent, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            returncode = process.wait()
        except BaseException:
            _stop_group(process)
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            print(f"{label} run stopped; its last output:", *tail, sep="\n  ", file=sys.stderr)
            raise
        _reap_group(process.pid)
    if returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise CompareError(f"{label} run exited with {returncode}:\n{tail}")
    return json.loads(out.read_text())


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGINT to the run's group, then wait for all of it (see :func:`_reap_group`)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    _reap_group(process.pid)


def _reap_group(pgid: int) -> None:
    """Wait until no process of the group is running; SIGKILL what outlives ``STOP_GRACE_S``.

    A worker the suite started but had not yet put under its own cleanup when
    the SIGINT came stops by itself, after ``run.py`` has gone: wait for it
    rather than leave it running behind the comparison.
    """
    deadline = time.monotonic() + STOP_GRACE_S
    while _group_running(pgid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            return
        time.sleep(0.05)


def _group_running(pgid: int) -> bool:
    """Whether a process of the group is alive (a zombie, waiting for its reaper, is not)."""
    proc = Path("/proc")
    if not proc.is_dir():  # no procfs: the signal probe, which counts zombies too
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while inside, so the worktree's ``finally`` runs."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def compare_suite(suite: str, rev: str, rounds: int, size: str, json_path: Path | None) -> Result:
    """Both sides, interleaved, ``rounds`` times; the whole record (what ``--json`` writes)."""
    if rounds < 1:
        raise CompareError(f"--rounds must be at least 1, not {rounds}")
    commit = resolve_commit(rev)
    started = time.perf_counter()
    runs: dict[str, list[Result]] = {"baseline": [], "current": []}
    borrowed = False
    with sigterm_unwinds(), baseline_tree(commit) as (tree, overlay):
        baseline_run = tree / "scripts" / "bench" / "run.py"
        if not (baseline_run.parent / f"suite_{suite}.py").exists():
            # A suite newer than REV: this tree's suite, on REV's package.
            baseline_run, borrowed = BENCH_DIR / "run.py", True
        sides = {
            "baseline": (baseline_run, side_env(overlay), tree),
            "current": (BENCH_DIR / "run.py", side_env(None), REPO_ROOT),
        }
        for label, (_, env, root) in sides.items():
            check_imports(label, env, root)
        hidden = hidden_libraries(overlay)
        out_dir = overlay.parent / "runs"
        out_dir.mkdir()
        for round_no in range(1, rounds + 1):
            for label, (run_py, env, _) in sides.items():
                tick = time.perf_counter()
                out = out_dir / f"{label}-{round_no}.json"
                runs[label].append(run_once(label, run_py, suite, size, env, out))
                print(f"  round {round_no}/{rounds} {label}: {time.perf_counter() - tick:.1f} s",
                      flush=True)
    head = git("rev-parse", "HEAD").stdout.strip()
    dirty = bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())
    notes = [
        f"ratio = current / baseline, medians of {rounds} round(s) each, run interleaved",
        *unmatched(runs["baseline"], runs["current"]),
    ]
    if hidden:
        notes.append(f"the baseline ran without {', '.join(hidden)}: {rev} does not declare it "
                     f"(this tree does)")
    if borrowed:
        notes.append(f"the suite is newer than {rev}: both sides ran this tree's suite; "
                     f"the baseline side imported {rev}'s tokenq")
    record = {
        "suite": suite,
        "size": size,
        "rounds": rounds,
        "command": f"python scripts/bench/run.py {suite} --size {size} --baseline {rev} "
                   f"--rounds {rounds}"
                   + (f" --runtime {runtime}" if (runtime := os.environ.get("BENCH_RUNTIME"))
                      else ""),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - started, 1),
        "baseline": {"rev": rev, "commit": commit, "runs": runs["baseline"]},
        "current": {"commit": head, "uncommitted_changes": dirty, "runs": runs["current"]},
        "columns": COLUMNS,
        "rows": compare(runs["baseline"], runs["current"]),
        "notes": notes,
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


def report(record: Result) -> str:
    """The comparison as printed."""
    current = record["current"]
    here = "working tree" + (" (uncommitted changes)" if current["uncommitted_changes"] else "")
    lines = [
        f"== {record['suite']} ({record['size']}, {record['wall_s']} s): {here} at "
        f"{current['commit'][:10]} vs baseline {record['baseline']['rev']} "
        f"({record['baseline']['commit'][:10]})",
        format_comparison(record["rows"]),
        *(f"  {note}" for note in record["notes"]),
    ]
    return "\n".join(lines)


def main(suite: str, rev: str, rounds: int, size: str, json_path: Path | None) -> int:
    """``run.py``'s ``--baseline`` path: run, print, and turn failures into one line."""
    try:
        record = compare_suite(suite, rev, rounds, size, json_path)
    except CompareError as error:
        print(f"run.py: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("run.py: interrupted; the baseline worktree was removed", file=sys.stderr)
        return 130
    print(report(record), flush=True)
    return 0
