"""What ``tokenq stats`` and ``top`` see: a read-only snapshot of the queues as JSON-ready dicts
(fields in docs/OPERATIONS.md: bump ``SNAPSHOT_VERSION`` when one changes meaning)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import redis

from tokenq.producer.redis_deadlines import sync_client_for
from tokenq.shared import functions, keys, redis_refusal
from tokenq.shared.errors import DecodeError
from tokenq.shared.exit_codes import EXIT_FAILED
from tokenq.shared.failures import CommandFailed, failure_message, is_wrong_type
from tokenq.shared.flags import UsageError
from tokenq.shared.heartbeat import Heartbeat, decode_heartbeat
from tokenq.shared.queue_config import parse_config
from tokenq.shared.queue_depth import Depth, lane_depth, total
from tokenq.shared.redis_text import as_text
from tokenq.shared.redis_url import redact as redact_url
from tokenq.shared.text import plural, ratio

SNAPSHOT_VERSION = 1


def connect(redis_url: str, socket_timeout_s: float = 5.0) -> redis.Redis:
    """A bytes client for operator commands (short timeouts, no retries): a bad URL is a
    :class:`UsageError`, a cluster that does not answer a :class:`CommandFailed`."""
    try:
        return sync_client_for(  # type: ignore[return-value]  # a cluster answers the same
            redis_url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            client_name="tokenq-ops")
    except ValueError as exc:
        raise UsageError(f"--redis-url (TOKENQ_REDIS_URL) {redact_url(redis_url)}: {exc}") from None
    except (redis.RedisError, redis.RedisClusterException) as exc:
        down = exc.__cause__ if isinstance(exc.__cause__, redis.RedisError) else exc
        raise CommandFailed(failure_message(down, redis_url, socket_timeout_s)
                            or str(exc)) from exc


@contextlib.contextmanager
def connection(redis_url: str, socket_timeout_s: float,
               queues: Iterable[keys.QueueRef]) -> Iterator[redis.Redis]:
    """:func:`connect` for one command, closed at the end; a Redis failure inside leaves as
    :func:`explain`'s one line."""
    r = connect(redis_url, socket_timeout_s)
    try:
        yield r
    except redis.RedisError as exc:
        raise explain(exc, r, queues, redis_url, socket_timeout_s) from exc
    finally:
        r.close()


def redis_now(r: redis.Redis) -> float:
    """Redis's clock (``TIME``, the one stream ids are on), in Unix seconds; the local
    clock where the ACL refuses ``TIME``."""
    try:
        seconds, micros = r.time()
    except redis.ResponseError:
        return time.time()
    return int(seconds) + int(micros) / 1e6


def pipelined(r: redis.Redis, call: Callable[[Any, Any], object], items: Iterable[Any]) -> list:
    """``call(pipe, item)`` for each item, in one round trip: the replies, in order."""
    with r.pipeline(transaction=False) as pipe:
        for item in items:
            call(pipe, item)
        return pipe.execute()


def explain(exc: redis.RedisError, r: redis.Redis, queues: Iterable[keys.QueueRef],
            redis_url: str, socket_timeout_s: float | None = None) -> CommandFailed:
    """``exc`` as the operator's one-line :class:`CommandFailed`; a WRONGTYPE names each of
    the queues' keys that has the wrong type."""
    message = failure_message(exc, redis_url, socket_timeout_s) or str(exc)
    if not is_wrong_type(exc):
        return CommandFailed(message)
    expected: dict[str, str] = {}
    for q in queues:
        expected.update({keys.requests(q): "stream", keys.dead(q): "stream",
                         keys.workers(q): "hash", keys.config(q): "hash"})
    try:
        found = [as_text(kind) for kind in pipelined(r, lambda pipe, k: pipe.type(k), expected)]
    except redis.RedisError:
        found = []
    culprits = [f"{name} is a {kind}, not a {expected[name]}"
                for name, kind in zip(expected, found, strict=False)
                if kind not in ("none", expected[name])]
    if culprits:
        message = (f"Redis at {redact_url(redis_url)}: {'; '.join(culprits)} (not written by "
                   "tokenq, or by another program using its prefix; rename or delete it, "
                   "or choose another --prefix)")
    return CommandFailed(message)


def _count(r: redis.Redis, key: str, field: str | None = None) -> int | None:
    """A shard count stored at ``key`` (a hash's ``field``), None when absent or not one."""
    try:
        raw = r.get(key) if field is None else r.hget(key, field)  # bytes (redis-py: or str)
    except redis.ResponseError as exc:
        if not is_wrong_type(exc):
            raise  # NOPERM: a sharded queue must not quietly look unsharded
        raw = None
    config = None if raw is None else parse_config({b"shards": raw})  # type: ignore[arg-type]
    shards = config.shards if config is not None else None
    return shards if shards is not None and shards <= keys.MAX_SHARDS else None


def lane_order(q: keys.QueueRef) -> tuple[str, int]:
    """By queue name, the plain ``{q}`` before its shards."""
    return q.name, q.shard if q.shard is not None else -1


def discover_queues(r: redis.Redis, prefix: str) -> list[keys.QueueRef]:
    """Every queue (and shard) with a request stream under ``prefix``, sorted by name."""
    found: dict[str, keys.QueueRef] = {}
    for raw in r.scan_iter(match=keys.requests_pattern(prefix), count=1000, _type="stream"):
        key = raw.decode() if isinstance(raw, bytes) else raw
        q = keys.queue_of(key, prefix)
        if q is not None:
            found[key] = q
    return sorted(found.values(), key=lane_order)


def queue_label(q: keys.QueueRef) -> str:
    """``name`` or ``name:shard``, as shown in the tables."""
    return q.name if q.shard is None else f"{q.name}:{q.shard}"


def snapshot(r: redis.Redis, queues: Iterable[keys.QueueRef], *, redis_url: str = "") -> dict:
    """The whole ``tokenq stats --json`` document for ``queues``, timed on Redis's clock; a
    lane Redis refuses to read (a wrong-type key, an ACL) goes under ``unreadable``."""
    now = redis_now(r)
    rows: list[dict[str, Any]] = []
    unreadable: list[dict[str, Any]] = []
    for q in queues:
        try:
            rows.append(queue_stats(r, q, now))
        except redis.ResponseError as exc:
            if not redis_refusal.key_refuses(exc):
                raise  # Redis's own state (loading, busy): the whole command's failure
            unreadable.append({"queue": q.name, "shard": q.shard, "label": queue_label(q),
                               "error": str(explain(exc, r, [q], redis_url))})
    doc = {"version": SNAPSHOT_VERSION, "at": round(now, 3),
           "redis_url": redact_url(redis_url) if redis_url else "", "queues": rows}
    by_queue: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_queue.setdefault(row["queue"], []).append(row)
    if sharded := [_queue_total(name, lanes) for name, lanes in by_queue.items()
                   if any(lane["shard"] is not None for lane in lanes)]:
        doc["totals"] = sharded  # one aggregate per sharded queue, in order
    if unreadable:
        doc["unreadable"] = unreadable
    return doc


def unreadable_lines(doc: dict[str, Any]) -> list[str]:
    return [f"queue {q['label']}: {q['error']}" for q in doc.get("unreadable", [])]


def report_unreadable(prog: str, doc: dict[str, Any]) -> int:
    """Name each unreadable queue on stderr; the status: 1 if there was any, else 0."""
    lines = unreadable_lines(doc)
    for line in lines:
        print(f"{prog}: {line}", file=sys.stderr)
    return EXIT_FAILED if lines else 0


def _queue_total(name: str, lanes: list[dict[str, Any]]) -> dict[str, Any]:
    """A sharded queue as a whole: its lanes summed, each worker counted once."""
    measured = total([Depth(lane["length"], lane["pending"], lane["lag"], lane["lag_exact"],
                            lane["pending_tokens"]) for lane in lanes])
    freshest: dict[str, dict[str, Any]] = {}  # each live worker once: it serves every lane
    for worker in sorted((w for lane in lanes for w in lane["workers"]), key=lambda w: -w["at"]):
        freshest.setdefault(worker["consumer"], worker)
    workers, live = [freshest[name] for name in sorted(freshest)], set(freshest)
    oldest = [lane["oldest_pending_ms"] for lane in lanes if lane["oldest_pending_ms"] is not None]
    shards = sum(1 for lane in lanes if lane["shard"] is not None)
    return {
        "queue": name, "label": f"{name} ({plural(shards, 'shard')})", "shards": shards,
        "lanes": [lane["label"] for lane in lanes],
        "length": measured.length, "pending_tokens": measured.tokens,
        "pending": measured.pending, "oldest_pending_ms": max(oldest) if oldest else None,
        "lag": measured.lag, "lag_exact": measured.lag_exact,
        "dead": sum(lane["dead"] for lane in lanes),
        "cache_bytes": lanes[0]["cache_bytes"],  # one cache for every shard
        "stale_workers": sorted({n for lane in lanes for n in lane["stale_workers"]} - live),
        "totals": _totals(workers),
    }


def queue_stats(r: redis.Redis, q: keys.QueueRef, now: float) -> dict[str, Any]:
    stream = keys.requests(q)
    group = _group_info(r, stream)
    oldest_pending_ms = None
    if group is not None:
        summary = r.xpending(stream, keys.GROUP)
        if summary.get("pending") and summary.get("min"):  # its oldest pending entry's age
            oldest_pending_ms = max(0, int(now * 1000) - entry_ms(summary["min"]))
    pending_hash: dict[bytes, bytes] = r.hgetall(keys.pending(q))  # type: ignore[assignment]
    measured = lane_depth(functions.Function(r, "queue_depth")(
        keys=[stream], args=["depth", keys.GROUP]), pending_hash)  # every stream, tenants' too
    workers, stale = _workers(r, q, now)
    return {
        "queue": q.name, "shard": q.shard, "label": queue_label(q), "stream": stream,
        "length": measured.length, "pending_tokens": measured.tokens,
        "pending": measured.pending,
        "oldest_pending_ms": oldest_pending_ms,
        "lag": measured.lag, "lag_exact": measured.lag_exact,
        "dead": int(r.xlen(keys.dead(q))),
        "cache_bytes": int(r.get(keys.cache(keys.QueueRef(q.name, q.prefix))[2]) or 0),
        "group": group is not None,
        "consumers": _consumers(r, stream) if group is not None else [],
        "workers": workers, "stale_workers": stale, "totals": _totals(workers),
        "tenants": tenant_rows(measured.tenants, workers),
        "config": {k.decode(): v.decode(errors="replace")  # type: ignore[union-attr]  # bytes
                   for k, v in r.hgetall(keys.config(q)).items()},
    }


def _group_info(r: redis.Redis, stream: str) -> dict[str, Any] | None:
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError as exc:
        if "no such key" in str(exc).lower():
            return None
        raise  # WRONGTYPE, NOPERM: the operator must hear of it
    for group in groups:
        if as_text(group.get("name")) == keys.GROUP:
            return group
    return None


def entry_ms(entry_id: bytes | str) -> int:
    """The Unix-ms timestamp a stream entry id starts with."""
    return int(as_text(entry_id).split("-", 1)[0])


def _consumers(r: redis.Redis, stream: str) -> list[dict[str, Any]]:
    out = [{"name": as_text(c.get("name")), "pending": int(c.get("pending") or 0),
            "idle_ms": int(c.get("idle") or 0),
            "inactive_ms": None if c.get("inactive") is None else int(c["inactive"])}
           for c in r.xinfo_consumers(stream, keys.GROUP)]
    return sorted(out, key=lambda c: c["name"])


def _workers(r: redis.Redis, q: keys.QueueRef,
             now: float) -> tuple[list[dict[str, Any]], list[str]]:
    """Live workers (heartbeat row and liveness key), and the names of the rest."""
    beats = heartbeats(r, q)
    alive = live_names(r, q, beats)
    live = {name: beat for name, beat in sorted(beats.items())
            if name in alive and beat is not None}
    return ([_worker_view(name, beat, now) for name, beat in live.items()],
            sorted(beats.keys() - live.keys()))


def live_names(r: redis.Redis, q: keys.QueueRef, names: Iterable[str]) -> set[str]:
    """Those of ``names`` whose liveness key still exists."""
    names = list(names)
    alive = pipelined(r, lambda pipe, name: pipe.exists(keys.worker_alive(q, name)), names)
    return {name for name, is_alive in zip(names, alive, strict=True) if is_alive}


def heartbeats(r: redis.Redis, q: keys.QueueRef) -> dict[str, Heartbeat | None]:
    """Each row of the workers hash by consumer: its heartbeat, None if it cannot be decoded."""
    beats: dict[str, Heartbeat | None] = {}
    for name, raw in r.hgetall(keys.workers(q)).items():
        try:
            beats[as_text(name)] = decode_heartbeat(raw)  # type: ignore[arg-type]  # bytes
        except DecodeError:
            beats[as_text(name)] = None
    return beats


_COPIED = ("host", "pid", "model", "max_batch_tokens", "configured_batch_tokens",
           "max_batch_size", "buffered", "requests_ok", "requests_failed", "batches", "tokens",
           "padded_tokens", "oom_splits", "cache_hits", "cache_misses", "coalesced")


def _worker_view(name: str, beat: Heartbeat, now: float) -> dict[str, Any]:
    """One live worker's entry (``at`` is on the worker's clock, ``now`` on Redis's)."""
    at = beat.at or now
    started = beat.started_at or at
    uptime = max(at - started, 1e-9)
    running = at > started
    return {
        "consumer": name,
        **{field: getattr(beat, field) for field in _COPIED},
        "device_ms": round(beat.device_ms, 3),
        "padding_efficiency": ratio(beat.tokens, beat.padded_tokens),
        "uptime_s": round(max(at - started, 0.0), 3),
        "requests_per_s": round(beat.requests / uptime, 3) if running else 0.0,
        "tokens_per_s": round(beat.tokens / uptime, 3) if running else 0.0,
        "heartbeat_age_s": round(max(now - at, 0.0), 3),
        "at": round(at, 3),
        "tenants": {label: {"requests": int(requests), "tokens": int(tokens), "p50_ms": p50,
                            "tokens_per_s": round(tokens / uptime, 3) if running else 0.0}
                    for label, (requests, tokens, p50) in (beat.tenants or {}).items()},
    }


def tenant_rows(pending: dict[str, int], workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per tenant of a lane: its pending tokens, and what the live workers answered for it
    (their p50: the highest of theirs, None if none answered it)."""
    labels = sorted({*pending, *(label for w in workers for label in w["tenants"])})
    rows = []
    for label in labels:
        served = [w["tenants"][label] for w in workers if label in w["tenants"]]
        rows.append({
            "tenant": label, "pending_tokens": pending.get(label, 0),
            "requests": sum(t["requests"] for t in served),
            "tokens": sum(t["tokens"] for t in served),
            "tokens_per_s": round(sum(t["tokens_per_s"] for t in served), 3),
            "p50_ms": max((t["p50_ms"] for t in served), default=None),
        })
    return rows


_SUMMED = ("requests_ok", "requests_failed", "batches", "tokens", "padded_tokens",
           "oom_splits", "buffered", "requests_per_s", "tokens_per_s", "cache_hits",
           "cache_misses", "coalesced")


def _totals(workers: list[dict[str, Any]]) -> dict[str, Any]:
    # round() leaves the integer counters as they are: only the rates have decimals
    totals: dict[str, Any] = {name: round(sum(w[name] for w in workers), 3) for name in _SUMMED}
    return {**totals, "workers": len(workers),
            "padding_efficiency": ratio(totals["tokens"], totals["padded_tokens"])}


_COUNTERS = ("requests_ok", "requests_failed", "batches", "tokens", "padded_tokens",
             "oom_splits", "device_ms")


def heartbeat_counters(r: redis.Redis, q: keys.QueueRef) -> dict[str, dict[str, float]]:
    """Each heartbeat's cumulative counters (and ``at``) by consumer, for deltas."""
    return {name: {**{field: float(getattr(beat, field)) for field in _COUNTERS},
                   "at": beat.at or 0.0}
            for name, beat in heartbeats(r, q).items() if beat is not None}


def counter_delta(before: dict[str, dict[str, float]], after: dict[str,
                  dict[str, float]]) -> dict[str, float | None]:
    """Summed counter increase between two :func:`heartbeat_counters` readings; a lower
    bound (a new worker counts from zero, a worker that left is lost)."""
    total = {field: 0.0 for field in _COUNTERS}
    for name, counters in after.items():
        base = before.get(name, {})
        for field in _COUNTERS:
            total[field] += max(0.0, counters[field] - base.get(field, 0.0))
    return {**total, "padding_efficiency": ratio(total["tokens"], total["padded_tokens"])}


def read_snapshot(r: redis.Redis, prefix: str, queue: str | None, redis_url: str,
                  socket_timeout_s: float | None = None) -> dict:
    """Discover (or take, with every lane) the queues and snapshot them."""
    queues: list[keys.QueueRef] = [keys.QueueRef(queue, prefix)] if queue else []
    try:
        if queue:  # every lane of a sharded queue, as SCAN would find them
            queues = sorted(known_lanes(r, queues[0]), key=lane_order)
        else:
            queues = discover_queues(r, prefix)
        return snapshot(r, queues, redis_url=redis_url)
    except redis.RedisError as exc:
        raise explain(exc, r, queues, redis_url, socket_timeout_s) from exc


def known_lanes(r: redis.Redis, q: keys.QueueRef) -> tuple[keys.QueueRef, ...]:
    """Every lane ``q`` is served on: its shards (retired ones that still have a stream too)
    then the plain ``{q}``, by its config's ``shards`` (docs/OPERATIONS.md, "Changing K"); a
    :class:`CommandFailed` when no lane has a key (a misspelt ``--queue``)."""
    shards = _count(r, keys.config(q), "shards") or 1
    lanes = keys.lanes_of(q, shards)
    served = _count(r, keys.shards_served(q)) or 1
    retired = [shard for shard in keys.retired_shards(q, shards, served)
               if r.exists(keys.requests(shard))]
    if retired:
        lanes = (*(lane for lane in lanes if lane.shard is not None), *retired, q)
    if any(r.exists(keys.requests(lane), keys.config(lane), keys.workers(lane), keys.dead(lane))
           for lane in lanes):  # one EXISTS per lane, its keys in one slot
        return lanes
    known = sorted({found.name for found in discover_queues(r, q.prefix)})
    there = f"queues under it: {', '.join(known)}" if known else "no queue has keys under it"
    raise CommandFailed(
        f"queue {q.name!r} has no keys under prefix {q.prefix!r} (no request stream, config, "
        f"workers or dead letters; nothing has served or enqueued to it): check --queue and "
        f"--prefix; {there}")
