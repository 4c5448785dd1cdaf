"""How a route's job reaches its queue: no live worker, scale-from-zero, and retried requests.

Three questions every POST route asks before and while it waits (docs/OPERATIONS.md,
"No live worker"; docs/decisions/0033-gateway-503s.md):

* **Is anyone there?** The workers' liveness keys (what ``/ready`` reads)
  say whether a worker serves the queue. With none and ``--cold-start-s 0``
  (the default) the answer is a 503 naming "no live worker" at once, and
  nothing is written: a client and its retries learn it in milliseconds
  instead of waiting ``--timeout-s`` each. With ``--cold-start-s N`` the
  request is queued (so a KEDA-scaled fleet at zero sees the stream grow
  and starts a worker) and the route waits up to N s for a worker to come
  alive, then as usual for the answer; no worker by then is the same 503
  (the entry stays queued until its deadline, so without an
  ``Idempotency-Key`` the answer carries ``x-should-retry: false``, which
  keeps the OpenAI SDK from queueing it again: :func:`left_queued`). A positive answer is
  remembered for :data:`ALIVE_CACHE_S`, so a busy gateway asks Redis about
  once a second per queue, not once a request.
* **Was this asked before?** A request carrying ``Idempotency-Key`` gets
  request ids derived from the key, the queue, the body's digest and each
  input's index (:func:`idempotent_ids`), each input's own reply key, and
  the enqueue script's dedupe (``--dedupe-ttl-s``): a retry of the same body
  with the same key writes nothing new and reads the first attempt's
  replies; :mod:`.idempotency` keeps the first attempt's answer for it.
* **Is Redis still there?** A queued request's wait rides out an outage by
  itself (the client's reply listener reconnects until the deadline), which
  suits a library call and not an HTTP caller, who would learn of the outage
  only at ``--timeout-s``. So while a route waits, the queue's Redis is
  asked (``XLEN``, what ``/health`` reads) every :data:`PROBE_S`, one probe
  per queue however many requests wait (:class:`Reachability`); a probe
  that redis-py's retries give up on ends every wait on that queue with the
  503 a route gives when Redis is down before anything is queued, within
  about 1.5 s. The queued entries stay (``x-should-retry: false`` as
  above); a client that retries with its ``Idempotency-Key`` once Redis is
  back reads their replies. A Redis that hangs rather than dies (SIGSTOP, a
  partition: connections open, nothing answered) fails the probe by its own
  bound, :data:`PROBE_TIMEOUT_S`, and every other Redis read of a route runs
  under the same probe (``Gateway.ask``), so no route waits out ``--timeout-s``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, TypeVar

from tokenq.producer import AsyncClient, BrokerUnavailable, DeadlineExceeded, Result
from tokenq.producer.serve.errors import ApiError, from_exception
from tokenq.producer.serve.schemas import Job

log = logging.getLogger("tokenq.serve")
T = TypeVar("T")

ALIVE_CACHE_S = 1.0
"""How long a queue seen with a live worker is taken to still have one."""

WORKER_POLL_S = 0.25
"""How often a cold start asks whether a worker has come alive."""

PROBE_S = 0.25
"""How often a waiting request's queue is asked whether its Redis still answers; with
redis-py's retries (about 1.1 s) an outage ends a wait within about 1.5 s."""

PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for Redis's answer. ``XLEN`` takes a live Redis well under a
millisecond, so one that has not answered by then is gone or frozen (SIGSTOP, a
partition: the connection stays open and nothing comes back), and the wait ends as
for a Redis that refuses connections, rather than at the socket's timeout."""

IDEMPOTENCY_HEADER = "idempotency-key"
"""The header OpenAI's API and Stripe-style clients name a retried request with."""

MAX_KEY_CHARS = 255
"""The longest ``Idempotency-Key`` taken (OpenAI's and Stripe's own limit)."""


def body_digest(body: bytes) -> bytes:
    """What :func:`idempotent_ids` knows of a body (kept instead of the body itself)."""
    return hashlib.sha256(body).digest()


def idempotent_ids(key: str, queue: str, digest: bytes, count: int) -> list[str]:
    """``count`` request ids (32 hex digits) that only this key, queue and body produce.

    Hashed rather than used as is: the key is the client's text, of any
    characters; the ids must be the wire's. The body's digest is in the
    hash so that a key reused for other input is other work, not the
    first answer given again.
    """
    if not 0 < len(key) <= MAX_KEY_CHARS:
        raise ApiError(400, f"Idempotency-Key: 1 to {MAX_KEY_CHARS} characters",
                       param="Idempotency-Key", code="invalid_idempotency_key")
    base = hashlib.sha256(b"\0".join((key.encode(), queue.encode(), digest))).digest()
    return [hashlib.sha256(base + index.to_bytes(8, "big")).hexdigest()[:32]
            for index in range(count)]


def no_worker(queue: str, why: str) -> ApiError:
    return ApiError(503, f"no live worker serves queue {queue!r}: {why}", code="no_worker",
                    headers={"Retry-After": "1"})


class Liveness:
    """Whether each queue has a live worker, a positive answer kept for :data:`ALIVE_CACHE_S`."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    async def alive(self, queue: str, client: AsyncClient) -> bool:
        seen = self._seen.get(queue)
        if seen is not None and time.monotonic() - seen < ALIVE_CACHE_S:
            return True
        if await client.workers_alive():
            self._seen[queue] = time.monotonic()
            return True
        self._seen.pop(queue, None)
        return False


class Reachability:
    """Whether each queue's Redis still answers, asked at most once per :data:`PROBE_S`
    per queue: every request waiting on the queue shares the probe in flight."""

    def __init__(self) -> None:
        self._probes: dict[str, tuple[float, asyncio.Future[BrokerUnavailable | None]]] = {}

    async def check(self, queue: str, client: AsyncClient) -> None:
        """Return when the queue's Redis answered the latest probe; else raise its outage."""
        started, probe = self._probes.get(queue, (0.0, None))
        if probe is None or (probe.done() and time.monotonic() - started >= PROBE_S):
            probe = asyncio.ensure_future(_probe(client))
            self._probes[queue] = (time.monotonic(), probe)
        down = await asyncio.shield(probe)  # a waiter that leaves does not end the others' probe
        if down is not None:
            raise down

    async def announce(self, clients: dict[str, AsyncClient]) -> None:
        """At start, say once, in one line per Redis, when a queue's Redis does not answer.

        The gateway keeps running (every route answers 503 until Redis does), so an
        operator who started it against a wrong URL would otherwise see nothing.
        """
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
        """``work``'s result, or the queue's outage as soon as a probe finds Redis gone
        (``work`` is then cancelled: whatever it waits on, Redis will not answer it)."""
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
        return None
    return None


async def deliver(
    client: AsyncClient, queue: str, job: Job, *, timeout_s: float, cold_start_s: float,
    liveness: Liveness, reachability: Reachability, unique: list[str] | None,
    keep: bool = False,
) -> list[Result]:
    """The job's results, asked of ``queue`` as the module's rules say (``keep``: leave
    the replies on their keys for a retry, :mod:`.idempotency`)."""
    alive = await reachability.watch(queue, client,
                                     asyncio.ensure_future(liveness.alive(queue, client)))
    if not alive and cold_start_s <= 0:
        raise no_worker(queue, "nothing was queued (--cold-start-s 0); retry when /ready "
                        "answers 200")
    work = asyncio.ensure_future(_send(client, job, timeout_s, unique, keep))
    try:
        if not alive:
            await reachability.watch(queue, client, asyncio.ensure_future(
                _cold_start(queue, client, work, cold_start_s, liveness)))
        return await reachability.watch(queue, client, work)
    except BrokerUnavailable as down:  # Redis went after (or while) the job was written
        raise left_queued(from_exception(down), unique) from down
    except DeadlineExceeded as late:  # the replies say so: a retry of the key reads them again
        raise too_late(from_exception(late), unique) from late
    except ApiError as error:
        raise left_queued(error, unique) from None
    finally:
        work.cancel()  # a no-op once it is done


async def _cold_start(queue: str, client: AsyncClient, work: asyncio.Future[Any],
                      cold_start_s: float, liveness: Liveness) -> None:
    """Return once a worker is alive or ``work`` is done; no_worker after ``cold_start_s``."""
    until = time.monotonic() + cold_start_s
    while not work.done():
        if await liveness.alive(queue, client):
            return
        if time.monotonic() >= until:
            raise no_worker(queue, f"none came alive within {cold_start_s} s "
                            "(--cold-start-s); the request stays queued until its deadline")
        await asyncio.wait({work}, timeout=WORKER_POLL_S)


def left_queued(error: ApiError, unique: list[str] | None) -> ApiError:
    """``error`` for a request whose entries may stay queued until their deadline.

    Without an ``Idempotency-Key`` a retry would queue every input again, so
    the answer asks the OpenAI SDK not to retry (``x-should-retry: false``,
    which it obeys before its own rules); with a key a retry is safe (it
    reads the first attempt's replies) and left to the client.
    """
    if unique is None and error.status >= 500:
        error.headers = {**error.headers, "x-should-retry": "false"}
    return error


def too_late(error: ApiError, unique: list[str] | None) -> ApiError:
    """``error`` for requests whose replies were ``deadline_exceeded``.

    Under an ``Idempotency-Key`` a retry names the same requests and reads
    the same replies (kept for it, :mod:`.idempotency`), so it cannot fix
    this: ``x-should-retry: false``. Without one a retry is new work with
    a fresh deadline, left to the client.
    """
    if unique is not None:
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
