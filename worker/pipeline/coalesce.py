"""Identical requests in a worker's buffer run as one row: the first with a digest (the
leader) is packed, the others wait for its outcome and get it as their own. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from tokenq.shared.errors import ErrorCode
from tokenq.worker.pipeline.pipeline import Job, Outcome

K = TypeVar("K")


class Coalescer(Generic[K]):
    """The leaders in the buffer, each with the jobs waiting for its outcome."""

    def __init__(self) -> None:
        self._waiting: dict[bytes, list[Job[K]]] = {}
        self._leaders: dict[K, bytes] = {}
        self.coalesced = 0
        """Requests answered by another's row, in all."""

    def leading(self) -> list[bytes]:
        """The digests whose leader is in flight (their claims are kept: ``cache.py``)."""
        return list(self._waiting)

    def take(self, jobs: Iterable[Job[K]]) -> list[Job[K]]:
        """The jobs to pack; one whose digest has a leader waits for it instead."""
        out: list[Job[K]] = []
        keep, waiting_on, leaders = out.append, self._waiting, self._leaders  # per request
        for job in jobs:
            digest = job.digest
            if digest is None or job.chunk is not None:
                keep(job)
            elif (waiting := waiting_on.get(digest)) is not None:
                waiting.append(job)
            else:
                waiting_on[digest] = []
                leaders[job.ref] = digest
                keep(job)
        return out

    def settled(self, outcomes: Sequence[Outcome[K]]
                ) -> tuple[list[Outcome[K]], list[Job[K]], list[tuple[bytes, Outcome[K]]]]:
        """The outcomes of the jobs that waited on these, the jobs to pack again (their leader
        ran out of its own deadline), and each leader's digest and outcome."""
        shared: list[Outcome[K]] = []
        again: list[Job[K]] = []
        led: list[tuple[bytes, Outcome[K]]] = []
        leader, waiting_on = self._leaders.pop, self._waiting.pop  # bound once: per request
        for outcome in outcomes:
            digest = leader(outcome.ref, None)
            if digest is None:
                continue
            waiting = waiting_on(digest)
            led.append((digest, outcome))
            if not waiting:  # the common case: no one waited
                continue
            if outcome.code == ErrorCode.DEADLINE_EXCEEDED.value:
                again += waiting
                continue
            self.coalesced += len(waiting)
            shared += [Outcome(job.ref, job.request, outcome.result, outcome.tokens,
                               outcome.truncated) for job in waiting]
        return shared, again, led
