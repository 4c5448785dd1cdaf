"""How a route's job reaches its queue: no live worker (503, or ``--cold-start-s``), retried
requests (``Idempotency-Key``, :mod:`.idempotency`), a Redis gone (every wait ends within
~1.5 s). 0033-gateway-503s."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, TypeVar

from tokenq.producer import AsyncClient, BrokerUnavailable, DeadlineExceeded, Result
from tokenq.producer.serve.errors import ApiError, from_exception
from tokenq.producer.serve.schemas import Job

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
        raise no_retry(from_exception(down), unique is None) from down
    except DeadlineExceeded as late:  # the replies say so: a retry of the key reads them again
        raise no_retry(from_exception(late), unique is not None) from late
    except ApiError as error:
        raise no_retry(error, unique is None and error.status >= 500) from None
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
