"""Publishing answers: each request's reply, XACK and XDEL in one atomic step (``publish.lua``,
only while the entry is still pending to this worker: docs/decisions/0013-exactly-one-reply.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, RedisError, ResponseError

from tokenq.shared import functions, redis_refusal
from tokenq.shared.failures import error_text
from tokenq.shared.packing import PackedArgs, bulk, bulk_format, takes_packed
from tokenq.worker.pipeline.jobs import Answer

log = logging.getLogger("tokenq.worker")

_BEFORE_PAYLOAD = bulk_format(2) + b"$%d\r\n"
_AFTER_PAYLOAD = b"\r\n" + bulk_format(2)
"""One answer with no dead-letter fields, around its payload (joined once, with the call's
other arguments, not copied per answer): entry id, reply key slot, the payload's length; then
counted, ``0``."""


class Target(NamedTuple):
    """Where one lane's answers go: its stream, its dead stream, the group, this consumer."""

    stream: str
    dead: str
    group: str
    consumer: str


class PublishHooks(Protocol):
    def refused(self, reason: str, error: str) -> None:
        """Redis answered a call with a refusal of writes now."""

    def published(self) -> None:
        """A call went through (after refusals: the episode is over)."""


class Publisher:
    """Answers one queue's requests through ``publish.lua``."""

    def __init__(
        self, client: aioredis.Redis, target: Target, *, reply_ttl_ms: int, dead_max_len: int,
        dead_max_letter_bytes: int, hooks: PublishHooks | None = None,
    ) -> None:
        self._hooks = hooks
        self._script = functions.AsyncFunction(client, "publish")  # publish.lua, by FCALL
        self._packed = takes_packed(client)
        """Whether the client sends :class:`PackedArgs` as they are (one tokenq made)."""
        self._stream = target.stream
        self._dead = target.dead
        self._head = [target.group, target.consumer, reply_ttl_ms, dead_max_len,
                      dead_max_letter_bytes]

    def arguments(
        self, answers: Sequence[Answer], refused: Mapping[bytes, str] | None = None
    ) -> tuple[list[str], list[object]]:
        """KEYS and ARGV for one call (pure; tested without Redis)."""
        keys = [self._stream, self._dead]
        index: dict[str, bytes] = {}
        parts: list[bytes] = []
        add = parts.append  # bound once: this loop runs per answer
        count = 5 * len(answers)
        for answer in answers:
            entry_id = answer.entry_id
            if refused and entry_id in refused:
                slot, payload = b"-1", refused[entry_id].encode("utf-8", "replace")
            else:
                reply_to, slot, payload = answer.reply_to, b"0", answer.payload
                if reply_to is not None:
                    slot = index.get(reply_to, b"0")
                    if slot == b"0":
                        keys.append(reply_to)
                        slot = index[reply_to] = b"%d" % len(keys)
            dead_fields, counted = answer.dead_fields, b"%d" % answer.counted
            if dead_fields:
                add(b"".join(map(bulk, (entry_id, slot, payload, counted, len(dead_fields),
                                        *(value for pair in dead_fields for value in pair)))))
                count += 2 * len(dead_fields)
            else:
                add(_BEFORE_PAYLOAD % (len(entry_id), entry_id, len(slot), slot, len(payload)))
                add(payload)
                add(_AFTER_PAYLOAD % (len(counted), counted, 1, b"0"))
        return keys, [*self._head, len(answers), PackedArgs(count, b"".join(parts))]

    async def publish_once(
        self, answers: Sequence[Answer], refused: Mapping[bytes, str] | None = None
    ) -> int:
        """One script call; returns how many answers were still ours to publish."""
        if not answers:
            return 0
        keys, args = self.arguments(answers, refused)
        try:  # packed arguments spelled out for a client that needs them
            published, undeliverable, unwritten = await self._script(
                keys=keys, args=args if self._packed else spelled_out(args))
        except ResponseError as exc:
            if redis_refusal.refused_now(exc):
                raise
            # Retrying a call Redis refuses as a whole would fail forever: each answer goes
            # alone, and the one refused alone is acked and dead-lettered without its reply.
            if len(answers) > 1:
                return sum([await self.publish_once([answer]) for answer in answers])
            answer = answers[0]
            if refused:
                # Not even the bare ack went through: left pending (it counts towards
                # max_deliveries) rather than wedge the worker.
                log.error("could not settle entry %r (%s); leaving it pending",
                          answer.entry_id, exc)
                return 0
            reason = f"NOPERM {exc}" if isinstance(exc, NoPermissionError) else str(exc)
            why = f"reply_to {answer.reply_to} refused the reply: {reason}"[:1000]
            return await self.publish_once(answers, {answer.entry_id: why})
        if undeliverable:
            log.warning("%d answers could not be pushed: their reply_to is not a list this "
                        "worker may write (wrong type or ACL); moved those entries to the dead "
                        "stream", undeliverable)
        if unwritten:
            log.error("%d dead letters could not be written: %s is not a stream (someone else "
                      "wrote that key); their entries were answered and acked all the same",
                      unwritten, self._dead)
        return int(published)

    async def publish(
        self, answers: Sequence[Answer], *, max_backoff_s: float = 5.0,
        give_up: Callable[[], bool] = lambda: False,
    ) -> int:
        """Publish, retrying while Redis is unreachable; ``give_up`` is asked before each retry
        (a stopping worker leaves the entries pending after a grace)."""
        delay = 0.1
        failed, since = 0, time.monotonic()
        while True:
            try:
                published = await self.publish_once(answers)
            except RedisError as exc:
                if give_up():
                    log.warning("could not publish %d answers (%s) while stopping; leaving "
                                "their entries pending for another worker", len(answers),
                                error_text(exc))
                    return 0
                failed += 1
                # A refusal goes to the hooks; logged once per episode at warning.
                refusal = isinstance(exc, ResponseError) or redis_refusal.error_code(exc) != ""
                if refusal and self._hooks is not None:
                    self._hooks.refused(redis_refusal.reason(exc), str(exc))
                what = "Redis refuses writes" if refusal else "Redis is unreachable"
                if redis_refusal.is_out_of_memory(exc):
                    what = "Redis is out of memory (maxmemory) and refuses writes"
                log.log(logging.WARNING if failed == 1 else logging.DEBUG,
                        "could not publish %d answers: %s (%s); keeping them and their entries "
                        "pending, retrying with backoff until Redis takes them", len(answers),
                        what, error_text(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_backoff_s)
                continue
            if failed:
                log.warning("published %d answers after %d failed tries over %.1fs",
                            len(answers), failed, time.monotonic() - since)
            if self._hooks is not None:
                self._hooks.published()
            if published < len(answers):
                log.warning("%d of %d answers were no longer ours (claimed by another worker "
                            "or already answered); dropped them", len(answers) - published,
                            len(answers))
            return published


def spelled_out(args: Sequence[object]) -> list[object]:
    """:meth:`Publisher.arguments`' ARGV with the packed tail spelled out as separate arguments."""
    if args and isinstance(args[-1], PackedArgs):
        return [*args[:-1], *args[-1].values()]
    return list(args)
