"""``tokenq dlq list|retry|purge``: the operator's handle on dead letters.

``list`` shows the oldest letters (or ``--id`` ones) with why they died;
``retry`` puts them back on the queue exactly as their producer wrote them
(one atomic script per page of 100), so a worker answers them on their
original ``reply_to``; ``purge`` deletes them. ``retry`` and ``purge`` need
``--id ENTRY_ID ...`` or ``--all``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

import redis

from tokenq.producer import dlq
from tokenq.producer._core import redact_url
from tokenq.producer.cli_stats import format_table
from tokenq.producer.inspect import connect
from tokenq.shared import keys
from tokenq.shared.cli import run_command
from tokenq.shared.errors import QueueFull
from tokenq.shared.settings import DlqSettings

_PREVIEW = 60


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(DlqSettings, spread_ids(list(argv or [])), "tokenq dlq", run)


def spread_ids(argv: list[str]) -> list[str]:
    """Let ``--id A B C`` mean ``--id A --id B --id C`` (the settings parser takes one value).

    Only words shaped like stream ids (``1718000000000-0``) are taken, so the
    ACTION positional may still follow.
    """
    out: list[str] = []
    state = "other"  # "value": the word right after --id; "more": later words of the run
    for arg in argv:
        if arg == "--id":
            out.append(arg)
            state = "value"
        elif state == "value":
            out.append(arg)
            state = "more"
        elif state == "more" and _looks_like_id(arg):
            out += ["--id", arg]
        else:
            out.append(arg)
            state = "other"
    return out


def _looks_like_id(arg: str) -> bool:
    ms, _, seq = arg.partition("-")
    return ms.isdigit() and (seq == "" or seq.isdigit())


def run(settings: DlqSettings) -> int:
    q = keys.QueueRef(settings.queue, settings.prefix)
    r = connect(settings.redis_url, settings.socket_timeout_s)
    try:
        if settings.action == "list":
            return _list(r, q, settings)
        ids = None if settings.all else settings.id
        if settings.action == "retry":
            return _retry(r, q, ids, settings)
        removed = dlq.purge(r, q, ids)
        print(f"purged {removed} dead letters from {keys.dead(q)}")
        return 0
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"tokenq dlq: cannot reach Redis at {redact_url(settings.redis_url)}: {exc}",
              file=sys.stderr)
        return 1
    finally:
        r.close()


def _list(r: redis.Redis, q: keys.QueueRef, settings: DlqSettings) -> int:
    letters = dlq.list_letters(r, q, limit=settings.count, ids=settings.id)
    if settings.as_json:
        for letter in letters:
            print(json.dumps(letter.to_json(), ensure_ascii=False))
        return 0
    total = dlq.count(r, q)
    print(f"{total} dead letters in {keys.dead(q)}" + (
        f" (showing {len(letters)})" if len(letters) < total else ""))
    if letters:
        rows = [_row(letter) for letter in letters]
        print(format_table(("entry", "request", "code", "deliveries", "worker", "age", "text"),
                           rows))
    return 0


def _row(letter: dlq.DeadLetter) -> tuple[str, ...]:
    body = letter.to_json()
    at_ms = body["at_ms"]
    age = "" if at_ms is None else f"{max(0.0, time.time() - at_ms / 1000):.0f}s"
    text = letter.request.get("text", "")
    text = text if isinstance(text, str) else "<binary>"
    if len(text) > _PREVIEW:
        text = text[:_PREVIEW - 1] + "…"
    return (letter.entry_id, letter.request_id, body["error_code"] or "",
            str(body["deliveries"] or ""), body["worker"] or "", age,
            text.replace("\n", " "))


def _retry(
    r: redis.Redis, q: keys.QueueRef, ids: list[str] | None, settings: DlqSettings
) -> int:
    try:
        moved, missing = dlq.retry(r, q, ids, max_queue_length=settings.max_queue_length,
                                   drop_deadline=settings.drop_deadline)
    except QueueFull as exc:
        print(f"tokenq dlq: {exc}", file=sys.stderr)
        return 1
    print(f"retried {len(moved)} dead letters onto {keys.requests(q)}")
    if missing:
        print(f"not in the dead stream: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0
