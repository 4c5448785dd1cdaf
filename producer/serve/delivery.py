"""How a route's job reaches its queue: no live worker (503, or ``--cold-start-s``), a Redis gone
(0033-gateway-503s), one answer per ``Idempotency-Key`` (docs/RELIABILITY.md)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import redis

from tokenq.producer import AsyncClient, BrokerUnavailable, DeadlineExceeded, Result
from tokenq.producer.serve.errors import ApiError, from_exception
from tokenq.producer.serve.schemas import Job
from tokenq.shared import keys
from tokenq.shared.keys import QueueRef

log = logging.getLogger("tokenq.serve")
T = TypeVar("T")

ALIVE_CACHE_S = 1.0  # how long a queue seen with a live worker is taken to still have one
WORKER_POLL_S = 0.25  # how often a cold start asks whether a worker has come alive
PROBE_S = 0.25  # how often a waiting request's queue is asked whether its Redis still answers
PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for ``XLEN``: a Redis silent that long is gone or frozen."""


def no_worker(queue: str, why: str) -> ApiError:
    return ApiError(503, f"no live worker serves queue {queue!r}: {why}", code="no_worker",
                    headers={"Retry-After": "1"})


class Reachability:
    """Whether each queue's Redis still answers, asked at most once per :data:`PROBE_S`
    per queue: every request waiting on the queue shares the probe in flight; and whether
    the queue has a live worker, a yes kept for :data:`ALIVE_CACHE_S`."""

    def __init__(self) -> None:
        self._probes: dict[str, tuple[float, asyncio.Future[BrokerUnavailable | None]]] = {}
        self._alive_at: dict[str, float] = {}

    async def alive(self, queue: str, client: AsyncClient) -> bool:
        if time.monotonic() - self._alive_at.get(queue, float("-inf")) < ALIVE_CACHE_S:
            return True
        if await client.workers_alive():
            self._alive_at[queue] = time.monotonic()
            return True
        return False

    async def check(self, queue: str, client: AsyncClient) -> None:
        """Raise the queue's outage unless its Redis answered the latest probe."""
        started, probe = self._probes.get(queue, (0.0, None))
        if probe is None or (probe.done() and time.monotonic() - started >= PROBE_S):
            probe = asyncio.ensure_future(_probe(client))
            self._probes[queue] = (time.monotonic(), probe)
        down = await asyncio.shield(probe)  # a waiter that leaves does not end the others' probe
        if down is not None:
            raise down

    async def announce(self, clients: dict[str, AsyncClient]) -> None:
        """At start, log one line per Redis that does not answer (routes answer 503 till then)."""
        said = set()
        for queue, client in clients.items():
            try:
                await self.check(queue, client)
            except BrokerUnavailable as down:
                why = str(down).rstrip(".")
                if why not in said:
                    said.add(why)
                    log.warning("tokenq serve: %s; every route answers 503 until it answers", why)

    async def watch(self, queue: str, client: AsyncClient, work: asyncio.Future[T]) -> T:
        """``work``'s result, or the queue's outage as soon as a probe finds Redis gone (``work``
        is then cancelled)."""
        try:
            while True:
                done, _ = await asyncio.wait({work}, timeout=PROBE_S)
                if done:
                    return work.result()
                check = asyncio.ensure_future(self.check(queue, client))
                try:
                    either: set[asyncio.Future[Any]] = {work, check}
                    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                    if work.done():
                        return work.result()
                    check.result()  # BrokerUnavailable when Redis is gone
                finally:
                    check.cancel()  # a no-op once it is done
        finally:
            work.cancel()  # a no-op once it is done


async def _probe(client: AsyncClient) -> BrokerUnavailable | None:
    """Redis's outage, or None when it answered (or refused otherwise: an ACL, not an outage)."""
    try:
        await client.queue_length(timeout_s=PROBE_TIMEOUT_S)
    except BrokerUnavailable as down:
        return down
    except Exception:  # no news of an outage; the request's own wait goes on
        pass
    return None


async def deliver(
    client: AsyncClient, queue: str, job: Job, *, timeout_s: float, cold_start_s: float,
    reachability: Reachability, unique: list[str] | None,
    keep: bool = False,
) -> list[Result]:
    """The job's results, asked of ``queue`` as the module's rules say (``keep``: leave the
    replies on their keys for a retry)."""
    alive = await reachability.watch(queue, client,
                                     asyncio.ensure_future(reachability.alive(queue, client)))
    if not alive and cold_start_s <= 0:
        raise no_worker(queue, "nothing was queued (--cold-start-s 0); retry when /ready "
                        "answers 200")
    work = asyncio.ensure_future(_send(client, job, timeout_s, unique, keep))
    try:
        if not alive:
            await reachability.watch(queue, client, asyncio.ensure_future(
                _cold_start(queue, client, work, cold_start_s, reachability)))
        return await reachability.watch(queue, client, work)
    except BrokerUnavailable as down:  # Redis went after (or while) the job was written
        raise no_retry(from_exception(down), unique is None) from down
    except DeadlineExceeded as late:  # the replies say so: a retry of the key reads them again
        raise no_retry(from_exception(late), unique is not None) from late
    except ApiError as error:
        raise no_retry(error, unique is None and error.status >= 500) from None
    finally:
        work.cancel()  # a no-op once it is done


async def _cold_start(queue: str, client: AsyncClient, work: asyncio.Future[Any],
                      cold_start_s: float, reachability: Reachability) -> None:
    """Return once a worker is alive or ``work`` is done; no_worker after ``cold_start_s``."""
    until = time.monotonic() + cold_start_s
    while not work.done():
        if await reachability.alive(queue, client):
            return
        if time.monotonic() >= until:
            raise no_worker(queue, f"none came alive within {cold_start_s} s "
                            "(--cold-start-s); the request stays queued until its deadline")
        await asyncio.wait({work}, timeout=WORKER_POLL_S)


def no_retry(error: ApiError, when: bool) -> ApiError:
    """``error`` with ``x-should-retry: false`` (the OpenAI SDK obeys it) ``when`` a retry
    would queue the entries again (no ``Idempotency-Key``) or read the same expired replies."""
    if when:
        error.headers = {**error.headers, "x-should-retry": "false"}
    return error


async def _send(
    client: AsyncClient, job: Job, timeout_s: float, unique: list[str] | None, keep: bool
) -> list[Result]:
    if unique is None:
        return await client.infer_many(job.items, timeout_s=timeout_s, **job.options)
    ids = await client.submit_many(job.items, unique=unique, deadline_s=timeout_s,
                                   **job.options)
    results: list[Any] = await client.results(ids, timeout_s, keep=keep)
    return results


# One answer per Idempotency-Key

POLL_S = 0.1  # how often a retry asks whether the attempt it waits on has stored its answer
SETTLE_TIMEOUT_S = 1.0
"""How long storing an answer or dropping a lease may hold up the answer (a hung Redis)."""

LEASE_GRACE_S = 2.0
"""How long past ``--timeout-s`` a computing request's lease lasts (its store, its cleanup)."""
HEADER = "Idempotency-Key"  # OpenAI's API and Stripe-style clients name a retried request so
MAX_KEY_CHARS = 255  # the longest key taken (OpenAI's and Stripe's own limit)

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
    return hashlib.sha256(body).digest()


def request_ids(key: str, queue: str, digest: bytes, count: int) -> list[str]:
    """``count`` request ids (32 hex digits) that only this key, queue and body produce."""
    if not 0 < len(key) <= MAX_KEY_CHARS:
        raise ApiError(400, f"{HEADER}: 1 to {MAX_KEY_CHARS} characters", param=HEADER,
                       code="invalid_idempotency_key")
    base = hashlib.sha256(b"\0".join((key.encode(), queue.encode(), digest))).digest()
    return [hashlib.sha256(base + index.to_bytes(8, "big")).hexdigest()[:32]
            for index in range(count)]


def key_digest(key: str) -> str:
    """The ``<h>`` of a key's Redis names: the client's text, of any characters, hashed."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


async def claim(
    client: AsyncClient, queue: QueueRef, key: str, route: str, digest: bytes,
    unique: list[str], *, window_s: float, timeout_s: float, max_bytes: int,
) -> Claim | None:
    """This request's claim on ``key``'s answer, :class:`Replay` when stored; waits for another
    holder's lease up to ``timeout_s`` (then 409); None when Redis refuses the claim. The key
    is bound to ``route`` and the body's ``digest``."""
    fp = route.encode() + b"\0" + digest
    record = keys.idempotent_answer(queue, key_digest(key))
    lease = keys.idempotent_lease(queue, key_digest(key))
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
                held = msgpack.unpackb(held)
                if held.get("fp") != fp:  # bound to another route or body
                    raise ApiError(422, f"this {HEADER} was used with another route or request "
                                   "body within the dedupe window; use a new key for a new "
                                   "request", param=HEADER, code="idempotency_key_reused")
                if isinstance(held.get("status"), int) and isinstance(held.get("body"), bytes):
                    raise Replay(held["status"], held["body"])  # the stored answer
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
