"""How a route's job reaches its queue: no live worker, scale-from-zero, and retried requests.

Two questions every POST route asks before and while it waits (docs/OPERATIONS.md,
"No live worker"; docs/DECISIONS.md, "Gateway drop-in (issue 24)"):

* **Is anyone there?** The workers' liveness keys (what ``/ready`` reads)
  say whether a worker serves the queue. With none and ``--cold-start-s 0``
  (the default) the answer is a 503 naming "no live worker" at once, and
  nothing is written: a client and its retries learn it in milliseconds
  instead of waiting ``--timeout-s`` each. With ``--cold-start-s N`` the
  request is queued (so a KEDA-scaled fleet at zero sees the stream grow
  and starts a worker) and the route waits up to N s for a worker to come
  alive, then as usual for the answer; no worker by then is the same 503
  (the entry stays queued until its deadline). A positive answer is
  remembered for :data:`ALIVE_CACHE_S`, so a busy gateway asks Redis about
  once a second per queue, not once a request.
* **Was this asked before?** A request carrying ``Idempotency-Key`` gets
  request ids derived from the key, the queue, the body's digest and each
  input's index (:func:`idempotent_ids`), each input's own reply key, and
  the enqueue script's dedupe (``--dedupe-ttl-s``): a retry of the same body
  with the same key writes nothing new and reads the first attempt's
  replies. A key reused with another body names other requests.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

from tokenq.producer import AsyncClient, Result
from tokenq.producer.serve.errors import ApiError
from tokenq.producer.serve.schemas import Job

ALIVE_CACHE_S = 1.0
"""How long a queue seen with a live worker is taken to still have one."""

WORKER_POLL_S = 0.25
"""How often a cold start asks whether a worker has come alive."""

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


async def deliver(
    client: AsyncClient, queue: str, job: Job, *, timeout_s: float, cold_start_s: float,
    liveness: Liveness, unique: list[str] | None,
) -> list[Result]:
    """The job's results, asked of ``queue`` as the module's rules say."""
    if await liveness.alive(queue, client):
        return await _send(client, job, timeout_s, unique)
    if cold_start_s <= 0:
        raise no_worker(queue, "nothing was queued (--cold-start-s 0); retry when /ready "
                        "answers 200")
    work = asyncio.ensure_future(_send(client, job, timeout_s, unique))
    try:
        until = time.monotonic() + cold_start_s
        while not work.done():
            if await liveness.alive(queue, client):
                return await work
            if time.monotonic() >= until:
                raise no_worker(queue, f"none came alive within {cold_start_s} s "
                                "(--cold-start-s); the request stays queued until its deadline")
            await asyncio.wait({work}, timeout=WORKER_POLL_S)
        return work.result()
    finally:
        work.cancel()  # a no-op once it is done


async def _send(
    client: AsyncClient, job: Job, timeout_s: float, unique: list[str] | None
) -> list[Result]:
    if unique is None:
        return await client.infer_many(job.items, timeout_s=timeout_s, **job.options)
    ids = await client.submit_many(job.items, unique=unique, deadline_s=timeout_s,
                                   **job.options)
    results: list[Any] = await client.results(ids, timeout_s)
    return results
