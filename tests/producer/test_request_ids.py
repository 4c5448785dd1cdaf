"""Request ids drawn in blocks (producer/lanes.py): uuid4-shaped, never handed out twice,
whether by threads at once or by a process and the child it forks."""

from __future__ import annotations

import concurrent.futures
import os
import uuid

import pytest

from tokenq.producer.lanes import uuid4_hex


@pytest.mark.unit
def test_ids_are_uuid4_hex() -> None:
    for value in (uuid4_hex() for _ in range(1000)):
        parsed = uuid.UUID(value)
        assert parsed.hex == value
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122


@pytest.mark.unit
def test_threads_drawing_at_once_never_share_an_id() -> None:
    """Eight threads take ids across many block refills: none appears twice."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        batches = list(pool.map(lambda _: [uuid4_hex() for _ in range(2000)], range(8)))
    everything = [value for batch in batches for value in batch]
    assert len(set(everything)) == len(everything) == 16_000


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    """The block a child inherits is dropped, so parent and child draw different ids
    even though both had the same unused block in memory at the fork."""
    uuid4_hex()  # a block is drawn and mostly unused
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent, and out
        try:
            os.write(write, "".join(uuid4_hex() for _ in range(50)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = pipe.read().decode()
    os.waitpid(pid, 0)
    child_ids = {child[at:at + 32] for at in range(0, len(child), 32)}
    parent_ids = {uuid4_hex() for _ in range(50)}
    assert len(child_ids) == 50
    assert not child_ids & parent_ids
