"""``tokenq top``: ``tokenq stats`` with each worker's rates over the last refresh, redrawn
every ``--interval-s`` on a terminal (needs rich); ``--once`` or a pipe: one frame;
``--json``: one snapshot a line, flushed, until Ctrl-C (needs no rich)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from tokenq.producer.ops import stats
from tokenq.producer.ops.snapshot import connect, read_snapshot, report_unreadable, unreadable_lines
from tokenq.shared.cli import run_command, silence_stdout
from tokenq.shared.flags import UsageError
from tokenq.shared.settings import TopSettings


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(TopSettings, list(argv or []), "tokenq top", top)


def top(settings: TopSettings) -> int:
    r = connect(settings.redis_url, settings.socket_timeout_s)
    recent = RecentRates()

    def snapshot() -> dict[str, Any]:
        return recent.update(read_snapshot(r, settings.prefix, settings.queue,
                                           settings.redis_url, settings.socket_timeout_s))

    try:
        if settings.as_json:
            return _json_lines(settings, snapshot)
        return _table(settings, snapshot)
    except KeyboardInterrupt:
        return 0
    finally:
        r.close()


def _json_lines(settings: TopSettings, snapshot: Callable[[], dict[str, Any]]) -> int:
    """One JSON line per refresh; the reader closing the pipe ends it quietly (status 0)."""
    try:
        while True:
            doc = snapshot()
            print(json.dumps(doc, sort_keys=True), flush=True)
            if settings.once:
                return report_unreadable("tokenq top", doc)
            time.sleep(settings.interval_s)
    except BrokenPipeError:
        silence_stdout()
        return 0


def _table(settings: TopSettings, snapshot: Callable[[], dict[str, Any]]) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        raise UsageError("needs the rich package: pip install 'tokenq[cli]' "
                         "(or use --json)") from None
    # COLUMNS, else the terminal's width; neither (a pipe, a terminal reporting no size):
    # unbounded, where rich lays a table out at its own width, not cropped to a guess of 80.
    console = Console(width=shutil.get_terminal_size(fallback=(0, 0)).columns or 100_000)
    doc = snapshot()
    if settings.once or not sys.stdout.isatty():
        console.print(render(doc, with_unreadable=False))
        return report_unreadable("tokenq top", doc)
    with Live(render(doc), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(settings.interval_s)
            live.update(render(snapshot()), refresh=True)


UNSERVED_STYLE = "bold yellow"  # requests waiting, no live worker (red: unreadable queues)


class RecentRates:
    """Requests/s and tokens/s per worker between the last two heartbeats seen."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[float, float, float]] = {}
        self._rates: dict[tuple[str, str], tuple[float, float]] = {}

    def update(self, doc: dict[str, Any]) -> dict[str, Any]:
        """``doc`` with each worker's ``recent_requests_per_s`` and ``recent_tokens_per_s``
        (null until two of its heartbeats have been seen)."""
        last = {}  # the workers in this snapshot: one gone is forgotten
        for q in doc["queues"]:
            for w in q["workers"]:
                key = (q["label"], w["consumer"])
                now = last[key] = (w["at"], w["requests_ok"] + w["requests_failed"], w["tokens"])
                before = self._last.get(key)
                if before is not None and now[0] > before[0]:
                    span = now[0] - before[0]
                    self._rates[key] = ((now[1] - before[1]) / span, (now[2] - before[2]) / span)
                rate = self._rates.get(key)
                w["recent_requests_per_s"] = None if rate is None else round(rate[0], 3)
                w["recent_tokens_per_s"] = None if rate is None else round(rate[1], 3)
        self._last = last
        self._rates = {key: rate for key, rate in self._rates.items() if key in last}
        return doc


def render(doc: dict[str, Any], *, with_unreadable: bool = True) -> Any:
    """One frame: a table per queue (lane), a line summing each sharded queue, and (unless
    ``with_unreadable`` is False: a single frame leaves them to stderr) unreadable queues."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    stamp = time.strftime("%H:%M:%S", time.localtime(doc["at"]))
    parts: list[Any] = [Text(f"tokenq top  {doc['redis_url']}  {stamp}", style="bold")]
    if with_unreadable:
        parts += [Text(line, style="bold red") for line in unreadable_lines(doc)]
    if not doc["queues"] and not doc.get("unreadable"):
        parts.append(Text("no tokenq queues found"))
    for whole, q in stats.in_display_order(doc):
        head = f"queue {q['label']}  {stats.backlog(q)}"
        if whole:  # a sharded queue's sum: its workers are in its lanes' tables
            parts.append(Text(head, style="bold"))
        else:
            table = Table(title=head, title_justify="left", expand=False)
            for column in stats.WORKER_COLUMNS:
                table.add_column(column, justify="left" if column in {"worker", "host"}
                                 else "right", no_wrap=True, min_width=len(column))
            for w in q["workers"]:
                cells = list(stats.worker_row(w))
                if w.get("recent_requests_per_s") is not None:  # not the lifetime averages
                    cells[5] = f"{w['recent_requests_per_s']:.1f}"
                    cells[6] = f"{w['recent_tokens_per_s']:.0f}"
                table.add_row(*cells)
            parts.append(table)
        unserved = stats.unserved_line(q)
        if unserved is not None:
            parts.append(Text(unserved, style=UNSERVED_STYLE))
        if not whole and q["stale_workers"]:
            parts.append(Text(stats.gone_line(q), style="dim"))
    return Group(*parts)

