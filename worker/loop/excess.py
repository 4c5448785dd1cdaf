"""Entries written around enqueue's length limit: refused as an enqueue past it would be."""

from __future__ import annotations

from typing import Any

from tokenq.shared import functions, keys
from tokenq.shared.errors import ErrorCode
from tokenq.shared.redis_refusal import error_code
from tokenq.worker.pipeline.jobs import Answer, DeadLetterPolicy, dead_answer

TAKE_AT_MOST = 256
"""Most entries one check takes: the next read's check takes the next ones."""

Entries = list[tuple[bytes, dict[bytes, bytes]]]


async def claim(client: Any, stream: str, consumer: str, max_len: int) -> Entries:
    """The newest undelivered entries of ``stream`` beyond ``max_len``, made pending to
    ``consumer`` and deleted from the stream (``claim_excess.lua``); none when within it."""
    taken = await functions.AsyncFunction(client, "claim_excess")(
        keys=[stream], args=[keys.GROUP, consumer, max_len, TAKE_AT_MOST])
    return [(entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
            for entry_id, flat in taken or []]


def refusals(
    entries: Entries, max_len: int, *, policy: DeadLetterPolicy, now_epoch_ms: int
) -> list[Answer]:
    """A ``queue_full`` dead letter for each entry taken, answered on its reply key."""
    message = (f"the queue held more than its maximum length ({max_len}) when this request "
               "was written around tokenq's enqueue (a plain XADD?): it was refused as an "
               "enqueue past the limit is")
    return [dead_answer(entry_id, fields, ErrorCode.QUEUE_FULL, message, policy=policy,
                        deliveries=1, now_epoch_ms=now_epoch_ms)
            for entry_id, fields in entries]


def acl_refused(error: Exception) -> bool:
    """Whether Redis refused the check to this ACL user (FCALL's key, or a command the
    function runs): it will refuse it every time. A WRONGTYPE stream fails the read instead."""
    return error_code(error) == "NOPERM" or "executing the script can't" in str(error)
