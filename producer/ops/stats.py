"""``tokenq stats``: every queue's backlog, workers and dead letters, as aligned text or
(``--json``) the document of docs/OPERATIONS.md."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from tokenq.shared.cli import run_command
from tokenq.shared.keys import DEFAULT_TENANT
from tokenq.shared.settings import StatsSettings
from tokenq.shared.text import percent, ratio


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(StatsSettings, list(argv or []), "tokenq stats", stats)


def stats(settings: StatsSettings) -> int:
    # Here, not at the top: ``tokenq stats --help`` needs no Redis client.
    from tokenq.producer.ops.snapshot import connection, read_snapshot, report_unreadable

    with connection(settings.redis_url, settings.socket_timeout_s, []) as r:
        doc = read_snapshot(r, settings.prefix, settings.queue, settings.redis_url,
                            settings.socket_timeout_s)
    if settings.as_json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    elif doc["queues"]:
        print("\n\n".join(_head(q) if whole else _queue_block(q)
                          for whole, q in in_display_order(doc)))
    elif not doc.get("unreadable"):
        print("no tokenq queues found (nothing has been enqueued or served yet)")
    return report_unreadable("tokenq stats", doc)


def in_display_order(doc: dict[str, Any]) -> Iterator[tuple[bool, dict[str, Any]]]:
    """(whether it is a sharded queue's sum, its entry): each lane's row, each sum after its
    queue's last lane."""
    wholes = {whole["queue"]: whole for whole in doc.get("totals", [])}
    rows = doc["queues"]
    for at, row in enumerate(rows):
        yield False, row
        last = at + 1 == len(rows) or rows[at + 1]["queue"] != row["queue"]
        if last and row["queue"] in wholes:
            yield True, wholes.pop(row["queue"])


def _head(q: dict[str, Any]) -> str:
    """A queue's first line: backlog, workers, and what its live workers do together."""
    totals = q["totals"]
    head = (f"queue {q['label']}: {backlog(q)}  "
            f"{totals['requests_per_s']:.1f} req/s  {totals['tokens_per_s']:.0f} tok/s  "
            f"padding {percent(totals['padding_efficiency'])}")
    lines = [head, unserved_line(q), cache_line(q)]
    return "\n  ".join(line for line in lines if line is not None)


def cache_line(q: dict[str, Any]) -> str | None:
    """The result cache and coalescing, for a queue that used them."""
    totals = q["totals"]
    hits, misses = totals["cache_hits"], totals["cache_misses"]
    if not (hits or misses or totals["coalesced"] or q["cache_bytes"]):
        return None
    return (f"cache: hit ratio {percent(ratio(hits, hits + misses))} ({hits} hits, "
            f"{misses} misses)  {totals['coalesced']} coalesced  {q['cache_bytes']} bytes")


def _queue_block(q: dict[str, Any]) -> str:
    lines = [_head(q)]
    if q["workers"]:
        lines.append("  " + format_table(WORKER_COLUMNS, [worker_row(w) for w in q["workers"]],
                                         indent="  "))
    if has_tenants(q):
        shown = busiest(q["tenants"])
        lines.append("  " + format_table(TENANT_COLUMNS, [tenant_row(t) for t in shown],
                                         indent="  "))
        if len(shown) < len(q["tenants"]):
            lines.append(f"  ({len(q['tenants']) - len(shown)} more tenants: --json lists all)")
    if q["stale_workers"]:
        lines.append(f"  {gone_line(q)}")
    if q["consumers"]:
        consumers = ", ".join(f"{c['name']} (pending {c['pending']}, idle {c['idle_ms']}ms)"
                              for c in q["consumers"])
        lines.append(f"  consumers: {consumers}")
    return "\n".join(lines)


def backlog(q: dict[str, Any]) -> str:
    """A queue's backlog and workers on one line."""
    oldest = "" if q["oldest_pending_ms"] is None else f" (oldest {q['oldest_pending_ms']}ms)"
    lag = str(q["lag"]) + ("" if q["lag_exact"] else "~")
    gone = f" ({len(q['stale_workers'])} gone)" if q["stale_workers"] else ""
    return (f"length {q['length']} ({q['pending_tokens']} tokens)  "
            f"pending {q['pending']}{oldest}  lag {lag}  "
            f"dead {q['dead']}  workers {q['totals']['workers']}{gone}")


def unserved_line(q: dict[str, Any]) -> str | None:
    """``no live worker: N waiting`` for a lane holding requests and no live worker."""
    if q["length"] and not q["totals"]["workers"]:
        return f"no live worker: {q['length']:,} waiting"
    return None


def gone_line(q: dict[str, Any]) -> str:
    return (f"gone (heartbeat row without a liveness key, or unreadable; not counted): "
            f"{', '.join(q['stale_workers'])}")


WORKER_COLUMNS = ("worker", "host", "budget", "rows", "buffered", "req/s", "tok/s",
                  "padding", "ok", "failed", "batches", "oom", "age")


def worker_row(w: dict[str, Any]) -> tuple[str, ...]:
    """One worker as table cells (lifetime averages)."""
    budget = f"{w['max_batch_tokens']}"
    if w["configured_batch_tokens"] not in (None, w["max_batch_tokens"]):
        budget += f"/{w['configured_batch_tokens']}"
    return (
        w["consumer"], str(w["host"] or ""), budget, str(w["max_batch_size"] or ""),
        str(w["buffered"]), f"{w['requests_per_s']:.1f}", f"{w['tokens_per_s']:.0f}",
        percent(w["padding_efficiency"]), str(w["requests_ok"]), str(w["requests_failed"]),
        str(w["batches"]), str(w["oom_splits"]), f"{w['heartbeat_age_s']:.1f}s",
    )


TENANT_COLUMNS = ("tenant", "pending tokens", "tok/s", "requests", "p50")
MAX_TENANT_ROWS = 20
"""Most tenants a table shows: those with the most pending tokens, then the most served."""


def has_tenants(q: dict[str, Any]) -> bool:
    """Whether a lane has a tenant other than the default one."""
    return any(t["tenant"] != DEFAULT_TENANT for t in q.get("tenants", ()))


def busiest(tenants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ranked = sorted(tenants, key=lambda t: (-t["pending_tokens"], -t["tokens"], t["tenant"]))
    return ranked[:MAX_TENANT_ROWS]


def tenant_row(t: dict[str, Any], tokens_per_s: float | None = None) -> tuple[str, ...]:
    """One tenant as table cells (``tokens_per_s``: a recent rate instead of the lifetime's)."""
    rate = t["tokens_per_s"] if tokens_per_s is None else tokens_per_s
    p50 = "-" if t["p50_ms"] is None else f"{t['p50_ms']:.0f}ms"
    return (t["tenant"], str(t["pending_tokens"]), f"{rate:.0f}", str(t["requests"]), p50)


def format_table(columns: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> str:
    widths = [max(len(str(c)), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True))
             for r in (columns, *rows)]
    return f"\n{indent}".join(line.rstrip() for line in lines)
