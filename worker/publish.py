"""Publishing answers: each request's reply, XACK and XDEL in one atomic step.

A request is either still pending in the stream or answered, never both and
never neither: ``publish.lua`` pushes the reply, acks and deletes the entry
(and, for a dead letter, copies it to the dead stream) in one script, and
only while the entry is still pending to this worker, so a worker that was
presumed dead and lost its entries to another cannot answer them a second
time. If Redis is unreachable, the answers are kept and retried with backoff
until they land: a computed result is never thrown away for a network blip.
A ``reply_to`` that refuses the push (a key of another type, or one outside
the worker's ACL) dead-letters that one entry instead of failing the batch,
which would otherwise be retried forever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from importlib import resources

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, RedisError, ResponseError

from tokenq.worker.jobs import Answer

log = logging.getLogger("tokenq.worker")

PUBLISH_SCRIPT = resources.files("tokenq.worker").joinpath("publish.lua").read_text()


class Publisher:
    """Answers one queue's requests through ``publish.lua``."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        stream: str,
        dead: str,
        group: str,
        consumer: str,
        reply_ttl_ms: int,
        dead_max_len: int,
    ) -> None:
        self._script = client.register_script(PUBLISH_SCRIPT)
        self._stream = stream
        self._dead = dead
        self._head = [group, consumer, reply_ttl_ms, dead_max_len]

    def arguments(
        self, answers: Sequence[Answer], refused: Mapping[bytes, str] | None = None
    ) -> tuple[list[str], list[object]]:
        """KEYS and ARGV for one call (pure; tested without Redis).

        ``refused`` maps entry ids whose ``reply_to`` Redis refused to the
        reason: their key is left out and the script dead-letters them.
        """
        keys = [self._stream, self._dead]
        index: dict[str, int] = {}
        args: list[object] = [*self._head, len(answers)]
        for answer in answers:
            slot = 0
            if refused and answer.entry_id in refused:
                args += [answer.entry_id, -1, refused[answer.entry_id], len(answer.dead_fields)]
                for name, value in answer.dead_fields:
                    args += [name, value]
                continue
            if answer.reply_to is not None:
                if answer.reply_to not in index:
                    keys.append(answer.reply_to)
                    index[answer.reply_to] = len(keys)
                slot = index[answer.reply_to]
            args += [answer.entry_id, slot, answer.payload, len(answer.dead_fields)]
            for name, value in answer.dead_fields:
                args += [name, value]
        return keys, args

    async def publish_once(self, answers: Sequence[Answer]) -> int:
        """One script call; returns how many answers were still ours to publish.

        Redis checks a script's KEYS against the ACL (and, in a Cluster, their
        slot) before running it, so one ``reply_to`` outside the worker's keys
        refuses the whole call. Then each answer goes alone, and the one whose
        own call is refused is dead-lettered without its reply.
        """
        if not answers:
            return 0
        keys, args = self.arguments(answers)
        try:
            published, undeliverable = await self._script(keys=keys, args=args)
        except ResponseError as exc:
            if not _keys_refused(exc) or all(a.reply_to is None for a in answers):
                raise
            if len(answers) > 1:
                return sum([await self.publish_once([answer]) for answer in answers])
            answer = answers[0]
            reason = f"NOPERM {exc}" if isinstance(exc, NoPermissionError) else str(exc)
            why = f"reply_to {answer.reply_to} refused the reply: {reason}"
            keys, args = self.arguments(answers, refused={answer.entry_id: why})
            published, undeliverable = await self._script(keys=keys, args=args)
        if undeliverable:
            log.warning(
                "%d answers could not be pushed: their reply_to is not a list this worker "
                "may write (wrong type or ACL); moved those entries to the dead stream",
                undeliverable,
            )
        return int(published)

    async def publish(self, answers: Sequence[Answer], *, max_backoff_s: float = 5.0) -> int:
        """Publish, retrying until Redis takes it (results are never dropped)."""
        delay = 0.1
        while True:
            try:
                published = await self.publish_once(answers)
            except RedisError as exc:
                log.warning(
                    "could not publish %d answers (%s); keeping them, retrying in %.1fs",
                    len(answers), exc, delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_backoff_s)
                continue
            if published < len(answers):
                log.warning(
                    "%d of %d answers were no longer ours (claimed by another worker "
                    "or already answered); dropped them",
                    len(answers) - published, len(answers),
                )
            return published


def _keys_refused(exc: ResponseError) -> bool:
    """Redis refused a call for its keys: not this user's (ACL), or not this slot."""
    return isinstance(exc, NoPermissionError) or str(exc).startswith("CROSSSLOT")
