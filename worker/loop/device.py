"""The device part: the packer's batches run in the device thread (``DeviceFeed``), then
settled on the loop: recorded, the budget adapted, their answers handed to the outbox."""

from __future__ import annotations

from collections.abc import Iterable

from tokenq.shared.packer import AdaptiveBudget, Batch, Budget, Packer
from tokenq.worker.loop.cache import ResultCache, cached_answer
from tokenq.worker.loop.intake import Intake
from tokenq.worker.loop.lanes import Ref
from tokenq.worker.loop.lifecycle import Wiring
from tokenq.worker.loop.outbox import Outbox
from tokenq.worker.loop.stages import DEVICE
from tokenq.worker.pipeline.coalesce import Coalescer
from tokenq.worker.pipeline.execute import adapt_budget
from tokenq.worker.pipeline.feed import DeviceFeed, Rules
from tokenq.worker.pipeline.pipeline import BatchOutcome, Job, Pipeline

Ran = tuple[BatchOutcome[Ref], Budget, int]
"""What the device thread hands the event loop for one batch: its outcome, the budget it was
packed under, and when it started (epoch ms on Redis's clock)."""


class Device(Rules):
    """Takes jobs from the readers, runs them in batches (identical ones as one row), hands
    their answers to the outbox and the result cache."""

    def __init__(
        self, wiring: Wiring, pipeline: Pipeline[Ref], packer: Packer[Job[Ref]], intake: Intake,
        outbox: Outbox, cache: ResultCache | None = None,
    ) -> None:
        self._wiring = wiring
        self.pipeline = pipeline
        self.packer = packer
        self._intake = intake
        self._outbox = outbox
        self.cache = cache
        self.coalescer: Coalescer[Ref] = Coalescer()
        self.adaptive = AdaptiveBudget(packer.budget.max_batch_tokens,
                                       pipeline.info.max_input_tokens)
        self.input_ended = False
        self.feed: DeviceFeed[Job[Ref], Ran] = DeviceFeed(packer, self._execute, self)

    def add(self, jobs: Iterable[Job[Ref]]) -> None:
        if self.cache is not None:
            jobs = list(jobs)
            # A chunked request is neither coalesced nor cached: its claim ends now.
            self.cache.put(list({(job.digest, None) for job in jobs if job.chunk and job.digest}))
            if self.cache.writing:
                jobs = self._answer_written(self.cache.writing, jobs)
            self.cache.keep_claims(self.coalescer.leading)
        self.feed.add(self.coalescer.take(jobs))

    def _answer_written(self, writing: dict[bytes, bytes],
                        jobs: Iterable[Job[Ref]]) -> list[Job[Ref]]:
        """Answer the jobs whose reply is on its way to the cache (they were looked up while
        it was computed); the others are packed."""
        rest = []
        for job in jobs:
            reply = None if job.digest is None or job.chunk else writing.get(job.digest)
            if reply is None:
                rest.append(job)
                continue
            self._outbox.emit(job.ref.lane, [cached_answer(job.ref.entry_id, job.request, reply)])
            self._wiring.recorder.shared("hit", 1)
        return rest

    def end_input(self) -> None:
        """Every reader has ended: run what is buffered, then finish."""
        self.input_ended = True
        self.feed.wake()

    def wake(self) -> None:
        """Make the device thread look again (a stop, room made, a hang)."""
        self.feed.wake()

    async def run(self) -> None:
        await self.feed.run(self._settle)
        self._outbox.close()

    # The rules the device thread asks (``feed.Rules``):
    def flushing(self) -> bool:
        return self._wiring.lifecycle.stopping.is_set()

    def finished(self) -> bool:
        return self.input_ended and not self.packer

    def may_take(self) -> bool:
        return self._intake.answers_fit()

    def taken(self) -> None:  # type: ignore[override]
        self._wiring.lifecycle.room_made.set()

    def _execute(self, batch: Batch[Job[Ref]]) -> Ran:
        """Run one batch and adapt the budget (device thread: the only one that changes it,
        after the batch, so the cap the pick used has not moved)."""
        packed_under = self.packer.budget_now()
        now = self._wiring.clock.now_ms()
        with self._wiring.stages.running(
            DEVICE, f"a batch of {len(batch.payloads)} requests on the device",
            self._wiring.settings.batch_timeout_s, "batch_timeout_s",
        ):
            outcome = self.pipeline.run_batch(batch.payloads, now)
        adapt_budget(self.adaptive, self.packer, outcome.ooms, "worker")
        return outcome, packed_under, now

    async def _settle(self, batch: Batch[Job[Ref]], ran: Ran) -> None:
        """Account for and answer one batch the device thread ran (on the event loop)."""
        outcome, packed_under, started_epoch_ms = ran
        self._wiring.recorder.batch(batch, outcome, packed_under=packed_under,
                                    started_epoch_ms=started_epoch_ms,
                                    budget_now=self.packer.budget.max_batch_tokens)
        shared, again, led = self.coalescer.settled(outcome.answered)
        if shared:
            self._wiring.recorder.shared("coalesced", len(shared))
        answered = outcome.answered + shared if shared else outcome.answered
        replies = self._outbox.emit_outcomes(self.pipeline, answered)
        if again:
            self.add(again)
        if self.cache is not None and led:
            at = {done.ref: index for index, done in enumerate(answered)}
            self.cache.put([(digest, replies[at[leader.ref]][0] if leader.ok else None)
                            for digest, leader in led])
