"""``tokenq quotas``: the operator's caps on each tenant's pending tokens (``keys.quotas``, held
by ``enqueue.lua``), the same on every lane of a sharded queue."""

from __future__ import annotations

import json
from collections.abc import Sequence

import redis

from tokenq.producer.ops.snapshot import connection, known_lanes
from tokenq.shared import keys
from tokenq.shared.cli import run_command
from tokenq.shared.failures import CommandFailed
from tokenq.shared.redis_text import as_text
from tokenq.shared.settings import QuotasSettings

ACTIONS = {
    "show": "each quota (field '*': tenants not named) and each tenant's pending tokens",
    "set": "cap --tenant's pending tokens at --tokens (enqueue refuses past it, that tenant only)",
    "clear": "remove --tenant's quota, or --all of them (no cap)",
}


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(QuotasSettings, list(argv or []), "tokenq quotas", run, ACTIONS)


def lanes(r: redis.Redis, q: keys.QueueRef) -> tuple[keys.QueueRef, ...]:
    """Where ``q`` takes requests (:func:`known_lanes`); a queue nothing has used yet: ``{q}``,
    so its caps hold from its first request."""
    try:
        return known_lanes(r, q)
    except CommandFailed:
        return (q,)


def run(settings: QuotasSettings) -> int:
    q = settings.queue_ref
    with connection(settings.redis_url, settings.socket_timeout_s, [q]) as r:
        where = lanes(r, q)
        if settings.action == "set":
            for lane in where:
                r.hset(keys.quotas(lane), str(settings.tenant), str(settings.tokens))
            print(f"tenant {settings.tenant!r} of queue {q.name!r}: at most {settings.tokens} "
                  "pending tokens")
        elif settings.action == "clear":
            for lane in where:
                if settings.all:
                    r.delete(keys.quotas(lane))
                else:
                    r.hdel(keys.quotas(lane), str(settings.tenant))
            print(f"cleared {'every quota' if settings.all else repr(settings.tenant)} of "
                  f"queue {q.name!r}")
        else:
            show(r, where, as_json=settings.as_json)
    return 0


def show(r: redis.Redis, where: Sequence[keys.QueueRef], *, as_json: bool) -> None:
    """Each tenant's quota (as the hash holds it: a bad value or field shown as
    :func:`_shown` bounds it) and pending tokens, summed over the lanes."""
    caps: dict[str, str] = {}
    held: dict[str, int] = {}
    for lane in where:
        caps.update({_shown(as_text(k)): _shown(as_text(v))
                     for k, v in r.hgetall(keys.quotas(lane)).items()})
        for tenant, tokens in keys.tenant_pending(r.hgetall(keys.pending(lane))).items():
            held[tenant] = held.get(tenant, 0) + tokens
    names = sorted(set(caps) | set(held), key=lambda name: (name == "*", name))
    if as_json:
        print(json.dumps({name: {"quota": caps.get(name), "pending_tokens": held.get(name)}
                          for name in names}))
        return
    print(f"{'TENANT':<24} {'QUOTA':>16} {'PENDING':>12}")
    for name in names:
        quota = caps.get(name) or (f"{caps['*']} (*)" if "*" in caps and name != "*" else "-")
        pending = "" if name == "*" else str(held.get(name, 0))
        print(f"{name:<24} {quota:>16} {pending:>12}".rstrip())


SHOWN_AT_MOST = 64
"""Most characters of a hash field or value shown (one written by hand may be megabytes): the
longest tenant name, so a tenant's row is its whole name, beside its pending tokens."""


def _shown(text: str) -> str:
    """``text`` as printed: its repr when not printable (escapes reach no terminal), cut to
    :data:`SHOWN_AT_MOST` characters with "..."."""
    if not text.isprintable():
        text = repr(text)
    return text if len(text) <= SHOWN_AT_MOST else text[:SHOWN_AT_MOST - 3] + "..."
