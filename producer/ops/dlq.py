"""``tokenq dlq list|retry|purge``: show, re-enqueue (``dlq_retry.lua``, atomically) or delete
dead letters, lane by lane; letters named but not found or skipped make the exit status 1."""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from tokenq.producer.ops.snapshot import connection, entry_ms, known_lanes, pipelined, redis_now
from tokenq.producer.ops.stats import format_table
from tokenq.shared import functions, keys, lua_scripts
from tokenq.shared.cli import run_command
from tokenq.shared.dead_letter import DeadLetter, parse_letter
from tokenq.shared.redis_text import as_text
from tokenq.shared.settings import DlqSettings
from tokenq.shared.text import plural

_PAGE = 100
_MAX_U64 = (1 << 64) - 1
# A Python bytes literal (``b'9'``, ``b"\\xff"``), as some workers' messages quote a field.
_BYTES_LITERAL = re.compile(r"""(?<![\w'"])b('(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")""")


def reason_text(reason: str | None) -> str | None:
    """Why a letter died, each bytes literal in it as its UTF-8 text (``b'9'`` becomes
    ``'9'``, undecodable bytes U+FFFD), so no one decodes ``b'\\xe2\\x80\\xa6'`` by hand."""
    if reason is None:
        return None

    def decoded(match: re.Match[str]) -> str:
        try:
            value = ast.literal_eval(match.group(0))
        except (ValueError, SyntaxError):
            return match.group(0)
        return repr(value.decode("utf-8", "replace")) if isinstance(value, bytes) else str(value)

    return _BYTES_LITERAL.sub(decoded, reason)


@dataclass(slots=True)
class RetryOutcome:
    """What :func:`retry` did, letter by letter (dead-stream entry ids)."""

    moved: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # named ids not there
    vanished: list[str] = field(default_factory=list)  # --all: deleted by someone meanwhile
    skipped: dict[str, str] = field(default_factory=dict)  # left in place, id -> why
    last_id: str | None = None  # --all: the dead stream's last id when the retry started
    full: str | None = None  # why it stopped early: a page would have overfilled the queue


def entry_id(text: str) -> str | None:
    """``text`` as a complete stream id (a bare ``ms`` means ``ms-0``), or None: XRANGE
    would read a bare ``ms`` as a range, XDEL as ``ms-0``."""
    ms, dash, seq = text.strip().partition("-")
    if not dash:
        seq = "0"
    if not (ms.isascii() and ms.isdigit() and seq.isascii() and seq.isdigit()):
        return None
    if int(ms) > _MAX_U64 or int(seq) > _MAX_U64:
        return None
    return f"{int(ms)}-{int(seq)}"


PLAIN = "plain"  # a letter's lane on a sharded queue's plain {q} (``-`` would read as a flag)


Target = tuple[keys.QueueRef | None, str]
"""One letter an operator named: its lane (None: whichever holds it), and its entry id."""


@dataclass(frozen=True, slots=True)
class Lanes:
    """A queue's lanes, and the letters' names: entry ids are per stream, so in a sharded
    queue a letter is ``<shard>/<entry id>`` (``plain/<entry id>``), else its entry id."""

    queue: keys.QueueRef
    all: tuple[keys.QueueRef, ...]

    @property
    def sharded(self) -> bool:
        return len(self.all) > 1

    def name(self, lane: keys.QueueRef | None, entry: str) -> str:
        """The letter ``entry`` of ``lane`` as the table shows it and ``--id`` takes it."""
        if not self.sharded or lane is None:
            return entry
        return f"{PLAIN if lane.shard is None else lane.shard}/{entry}"

    def where(self, key: Callable[[keys.QueueRef], str]) -> str:
        """The lanes' ``key`` for a summary: ``tokenq:{q:0}:dead … tokenq:{q:2}:dead and
        tokenq:{q}:dead``, or the one key."""
        if not self.sharded:
            return key(self.queue)
        *shards, plain = self.all
        between = ", " if len(shards) == 2 else " … "
        return f"{key(shards[0])}{between}{key(shards[-1])} and {key(plain)}"

    def targets(self, words: Sequence[str]) -> tuple[list[Target], list[str]]:
        """(the letters named, in order and without repeats, a bare id in a sharded queue with
        lane None: whichever holds it; each word naming none, with why)."""
        wanted: list[Target] = []
        invalid: list[str] = []
        for word in words:
            head, slash, tail = word.partition("/")
            named = self.sharded and slash
            normal = entry_id(tail if named else word)
            lane = self._lane(head.strip()) if named else None if self.sharded else self.queue
            if normal is None:
                invalid.append(f"{word} (not a stream entry id)")
            elif named and lane is None:
                invalid.append(f"{word} (no such shard: the queue has shards "
                               f"0-{len(self.all) - 2} and plain)")
            elif (lane, normal) not in wanted:
                wanted.append((lane, normal))
        return wanted, invalid

    def candidates(self, target: Target) -> list[tuple[keys.QueueRef, str]]:
        """Where ``target`` may be: its lane, or every lane for a bare id."""
        lane, entry = target
        return [(one, entry) for one in (self.all if lane is None else (lane,))]

    def _lane(self, text: str) -> keys.QueueRef | None:
        if text == PLAIN:
            return self.queue
        if not (text.isascii() and text.isdigit()) or int(text) >= len(self.all) - 1:
            return None
        return self.all[int(text)]


Letters = list[tuple[keys.QueueRef, DeadLetter]]  # each with its lane


def read_letters(r: redis.Redis, where: Sequence[tuple[keys.QueueRef, str]]) -> Letters:
    """The letters at each ``(lane, complete entry id)`` that holds one, in order (one pipeline)."""
    if not where:
        return []
    found = pipelined(r, lambda pipe, at: pipe.xrange(keys.dead(at[0]), at[1], at[1]), where)
    return [(lane, parse_letter(i, f))
            for (lane, _), entries in zip(where, found, strict=True) for i, f in entries]


def oldest(r: redis.Redis, lanes: Lanes, limit: int) -> Letters:
    """The ``limit`` oldest letters of all the lanes together (by entry id time; then lane)."""
    found = pipelined(r, lambda pipe, lane: pipe.xrange(keys.dead(lane), "-", "+", count=limit),
                      lanes.all)
    merged = [(_id_order(i), at, lane, parse_letter(i, f))
              for at, (lane, entries) in enumerate(zip(lanes.all, found, strict=True))
              for i, f in entries]
    merged.sort(key=lambda one: (one[0], one[1]))
    return [(lane, letter) for _, _, lane, letter in merged[:limit]]


def _id_order(raw: bytes | str) -> tuple[int, int]:
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms), int(seq or 0)


Found = tuple[Letters, dict[keys.QueueRef, list[str]], list[str], dict[str, list[str]]]


def find(r: redis.Redis, lanes: Lanes, words: Sequence[str]) -> Found:
    """The letters ``words`` name: (those read, each lane's that hold one; their entry ids by
    lane; the words naming none, with why; bare id -> the names of the letters in several
    lanes, placed nowhere: a wrong letter cannot be undone)."""
    targets, missing = lanes.targets(words)
    letters = read_letters(r, [one for t in targets for one in lanes.candidates(t)])
    found = {(lane, letter.entry_id) for lane, letter in letters}
    by_lane: dict[keys.QueueRef, list[str]] = {}
    ambiguous: dict[str, list[str]] = {}
    for target in targets:
        named, entry = target
        where = [lane for lane, one in lanes.candidates(target) if (lane, one) in found]
        if not where:
            missing.append(lanes.name(named, entry))
        elif len(where) > 1:
            ambiguous[entry] = [lanes.name(lane, entry) for lane in where]
        else:
            by_lane.setdefault(where[0], []).append(entry)
    placed = {lane: by_lane[lane] for lane in lanes.all if lane in by_lane}
    return letters, placed, missing, ambiguous


def _pages(r: redis.Redis, q: keys.QueueRef, end: str) -> Iterator[list[str]]:
    """Dead entry ids up to ``end``, a page at a time (each handled before the next read)."""
    start = "-"
    while True:
        # redis-py types ids bytes | str | None: this client's replies are bytes
        entries: list[tuple[bytes, Any]] = r.xrange(  # type: ignore[assignment]
            keys.dead(q), start, end, count=_PAGE)
        if not entries:
            return
        yield [one.decode() for one, _ in entries]
        if entries[-1][0].decode() == end:
            return
        start = "(" + entries[-1][0].decode()


def retry(r: redis.Redis, q: keys.QueueRef, ids: Sequence[str] | None, *, max_queue_length: int,
          drop_deadline: bool = False) -> RetryOutcome:
    """Re-enqueue the letters of complete entry ids ``ids`` (None: every letter there when it
    starts); a page that would pass ``max_queue_length`` ends it with ``outcome.full`` set
    (earlier pages stay moved)."""
    script = functions.Function(r, "dlq_retry")  # dlq_retry.lua, by FCALL
    outcome = RetryOutcome()
    if ids is None:
        newest: list[tuple[bytes, Any]] = r.xrevrange(  # type: ignore[assignment]  # as in _pages
            keys.dead(q), "+", "-", count=1)
        outcome.last_id = newest[0][0].decode() if newest else None
        pages: Iterator[Sequence[str]] = iter(()) if outcome.last_id is None else _pages(
            r, q, outcome.last_id)
    else:
        pages = (ids[i:i + _PAGE] for i in range(0, len(ids), _PAGE))
    for whole in pages:
        for tenant, page in _by_tenant(r, q, whole).items():
            try:
                answers = script(keys=[keys.dead(q), keys.tenant_requests(q, tenant)],
                                 args=[max_queue_length, "1" if drop_deadline else "0", *page])
            except redis.ResponseError as exc:
                full = lua_scripts.parse_queue_full(str(exc))
                if full is None:
                    raise
                lane = "" if q.shard is None else f"shard {q.shard} of "  # the limit is per lane
                whose = "" if tenant == keys.DEFAULT_TENANT else f"tenant {tenant!r} of "
                outcome.full = (f"{whose}{lane}queue {q.name!r} holds {full.length} of at most "
                                f"{full.limit} requests; moved "
                                f"{plural(len(outcome.moved), 'dead letter')} before it filled")
                return outcome
            _tally(outcome, page, answers, listed=ids is not None)
    return outcome


def _by_tenant(r: redis.Redis, q: keys.QueueRef, page: Sequence[str]) -> dict[str, list[str]]:
    """The page's ids by the tenant whose stream each letter goes back to (one round trip)."""
    tenants = {one.entry_id: one.tenant for _, one in read_letters(r, [(q, i) for i in page])}
    groups: dict[str, list[str]] = {}
    for one in page:
        groups.setdefault(tenants.get(one, keys.DEFAULT_TENANT), []).append(one)
    return groups


def _tally(outcome: RetryOutcome, page: Sequence[str], answers: Any, *, listed: bool) -> None:
    """What the script did with each letter of ``page``, into ``outcome``."""
    for one, answer in zip(page, answers, strict=True):
        if isinstance(answer, list):  # [b"truncated", b"text,opts"] or [b"empty", b""]
            outcome.skipped[one] = _skip_reason(answer)
        elif answer:
            outcome.moved.append(one)
        elif listed:
            outcome.missing.append(one)
        else:
            outcome.vanished.append(one)


def _skip_reason(answer: list[bytes]) -> str:
    kind = answer[0].decode(errors="replace") if answer else ""
    detail = answer[1].decode(errors="replace") if len(answer) > 1 else ""
    if kind == "truncated":
        return (f"truncated: the worker cut {detail or 'some fields'} to fit its dead-letter "
                "size cap, so it is not the request as written")
    return "it holds no request fields, only dead_* ones: nothing to put back"


def purge(r: redis.Redis, q: keys.QueueRef, ids: Sequence[str] | None) -> tuple[int, list[str]]:
    """Delete the letters of complete entry ids ``ids`` (None: the whole dead stream): (how
    many, the named ids not there)."""
    if ids is None:
        dead = keys.dead(q)

        def drop(pipe: redis.client.Pipeline) -> None:
            kind = as_text(pipe.type(dead))
            if kind not in ("stream", "none"):  # never DEL what is not a dead stream
                raise redis.ResponseError(
                    f"WRONGTYPE {dead} is a {kind}, not a stream: not deleted")
            pipe.multi()
            pipe.xlen(dead)
            pipe.delete(dead)

        removed, _ = r.transaction(drop, dead)  # type: ignore[misc]  # redis-py: list | None
        return int(removed), []
    missing: list[str] = []
    removed = 0
    for start in range(0, len(ids), _PAGE):
        page = ids[start:start + _PAGE]
        deleted = pipelined(r, lambda pipe, one: pipe.xdel(keys.dead(q), one), page)
        for one, n in zip(page, deleted, strict=True):
            if int(n):
                removed += 1
            else:
                missing.append(one)
    return removed, missing


_PREVIEW = 60
_ID_WORD = re.compile(rf"(?:(?:\d+|{PLAIN})/)?\d+(?:-\d*)?")  # an entry id or a letter's name

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
        lanes = Lanes(q, known_lanes(r, q))
        checked[:] = lanes.all
        if settings.action == "list":
            return _list(r, lanes, settings)
        work: Work = [(lane, None) for lane in lanes.all]
        missing: list[str] = []
        ambiguous: dict[str, list[str]] = {}
        if not settings.all:
            _, by_lane, missing, ambiguous = find(r, lanes, settings.id)
            work = list(by_lane.items())
        if settings.action == "retry":
            failed = _retry(r, lanes, work, missing, settings)
        else:
            failed = _purge(r, lanes, work, missing)
        verb = "retried" if settings.action == "retry" else "purged"
        _report_ambiguous(ambiguous, f"not {verb}; name the one you mean")
        return 1 if failed or ambiguous else 0


def _report_missing(lanes: Lanes, missing: list[str]) -> None:
    if not missing:
        return
    where = "any of the queue's dead streams" if lanes.sharded else "the dead stream"
    print(f"tokenq dlq: not in {where}: {', '.join(missing)}", file=sys.stderr)


def _report_ambiguous(ambiguous: dict[str, list[str]], outcome: str) -> None:
    for one, names in ambiguous.items():
        print(f"tokenq dlq: {one} is in more than one dead stream ({', '.join(names)}): "
              f"{outcome}", file=sys.stderr)


_COLUMNS = ("entry", "request", "code", "reason", "deliveries", "worker", "age", "truncated",
            "text")


def _list(r: redis.Redis, lanes: Lanes, settings: DlqSettings) -> int:
    letters, _, missing, ambiguous = find(r, lanes, settings.id)
    if not settings.id:
        letters = oldest(r, lanes, settings.count)
    if settings.as_json:
        for lane, letter in letters:
            print(json.dumps(_letter_json(lanes, lane, letter), ensure_ascii=False))
    else:
        total = sum(pipelined(r, lambda pipe, lane: pipe.xlen(keys.dead(lane)), lanes.all))
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


def _letter_json(lanes: Lanes, lane: keys.QueueRef, letter: DeadLetter) -> dict[str, Any]:
    """A letter's ``--json`` line: text fields as strings, binary ones (``opts``) as hex; a
    sharded queue's also says its lane and its name."""
    where = {"shard": lane.shard, "entry": lanes.name(lane, letter.entry_id)}
    return {
        **(where if lanes.sharded else {}),
        "entry_id": letter.entry_id, "request_id": letter.request_id,
        "error_code": letter.error_code, "error": reason_text(letter.error),
        "worker": letter.worker, "deliveries": letter.deliveries, "at_ms": letter.at_ms,
        "source_id": letter.source_id, "tenant": letter.tenant, "truncated": letter.truncated,
        "request": {name: value if isinstance(value, str) else {"hex": value.hex()}
                    for name, value in letter.request.items()},
    }


def _row(lanes: Lanes, lane: keys.QueueRef, letter: DeadLetter, now_ms: int) -> tuple[str, ...]:
    """One letter as table cells; its age is from its entry id against Redis's clock."""
    age = f"{max(0, now_ms - entry_ms(letter.entry_id)) / 1000:.0f}s"
    text = letter.request.get("text", "")
    text = text if isinstance(text, str) else "<binary>"
    truncated = ",".join(letter.truncated) if letter.truncated else ""
    cells = (lanes.name(lane, letter.entry_id), letter.request_id, letter.error_code or "",
             _preview(reason_text(letter.error) or ""), str(letter.deliveries or ""),
             letter.worker or "", age, truncated, _preview(text))
    if not lanes.sharded:
        return cells
    return ("-" if lane.shard is None else str(lane.shard), *cells)


def _preview(text: str) -> str:
    text = " ".join(text.split())
    return text[:_PREVIEW - 1] + "…" if len(text) > _PREVIEW else text


def _done(lanes: Lanes, verb: str, done: dict[keys.QueueRef, int],
          key: Callable[[keys.QueueRef], str], preposition: str) -> str:
    """``retried N dead letters onto KEY`` (or purged ... from), per lane when sharded."""
    head = f"{verb} {plural(sum(done.values()), 'dead letter')}"
    parts = [f"{n} {preposition} {key(lane)}" for lane, n in done.items() if n]
    if lanes.sharded and parts:
        return f"{head}: {', '.join(parts)}"
    return f"{head} {preposition} {lanes.where(key)}"


def _retry(r: redis.Redis, lanes: Lanes, work: Work, missing: list[str],
           settings: DlqSettings) -> bool:
    """Retry lane by lane, each onto its own stream (a full lane does not stop the others);
    the letters left in place or found gone named on stderr; True when something failed."""
    outcomes = [(lane, retry(r, lane, ids, drop_deadline=settings.drop_deadline,
                             max_queue_length=settings.max_queue_length)) for lane, ids in work]
    full = [outcome.full for _, outcome in outcomes if outcome.full is not None]
    if full and not lanes.sharded:
        print(f"tokenq dlq: {full[0]}", file=sys.stderr)
        return True
    moved = {lane: len(outcome.moved) for lane, outcome in outcomes}
    ends = [outcome.last_id for _, outcome in outcomes if outcome.last_id is not None]
    upto = f" (every letter up to {ends[0]}, the last when the retry started)" if ends else ""
    if ends and lanes.sharded:  # retry --all's end: each lane's last letter when it started
        upto = " (in each lane, every letter up to the last there when the retry started)"
    print(_done(lanes, "retried", moved, keys.requests, "onto") + upto)
    for line in full:
        print(f"tokenq dlq: {line}", file=sys.stderr)
    for lane, outcome in outcomes:
        for one, why in outcome.skipped.items():
            print(f"tokenq dlq: skipped {lanes.name(lane, one)}: {why}; it stays in "
                  f"{keys.dead(lane)} (inspect it with dlq list --id, drop it with dlq purge "
                  "--id)", file=sys.stderr)
        if outcome.vanished:
            print(f"tokenq dlq: {plural(len(outcome.vanished), 'letter')} deleted by someone "
                  f"else while the retry ran: "
                  f"{', '.join(lanes.name(lane, one) for one in outcome.vanished)}",
                  file=sys.stderr)
    missing = missing + [lanes.name(lane, one) for lane, outcome in outcomes
                         for one in outcome.missing]
    _report_missing(lanes, missing)
    return bool(missing or full or any(outcome.skipped for _, outcome in outcomes))


def _purge(r: redis.Redis, lanes: Lanes, work: Work, missing: list[str]) -> bool:
    """Purge lane by lane; True when a named letter was not there."""
    removed: dict[keys.QueueRef, int] = {}
    for lane, ids in work:
        removed[lane], gone = purge(r, lane, ids)
        missing = missing + [lanes.name(lane, one) for one in gone]
    print(_done(lanes, "purged", removed, keys.dead, "from"))
    _report_missing(lanes, missing)
    return bool(missing)
