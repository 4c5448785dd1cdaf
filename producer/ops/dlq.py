"""``tokenq dlq list|retry|purge``: the operator's handle on dead letters.

``list`` shows the oldest letters (or ``--id`` ones) with why they died
(the code and the reason, as text);
``retry`` puts them back on the queue exactly as their producer wrote them
(one atomic script per page of 100), so a worker answers them on their
original ``reply_to``; ``purge`` deletes them. ``retry`` and ``purge`` need
``--id ENTRY_ID ...`` or ``--all``. Ids not found, and letters ``retry``
skips because the worker truncated them, are named on stderr and make the
exit status 1; Redis failures are one line (shared/cli.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import redis

from tokenq.producer.ops import letters as dlq
from tokenq.producer.ops.snapshot import connection, entry_ms, redis_now
from tokenq.producer.ops.stats import format_table
from tokenq.shared import keys
from tokenq.shared.cli import plural, run_command
from tokenq.shared.dead_letter import DeadLetter
from tokenq.shared.errors import QueueFull
from tokenq.shared.settings import DlqSettings

_PREVIEW = 60

ACTIONS = {
    "list": "show the oldest --count letters (or the --id ones): code, reason, worker, age",
    "retry": "put letters back on the queue as their producer wrote them (--id ... or --all)",
    "purge": "delete letters (--id ... or --all)",
}
"""What each ACTION does, for ``--help`` (the names are DlqSettings.action's)."""


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(DlqSettings, spread_ids(list(argv or [])), "tokenq dlq", run, ACTIONS)


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
    with connection(settings.redis_url, settings.socket_timeout_s, [q]) as r:
        if settings.action == "list":
            return _list(r, q, settings)
        ids = None if settings.all else settings.id
        if settings.action == "retry":
            return _retry(r, q, ids, settings)
        return _purge(r, q, ids)


def _report_missing(missing: list[str]) -> None:
    """The named ids the dead stream does not hold, on stderr (the caller exits 1)."""
    if not missing:
        return
    words = [one if dlq.entry_id(one) is not None else f"{one} (not a stream entry id)"
             for one in missing]
    print(f"tokenq dlq: not in the dead stream: {', '.join(words)}", file=sys.stderr)


def _list(r: redis.Redis, q: keys.QueueRef, settings: DlqSettings) -> int:
    wanted, invalid = dlq.resolve_ids(settings.id)
    if settings.id and not wanted:
        letters = []
    else:
        letters = dlq.list_letters(r, q, limit=settings.count, ids=wanted)
    found = {letter.entry_id for letter in letters}
    missing = invalid + [one for one in wanted if one not in found]
    if settings.as_json:
        for letter in letters:
            print(json.dumps(dlq.letter_json(letter), ensure_ascii=False))
    else:
        total = dlq.count(r, q)
        print(f"{plural(total, 'dead letter')} in {keys.dead(q)}" + (
            f" (showing {len(letters)})" if len(letters) < total else ""))
        if letters:
            now_ms = int(redis_now(r) * 1000)
            rows = [_row(letter, now_ms) for letter in letters]
            print(format_table(("entry", "request", "code", "reason", "deliveries", "worker",
                                "age", "truncated", "text"), rows))
    _report_missing(missing)
    return 1 if missing else 0


def _row(letter: DeadLetter, now_ms: int) -> tuple[str, ...]:
    """One letter as table cells; its age is from its entry id against Redis's clock."""
    age = f"{max(0, now_ms - entry_ms(letter.entry_id)) / 1000:.0f}s"
    text = letter.request.get("text", "")
    text = text if isinstance(text, str) else "<binary>"
    truncated = ",".join(letter.truncated) if letter.truncated else ""
    return (letter.entry_id, letter.request_id, letter.error_code or "",
            _preview(dlq.reason_text(letter.error) or ""), str(letter.deliveries or ""),
            letter.worker or "", age, truncated, _preview(text))


def _preview(text: str) -> str:
    """``text`` on one line, cut to fit a table cell."""
    text = " ".join(text.split())
    return text[:_PREVIEW - 1] + "…" if len(text) > _PREVIEW else text


def _retry(
    r: redis.Redis, q: keys.QueueRef, ids: list[str] | None, settings: DlqSettings
) -> int:
    try:
        outcome = dlq.retry(r, q, ids, max_queue_length=settings.max_queue_length,
                            drop_deadline=settings.drop_deadline)
    except QueueFull as exc:
        print(f"tokenq dlq: {exc}", file=sys.stderr)
        return 1
    upto = "" if ids is not None or outcome.last_id is None else (
        f" (every letter up to {outcome.last_id}, the last when the retry started)")
    print(f"retried {plural(len(outcome.moved), 'dead letter')} onto {keys.requests(q)}{upto}")
    for one, why in outcome.skipped.items():
        print(f"tokenq dlq: skipped {one}: {why}; it stays in {keys.dead(q)} "
              "(inspect it with dlq list --id, drop it with dlq purge --id)", file=sys.stderr)
    if outcome.vanished:
        print(f"tokenq dlq: {plural(len(outcome.vanished), 'letter')} deleted by someone "
              f"else while the retry ran: {', '.join(outcome.vanished)}", file=sys.stderr)
    _report_missing(outcome.missing)
    return 1 if outcome.missing or outcome.skipped else 0


def _purge(r: redis.Redis, q: keys.QueueRef, ids: list[str] | None) -> int:
    removed, missing = dlq.purge(r, q, ids)
    print(f"purged {plural(removed, 'dead letter')} from {keys.dead(q)}")
    _report_missing(missing)
    return 1 if missing else 0
