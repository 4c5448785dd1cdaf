"""``tokenq top``: ``tokenq stats`` with each worker's rates over the last refresh, redrawn
every ``--interval-s`` (rich); ``--once`` or a pipe: one frame; ``--json``: a line a refresh."""

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
    """One JSON line per refresh, until the reader closes the pipe (status 0)."""
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
    """Requests/s and tokens/s per worker, and tokens/s per tenant, between the last two
    heartbeats seen."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, ...], tuple[float, float, float]] = {}
        self._rates: dict[tuple[str, ...], tuple[float, float]] = {}

    def _rate(self, last: dict[tuple[str, ...], tuple[float, float, float]],
              key: tuple[str, ...], now: tuple[float, float, float]) -> tuple[float, float] | None:
        """The rates of ``key``'s two counters since its last reading (None: not two yet)."""
        last[key] = now
        before = self._last.get(key)
        if before is not None and now[0] > before[0]:
            span = now[0] - before[0]
            self._rates[key] = ((now[1] - before[1]) / span, (now[2] - before[2]) / span)
        return self._rates.get(key)

    def update(self, doc: dict[str, Any]) -> dict[str, Any]:
        """``doc`` with each worker's ``recent_requests_per_s`` and ``recent_tokens_per_s``
        and each tenant's ``recent_tokens_per_s`` (null until two heartbeats were seen)."""
        last: dict[tuple[str, ...], tuple[float, float, float]] = {}  # one gone is forgotten
        for q in doc["queues"]:
            by_tenant: dict[str, float] = {}
            for w in q["workers"]:
                rate = self._rate(last, (q["label"], w["consumer"]), (
                    w["at"], w["requests_ok"] + w["requests_failed"], w["tokens"]))
                w["recent_requests_per_s"] = None if rate is None else round(rate[0], 3)
                w["recent_tokens_per_s"] = None if rate is None else round(rate[1], 3)
                for label, t in w.get("tenants", {}).items():
                    rate = self._rate(last, (q["label"], w["consumer"], label),
                                      (w["at"], t["requests"], t["tokens"]))
                    if rate is not None:
                        by_tenant[label] = by_tenant.get(label, 0.0) + rate[1]
            for t in q.get("tenants", ()):
                recent = by_tenant.get(t["tenant"])
                t["recent_tokens_per_s"] = None if recent is None else round(recent, 3)
        self._last = last
        self._rates = {key: rate for key, rate in self._rates.items() if key in last}
        return doc


def render(doc: dict[str, Any], *, with_unreadable: bool = True) -> Any:
    """One frame: a table per queue (lane), a line summing each sharded queue, and (unless
    ``with_unreadable`` is False: a single frame leaves them to stderr) unreadable queues."""
    from rich.console import Group
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
            rows = []
            for w in q["workers"]:
                cells = list(stats.worker_row(w))
                if w.get("recent_requests_per_s") is not None:  # not the lifetime averages
                    cells[5] = f"{w['recent_requests_per_s']:.1f}"
                    cells[6] = f"{w['recent_tokens_per_s']:.0f}"
                rows.append(cells)
            parts.append(_table_of(head, stats.WORKER_COLUMNS, rows, {"worker", "host"}))
            if stats.has_tenants(q):  # the busiest, at their recent rates where known
                parts.append(_table_of("tenants", stats.TENANT_COLUMNS, [
                    stats.tenant_row(t, t.get("recent_tokens_per_s"))
                    for t in stats.busiest(q["tenants"])], {"tenant"}))
        unserved = stats.unserved_line(q)
        if unserved is not None:
            parts.append(Text(unserved, style=UNSERVED_STYLE))
        if not whole and q["stale_workers"]:
            parts.append(Text(stats.gone_line(q), style="dim"))
    return Group(*parts)


def _table_of(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]],
              left: set[str]) -> Any:
    """A rich table of ``rows``, the ``left`` columns left-aligned, the rest right."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", expand=False)
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right", no_wrap=True,
                         min_width=len(column))
    for row in rows:
        table.add_row(*row)
    return table
