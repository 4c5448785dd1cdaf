"""One answer per ``Idempotency-Key``: the first attempt's, kept in Redis for any replica's retry;
a record and a lease per key (docs/RELIABILITY.md, "Idempotent retries")."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from contextvars import ContextVar
from dataclasses import dataclass

import msgpack
import redis

from tokenq.producer import AsyncClient, BrokerUnavailable
from tokenq.producer.serve.errors import ApiError
from tokenq.shared import keys
from tokenq.shared.keys import QueueRef

POLL_S = 0.1  # how often a retry asks whether the attempt it waits on has stored its answer

SETTLE_TIMEOUT_S = 1.0
"""How long storing an answer or dropping a lease may hold up the answer (a hung Redis)."""

LEASE_GRACE_S = 2.0
"""How long past ``--timeout-s`` a computing request's lease lasts (its store, its cleanup)."""

HEADER = "Idempotency-Key"  # OpenAI's API and Stripe-style clients name a retried request so

MAX_KEY_CHARS = 255  # the longest key taken (OpenAI's and Stripe's own limit)

log = logging.getLogger("tokenq.serve")

current: ContextVar[Claim | None] = ContextVar("tokenq_idempotency_claim", default=None)
"""The claim of the request being answered, for the route's answer to store (Gateway.answer)."""


@dataclass
class Replay(Exception):
    """The stored answer of an earlier attempt, to send as it is."""

    status: int
    body: bytes


@dataclass(slots=True)
class Claim:
    """This request computes its key's answer: :meth:`store` it, or :meth:`release` the lease."""

    client: AsyncClient
    record: str
    lease: str
    fingerprint: bytes
    window_ms: int
    unique: list[str]
    max_bytes: int
    stored: bool = False

    async def store(self, status: int, body: bytes) -> None:
        """Keep the answer for the window, then drop the replies it was made of; one over
        ``max_bytes`` or refused by Redis is not kept (the replies stay for a retry)."""
        if len(body) > self.max_bytes:
            log.info("an Idempotency-Key's answer of %d bytes is over --max-body-bytes; "
                     "a retry rebuilds it from the kept replies", len(body))
            return
        value = msgpack.packb({"fp": self.fingerprint, "status": status, "body": body})
        try:
            await asyncio.wait_for(self.client.command("set", self.record, value,
                                                       px=self.window_ms), SETTLE_TIMEOUT_S)
        except (redis.ResponseError, BrokerUnavailable, asyncio.TimeoutError) as refused:
            log.warning("could not store the answer of an Idempotency-Key (%s); a retry "
                        "within the window recomputes it from the kept replies", refused)
            return
        self.stored = True
        try:
            await asyncio.wait_for(self.client.forget(self.unique), SETTLE_TIMEOUT_S)
        except (redis.ResponseError, BrokerUnavailable, asyncio.TimeoutError) as refused:
            log.debug("could not drop the replies of a stored answer (%s); they expire", refused)

    async def release(self) -> None:
        """Let a retry take over at once (best effort: the lease expires anyway)."""
        try:
            await asyncio.wait_for(self.client.command("delete", self.lease), SETTLE_TIMEOUT_S)
        except (redis.ResponseError, BrokerUnavailable, asyncio.TimeoutError):
            log.debug("could not drop an Idempotency-Key's lease; it expires")


def body_digest(body: bytes) -> bytes:
    """What :func:`request_ids` knows of a body (kept instead of the body itself)."""
    return hashlib.sha256(body).digest()


def request_ids(key: str, queue: str, digest: bytes, count: int) -> list[str]:
    """``count`` request ids (32 hex digits) that only this key, queue and body produce (a key
    reused for another body is other work)."""
    if not 0 < len(key) <= MAX_KEY_CHARS:
        raise ApiError(400, f"{HEADER}: 1 to {MAX_KEY_CHARS} characters", param=HEADER,
                       code="invalid_idempotency_key")
    base = hashlib.sha256(b"\0".join((key.encode(), queue.encode(), digest))).digest()
    return [hashlib.sha256(base + index.to_bytes(8, "big")).hexdigest()[:32]
            for index in range(count)]


def key_digest(key: str) -> str:
    """The ``<h>`` of a key's Redis names: the client's text, of any characters, hashed."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def fingerprint(route: str, body_digest: bytes) -> bytes:
    """What a key is bound to: the route and the body."""
    return route.encode() + b"\0" + body_digest


async def claim(
    client: AsyncClient, queue: QueueRef, key: str, fp: bytes, unique: list[str], *,
    window_s: float, timeout_s: float, max_bytes: int,
) -> Claim | None:
    """This request's claim on ``key``'s answer, :class:`Replay` when stored; waits for another
    holder's lease up to ``timeout_s`` (then 409); None when Redis refuses the claim."""
    digest = key_digest(key)
    record = keys.idempotent_answer(queue, digest)
    lease = keys.idempotent_lease(queue, digest)
    window_ms = max(1, int(window_s * 1000))
    lease_ms = int((timeout_s + LEASE_GRACE_S) * 1000)
    token = secrets.token_hex(8)
    own = Claim(client, record, lease, fp, window_ms, unique, max_bytes)
    until = time.monotonic() + timeout_s
    pending = msgpack.packb({"fp": fp})
    try:
        while True:
            if not await client.command("set", record, pending, nx=True, px=window_ms):
                held = await client.command("get", record)
                if held is None:
                    continue  # it expired between the two: claim it afresh
                _check(msgpack.unpackb(held), fp)
            # the first to claim, or the first attempt is gone: take over its requests
            if await client.command("set", lease, token, nx=True, px=lease_ms):
                return own
            if time.monotonic() >= until:  # the first attempt still computes (the IETF draft's 409)
                raise ApiError(409, f"a request with this {HEADER} is still being answered; "
                               "retry later for its answer", param=HEADER,
                               code="idempotency_key_in_flight",
                               headers={"Retry-After": "1", "x-should-retry": "true"})
            await asyncio.sleep(POLL_S)
    except redis.ResponseError as refused:
        log.warning("could not claim an Idempotency-Key (%s); answering without storing "
                    "the answer", refused)
        return None


def _check(held: dict[str, object], fp: bytes) -> None:
    """Refuse a key bound to another route or body; replay a stored answer."""
    if held.get("fp") != fp:
        raise ApiError(422, f"this {HEADER} was used with another route or request body "
                       "within the dedupe window; use a new key for a new request",
                       param=HEADER, code="idempotency_key_reused")
    status, body = held.get("status"), held.get("body")
    if isinstance(status, int) and isinstance(body, bytes):
        raise Replay(status, body)

