"""``tokenq top``: ``tokenq stats`` redrawn every ``--interval-s`` until Ctrl-C.

Where ``stats`` shows each worker's lifetime averages, ``top`` shows rates
over the last refresh (from the difference of two heartbeats), which is what
an operator watching a backlog drain wants. ``--once`` draws a single frame
(for scripts and tests). Needs ``rich`` (``pip install 'tokenq[cli]'``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from tokenq.producer.ops.snapshot import Unreachable, connect, read_snapshot
from tokenq.producer.ops.stats import WORKER_COLUMNS, backlog, gone_line, worker_row
from tokenq.shared.cli import run_command
from tokenq.shared.settings import TopSettings


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(TopSettings, list(argv or []), "tokenq top", top)


def top(settings: TopSettings) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        print("tokenq top: needs the rich package: pip install 'tokenq[cli]'", file=sys.stderr)
        return 2
    r = connect(settings.redis_url, settings.socket_timeout_s)
    rates = Rates()
    # Piped output (``--once`` in a script) gets room for every column, not 80.
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        doc = read_snapshot(r, settings.prefix, settings.queue, settings.redis_url,
                            settings.socket_timeout_s)
        if settings.once:
            console.print(render(doc, rates.update(doc)))
            return 0
        with Live(render(doc, rates.update(doc)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(settings.interval_s)
                doc = read_snapshot(r, settings.prefix, settings.queue, settings.redis_url,
                                    settings.socket_timeout_s)
                live.update(render(doc, rates.update(doc)), refresh=True)
    except Unreachable as exc:
        print(f"tokenq top: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        r.close()


class Rates:
    """Requests/s and tokens/s per worker between the last two heartbeats seen."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[float, float, float]] = {}
        self._rates: dict[tuple[str, str], tuple[float, float]] = {}

    def update(self, doc: dict[str, Any]) -> dict[tuple[str, str], tuple[float, float]]:
        seen = set()
        for q in doc["queues"]:
            for w in q["workers"]:
                key = (q["label"], w["consumer"])
                seen.add(key)
                now = (w["at"], w["requests_ok"] + w["requests_failed"], w["tokens"])
                before = self._last.get(key)
                if before is not None and now[0] > before[0]:
                    span = now[0] - before[0]
                    self._rates[key] = ((now[1] - before[1]) / span, (now[2] - before[2]) / span)
                self._last[key] = now
        for key in set(self._last) - seen:
            self._last.pop(key, None)
            self._rates.pop(key, None)
        return dict(self._rates)


def render(doc: dict[str, Any], rates: dict[tuple[str, str], tuple[float, float]]) -> Any:
    """One frame: a table per queue."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    stamp = time.strftime("%H:%M:%S", time.localtime(doc["at"]))
    parts: list[Any] = [Text(f"tokenq top  {doc['redis_url']}  {stamp}", style="bold")]
    if not doc["queues"]:
        parts.append(Text("no tokenq queues found"))
    for q in doc["queues"]:
        head = f"queue {q['label']}  {backlog(q)}"
        table = Table(title=head, title_justify="left", expand=False)
        for column in WORKER_COLUMNS:
            table.add_column(
                column, justify="left" if column in {"worker", "host"} else "right",
                no_wrap=True, min_width=len(column),
            )
        for w in q["workers"]:
            cells = list(worker_row(w))
            recent = rates.get((q["label"], w["consumer"]))
            if recent is not None:  # recent rates instead of lifetime averages
                cells[5], cells[6] = f"{recent[0]:.1f}", f"{recent[1]:.0f}"
            table.add_row(*cells)
        parts.append(table)
        if q["stale_workers"]:
            parts.append(Text(gone_line(q), style="dim"))
    return Group(*parts)
