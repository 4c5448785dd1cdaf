"""The worker's answers on their way to Redis: one outbox and one publish task per lane (a
shard whose node is down holds back only its own). What waits counts as held in the
read-ahead room (:class:`~tokenq.worker.loop.intake.Intake`), which bounds the outboxes."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tokenq.worker.loop.intake import Intake
from tokenq.worker.loop.lanes import Lane, Ref
from tokenq.worker.loop.lifecycle import Wiring
from tokenq.worker.loop.stages import PUBLISH
from tokenq.worker.pipeline.jobs import Answer
from tokenq.worker.pipeline.pipeline import Outcome, Pipeline

PUBLISH_CHUNK = 2048
"""Most answers one publish call carries when several batches' answers are waiting."""


def answers_by_lane(
    pipeline: Pipeline[Any], outcomes: Iterable[Outcome[Ref]],
    replies: Sequence[tuple[bytes, bool]] | None = None,
) -> dict[int, list[Answer]]:
    """The answers finished requests' entries are owed, by lane, each named by its bare
    entry id; one loop per batch, replies encoded together (this runs per request) unless
    given."""
    owed: dict[int, list[Answer]] = {}
    outcomes = list(outcomes)
    if replies is None:
        replies = pipeline.encoded_replies(outcomes)
    for outcome, (payload, ok) in zip(outcomes, replies, strict=True):
        lane, entry_id = outcome.ref
        answers = owed.get(lane)
        if answers is None:
            answers = owed[lane] = []
        request = outcome.request
        answers.append(Answer(entry_id, request.reply_to, payload, ok, (),
                              None if ok else outcome.code, request.counted))
    return owed


class Outbox:
    """The answers owed on each lane, and the tasks that publish them."""

    def __init__(self, wiring: Wiring, intake: Intake, room_made: Callable[[], None]) -> None:
        """``room_made``: called once published answers gave their room back (the readers
        and the device, which wait for it while answers fill the room, look again)."""
        self._wiring = wiring
        self._intake = intake
        self._room_made = room_made
        self._queues: dict[int, asyncio.Queue[list[Answer] | None]] = {}  # by lane index
        self._added = 0
        self._publishing = 0
        """How many lanes' publish calls are in flight."""

    def add_lane(self) -> None:
        """An outbox for the next lane (lanes are numbered in the order they are added)."""
        self._queues[self._added] = asyncio.Queue()
        self._added += 1

    def remove_lane(self, lane: int) -> None:
        """``lane`` holds nothing and is read no more: its publish task ends."""
        queue = self._queues.pop(lane, None)
        if queue is not None:
            queue.put_nowait(None)

    def emit(self, lane: int, answers: list[Answer]) -> None:
        """Hand one lane's answers to its publish task: until published, each entry counts
        as held for its packed reply's bytes (and a dead letter's), not its request's."""
        self._intake.emitted(lane, [answer.entry_id for answer in answers], [
            len(answer.payload) + (sum(len(name) + len(value) for name, value in answer.dead_fields)
                                   if answer.dead_fields else 0)  # a rare dead letter's fields
            for answer in answers])
        self._queues[lane].put_nowait(answers)

    def emit_outcomes(self, pipeline: Pipeline[Any],
                      outcomes: Sequence[Outcome[Ref]]) -> list[tuple[bytes, bool]]:
        """Answer finished requests, each on the lane its entry came from; their replies."""
        replies = pipeline.encoded_replies(outcomes)
        for lane, answers in answers_by_lane(pipeline, outcomes, replies).items():
            self.emit(lane, answers)
        return replies

    def close(self) -> None:
        """No more answers: each publish task ends once its outbox is empty."""
        for queue in self._queues.values():
            queue.put_nowait(None)

    def unpublished(self) -> bool:
        """Whether any answer waits for, or is in, a publish call."""
        return bool(self._publishing) or any(not queue.empty() for queue in self._queues.values())

    async def run(self, lane: Lane) -> None:
        """Publish one lane's answers in bulk (up to ``PUBLISH_CHUNK`` a call), so round trips
        do not add up; published entries stop counting as held."""
        queue = self._queues[lane.index]
        wiring = self._wiring
        limit_s, limit_name = wiring.call_deadline
        last = False
        while not last:
            answers = await queue.get()
            if answers is None:
                return
            while len(answers) < PUBLISH_CHUNK and not queue.empty():
                more = queue.get_nowait()
                if more is None:
                    last = True
                    break
                answers = [*answers, *more]
            self._publishing += 1
            try:
                with wiring.stages.running(
                    PUBLISH, f"publishing {len(answers)} answers on {lane.stream}",
                    limit_s, limit_name,
                ) as restart:
                    await lane.publisher.publish(
                        answers, give_up=functools.partial(self._retrying, restart))
            finally:
                self._publishing -= 1
                self._intake.published(lane.index, [answer.entry_id for answer in answers])
                self._room_made()
            wiring.recorder.answered(lane.tenant, answers, wiring.clock.now_ms())

    def _retrying(self, restart: Callable[[], None]) -> bool:
        """Asked before each retry: give up (past the stop grace)? Restarts the publish stage's
        clock, since its deadline bounds one attempt (waiting for Redis is not a hang)."""
        restart()
        return self._wiring.lifecycle.past_grace()
