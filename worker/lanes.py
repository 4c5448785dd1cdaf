"""The streams one worker reads, and how an entry's reference says which it came from.

A queue of one shard is one stream, ``{q}``. A queue of K shards is served
on ``{q:0}`` … ``{q:K-1}`` plus ``{q}`` (:func:`tokenq.shared.keys.lanes_of`);
each of these is a *lane* here, a full queue of its own (stream, group,
dead letters, heartbeats, replies), because in a Redis Cluster a script may
only touch keys of one slot. The worker reads every lane into one packer,
so its token budget and batches span shards, and answers each entry on the
lane it came from.

Two lanes' streams can hand out the same entry id (ids are per stream), so
with more than one lane the worker names an entry ``<lane>/<id>``
(:func:`ref_of`) wherever it holds it: the packer, the held-bytes table,
answers. With one lane the reference *is* the entry id, so a queue of one
shard reads and writes byte for byte what it always did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenq.shared import keys

if TYPE_CHECKING:
    from tokenq.worker.pipeline.jobs import Answer, DeadLetterPolicy
    from tokenq.worker.publish import Publisher
    from tokenq.worker.recovery import Reclaimer


@dataclass(slots=True)
class Lane:
    """One stream the worker reads, with what answers and reclaims on it."""

    index: int
    queue: keys.QueueRef
    dead_letters: DeadLetterPolicy
    tagged: bool
    """Whether references carry the lane (more than one lane)."""
    reclaimer: Reclaimer | None = None
    publisher: Publisher | None = None
    last_reclaim: float = 0.0
    stream: str = field(init=False)

    def __post_init__(self) -> None:
        self.stream = keys.requests(self.queue)

    def ref(self, entry_id: bytes) -> bytes:
        """The worker's name for an entry of this lane."""
        return ref_of(self.index, entry_id) if self.tagged else entry_id


def ref_of(lane: int, entry_id: bytes) -> bytes:
    """``<lane>/<entry id>``: stream ids hold no ``/``, so :func:`split_ref` undoes it."""
    return b"%d/%s" % (lane, entry_id)


def split_ref(ref: bytes) -> tuple[int, bytes]:
    """The lane index and the stream entry id of a reference (lane 0 for a bare id)."""
    head, slash, entry_id = ref.partition(b"/")
    return (int(head), entry_id) if slash else (0, ref)


def entry_ids(refs: Iterable[bytes]) -> list[bytes]:
    """The stream entry ids of references (for what reads an id's time: metrics)."""
    return [split_ref(ref)[1] for ref in refs]


def by_lane(answers: Sequence[Answer]) -> dict[int, list[Answer]]:
    """Answers grouped by the lane they are owed on, each named by its bare entry id."""
    grouped: dict[int, list[Answer]] = {}
    for answer in answers:
        lane, entry_id = split_ref(answer.entry_id)
        if entry_id is not answer.entry_id:
            answer = dataclasses.replace(answer, entry_id=entry_id)
        grouped.setdefault(lane, []).append(answer)
    return grouped


def tagged(lane: Lane, answers: Iterable[Answer]) -> list[Answer]:
    """Answers built from bare entry ids of ``lane``, named by the worker's references."""
    if not lane.tagged:
        return list(answers)
    return [dataclasses.replace(a, entry_id=lane.ref(a.entry_id)) for a in answers]
