"""``tokenq dlq list|retry|purge``: show, re-enqueue (as written, onto each letter's own lane)
or delete dead letters; a sharded queue's letters are named ``<shard>/<id>`` or ``plain/<id>``.
Named letters not found, or skipped, are named on stderr and make the exit status 1."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import redis

from tokenq.producer.ops import letters as dlq
from tokenq.producer.ops.snapshot import connection, entry_ms, known_lanes, redis_now
from tokenq.producer.ops.stats import format_table
from tokenq.shared import keys
from tokenq.shared.cli import run_command
from tokenq.shared.dead_letter import DeadLetter
from tokenq.shared.settings import DlqSettings
from tokenq.shared.text import plural

_PREVIEW = 60
_ID_WORD = re.compile(rf"(?:(?:\d+|{dlq.PLAIN})/)?\d+(?:-\d*)?")  # an entry id or a letter's name

ACTIONS = {
    "list": "show the oldest --count letters (or the --id ones): code, reason, worker, age",
    "retry": "put letters back on the queue as their producer wrote them (--id ... or --all)",
    "purge": "delete letters (--id ... or --all)",
}


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(DlqSettings, spread_ids(list(argv or [])), "tokenq dlq", run, ACTIONS)


def spread_ids(argv: list[str]) -> list[str]:
    """Let ``--id A B C`` mean ``--id A --id B --id C``; only words shaped like ids or letter
    names (``2/1718000000000-0``) are taken, so the ACTION positional may still follow."""
    out: list[str] = []
    for arg in argv:
        after_id = len(out) >= 2 and out[-2] == "--id" and out[-1] != "--id"  # an --id's value
        if after_id and _ID_WORD.fullmatch(arg):
            out.append("--id")
        out.append(arg)
    return out


Work = list[tuple[keys.QueueRef, list[str] | None]]  # by lane: entry ids, or None for all


def run(settings: DlqSettings) -> int:
    q = keys.QueueRef(settings.queue, settings.prefix)
    checked = [q]  # whose keys a WRONGTYPE is looked for in: every lane, once they are known
    with connection(settings.redis_url, settings.socket_timeout_s, checked) as r:
        lanes = dlq.Lanes(q, known_lanes(r, q))
        checked[:] = lanes.all
        if settings.action == "list":
            return _list(r, lanes, settings)
        work: Work = [(lane, None) for lane in lanes.all]
        missing: list[str] = []
        ambiguous: dict[str, list[str]] = {}
        if not settings.all:
            targets, missing = lanes.targets(settings.id)
            bare = [one for t in targets if t.lane is None for one in lanes.candidates(t)]
            found = {(lane, letter.entry_id) for lane, letter in dlq.read_letters(r, bare)}
            by_lane, unfound, ambiguous = dlq.place(lanes, targets, found, named_found=True)
            work, missing = list(by_lane.items()), missing + unfound
        if settings.action == "retry":
            failed = _retry(r, lanes, work, missing, settings)
        else:
            failed = _purge(r, lanes, work, missing)
        verb = "retried" if settings.action == "retry" else "purged"
        _report_ambiguous(ambiguous, f"not {verb}; name the one you mean")
        return 1 if failed or ambiguous else 0


def _report_missing(lanes: dlq.Lanes, missing: list[str]) -> None:
    """The named letters no dead stream holds, on stderr (the caller exits 1)."""
    if not missing:
        return
    where = "any of the queue's dead streams" if lanes.sharded else "the dead stream"
    print(f"tokenq dlq: not in {where}: {', '.join(missing)}", file=sys.stderr)


def _report_ambiguous(ambiguous: dict[str, list[str]], outcome: str) -> None:
    """Bare ids that more than one lane of a sharded queue holds, one line each."""
    for one, names in ambiguous.items():
        print(f"tokenq dlq: {one} is in more than one dead stream ({', '.join(names)}): "
              f"{outcome}", file=sys.stderr)


_COLUMNS = ("entry", "request", "code", "reason", "deliveries", "worker", "age", "truncated",
            "text")


def _list(r: redis.Redis, lanes: dlq.Lanes, settings: DlqSettings) -> int:
    targets, missing = lanes.targets(settings.id)
    if settings.id:
        letters = dlq.read_letters(r, [one for t in targets for one in lanes.candidates(t)])
    else:
        letters = dlq.oldest(r, lanes, settings.count)
    found = {(lane, letter.entry_id) for lane, letter in letters}
    _, unfound, ambiguous = dlq.place(lanes, targets, found)
    missing += unfound
    if settings.as_json:
        for lane, letter in letters:
            print(json.dumps(_letter_json(lanes, lane, letter), ensure_ascii=False))
    else:
        total = dlq.count(r, lanes)
        print(f"{plural(total, 'dead letter')} in {lanes.where(keys.dead)}" + (
            f" (showing {len(letters)})" if len(letters) < total else ""))
        if letters:
            now_ms = int(redis_now(r) * 1000)
            rows = [_row(lanes, lane, letter, now_ms) for lane, letter in letters]
            columns = ("shard", *_COLUMNS) if lanes.sharded else _COLUMNS
            print(format_table(columns, rows))
    _report_missing(lanes, missing)
    _report_ambiguous(ambiguous, "all listed")
    return 1 if missing else 0


def _letter_json(lanes: dlq.Lanes, lane: keys.QueueRef, letter: DeadLetter) -> dict[str, Any]:
    """A letter's ``--json`` line: text fields as strings, binary ones (``opts``) as hex; a
    sharded queue's also says its lane and its name."""
    where = {"shard": lane.shard, "entry": lanes.name(lane, letter.entry_id)}
    return {
        **(where if lanes.sharded else {}),
        "entry_id": letter.entry_id, "request_id": letter.request_id,
        "error_code": letter.error_code, "error": dlq.reason_text(letter.error),
        "worker": letter.worker, "deliveries": letter.deliveries, "at_ms": letter.at_ms,
        "source_id": letter.source_id, "truncated": letter.truncated,
        "request": {name: value if isinstance(value, str) else {"hex": value.hex()}
                    for name, value in letter.request.items()},
    }


def _row(lanes: dlq.Lanes, lane: keys.QueueRef, letter: DeadLetter, now_ms: int) -> tuple[str, ...]:
    """One letter as table cells; its age is from its entry id against Redis's clock."""
    age = f"{max(0, now_ms - entry_ms(letter.entry_id)) / 1000:.0f}s"
    text = letter.request.get("text", "")
    text = text if isinstance(text, str) else "<binary>"
    truncated = ",".join(letter.truncated) if letter.truncated else ""
    cells = (lanes.name(lane, letter.entry_id), letter.request_id, letter.error_code or "",
             _preview(dlq.reason_text(letter.error) or ""), str(letter.deliveries or ""),
             letter.worker or "", age, truncated, _preview(text))
    if not lanes.sharded:
        return cells
    return ("-" if lane.shard is None else str(lane.shard), *cells)


def _preview(text: str) -> str:
    """``text`` on one line, cut to fit a table cell."""
    text = " ".join(text.split())
    return text[:_PREVIEW - 1] + "…" if len(text) > _PREVIEW else text


def _done(lanes: dlq.Lanes, verb: str, done: dict[keys.QueueRef, int],
          key: Callable[[keys.QueueRef], str], preposition: str) -> str:
    """``retried N dead letters onto KEY`` (or purged ... from), per lane when sharded."""
    head = f"{verb} {plural(sum(done.values()), 'dead letter')}"
    parts = [f"{n} {preposition} {key(lane)}" for lane, n in done.items() if n]
    if lanes.sharded and parts:
        return f"{head}: {', '.join(parts)}"
    return f"{head} {preposition} {lanes.where(key)}"


def _retry(r: redis.Redis, lanes: dlq.Lanes, work: Work, missing: list[str],
           settings: DlqSettings) -> bool:
    """Retry lane by lane, each onto its own stream (a full lane does not stop the others);
    True when something failed."""
    outcomes = [(lane, dlq.retry(r, lane, ids, drop_deadline=settings.drop_deadline,
                                 max_queue_length=settings.max_queue_length, until_full=True))
                for lane, ids in work]
    full = [outcome.full for _, outcome in outcomes if outcome.full is not None]
    if full and not lanes.sharded:
        print(f"tokenq dlq: {full[0]}", file=sys.stderr)
        return True
    moved = {lane: len(outcome.moved) for lane, outcome in outcomes}
    print(_done(lanes, "retried", moved, keys.requests, "onto") + _upto(lanes, outcomes))
    for line in full:
        print(f"tokenq dlq: {line}", file=sys.stderr)
    for lane, outcome in outcomes:
        _report_outcome(lanes, lane, outcome)
    missing = missing + [lanes.name(lane, one) for lane, outcome in outcomes
                         for one in outcome.missing]
    _report_missing(lanes, missing)
    return bool(missing or full or any(outcome.skipped for _, outcome in outcomes))


def _upto(lanes: dlq.Lanes, outcomes: list[tuple[keys.QueueRef, dlq.RetryOutcome]]) -> str:
    """``retry --all``'s snapshot end: where each lane's dead stream ended when it started."""
    ends = [outcome.last_id for _, outcome in outcomes if outcome.last_id is not None]
    if not ends:
        return ""
    if lanes.sharded:
        return " (in each lane, every letter up to the last there when the retry started)"
    return f" (every letter up to {ends[0]}, the last when the retry started)"


def _report_outcome(lanes: dlq.Lanes, lane: keys.QueueRef, outcome: dlq.RetryOutcome) -> None:
    """The letters of one lane a retry left in place or found gone, on stderr."""
    for one, why in outcome.skipped.items():
        print(f"tokenq dlq: skipped {lanes.name(lane, one)}: {why}; it stays in "
              f"{keys.dead(lane)} (inspect it with dlq list --id, drop it with dlq purge --id)",
              file=sys.stderr)
    if outcome.vanished:
        print(f"tokenq dlq: {plural(len(outcome.vanished), 'letter')} deleted by someone "
              f"else while the retry ran: "
              f"{', '.join(lanes.name(lane, one) for one in outcome.vanished)}", file=sys.stderr)


def _purge(r: redis.Redis, lanes: dlq.Lanes, work: Work, missing: list[str]) -> bool:
    """Purge lane by lane; True when a named letter was not there."""
    removed: dict[keys.QueueRef, int] = {}
    for lane, ids in work:
        removed[lane], gone = dlq.purge(r, lane, ids)
        missing = missing + [lanes.name(lane, one) for one in gone]
    print(_done(lanes, "purged", removed, keys.dead, "from"))
    _report_missing(lanes, missing)
    return bool(missing)
