"""While Redis refuses replies, a worker holds about its byte room, not everything it read.

At ``maxmemory`` Redis refuses the worker's reply pushes (``OOM``) but still
serves its reads. Each answer waiting to be published counts for its packed
reply's bytes (16 KB at ``--sim-dim 4096``, where its request is about 200 B),
so the worker stops reading once its answers fill ``--read-ahead-bytes``, and
its device takes no batch meanwhile: what it holds stays within a small
multiple of the room (docs/RELIABILITY.md, "What the byte room counts").
Counted at the request's size, a worker with a larger token room held about
6,000 answers and grew 150-170 MB against a 1 MiB room. Once memory frees,
every request is answered once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from tests.redis_full import fill, free, full_fixture
from tests.support import SimModel, wait_for
from tests.workers import Fleet
from tokenq.shared import keys
from tokenq.worker.loop.intake import Intake
from tokenq.worker.loop.outbox import Outbox
from tokenq.worker.pipeline.jobs import Answer

full = full_fixture()
ROOM = 1024 * 1024
REQUESTS = 4000
MODEL = SimModel(dim=4096, max_input=64)
SLACK = 8 * 1024 * 1024
"""What a worker's resident memory may grow by besides what the room counts: up to
four batches' vectors on their way to be answered (32 rows of 16 KB each: 2 MB), the
allocator's arenas and the Redis client's buffers. Measured from its start: 0.6-1.5 MiB
of growth in all; counted at the request's size, the same worker grew 36-38 MB (about
1,940 held, stopped only by its token room)."""


def rss_bytes(pid: int) -> int:
    """A process's resident memory, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def pending(r: redis.Redis, stream: str) -> int:
    return int(r.xpending(stream, keys.GROUP)["pending"])


# ------------------------------------------------------------------- the accounting


class _Outboxes(Outbox):
    """An outbox with nothing wired but the intake (``emit`` only reads it)."""

    def __init__(self, intake: Intake) -> None:
        super().__init__(None, intake, lambda: None)  # type: ignore[arg-type]
        self.add_lane()


def test_an_answered_entry_counts_for_its_reply_until_published() -> None:
    intake = Intake(read_ahead_budgets=4.0, read_ahead_bytes=64 * 1024,
                    max_entry_bytes=4096, max_input_tokens=64)
    intake.hold(0, [(b"1-0", {b"text": b"x" * 170}), (b"2-0", {b"text": b"y" * 170})])
    assert intake.used() == 2 * 174 and intake.answers_fit()
    reply = b"r" * 16_400
    letter = Answer(b"2-0", "k", b"e" * 60, ok=False, dead_fields=((b"text", b"y" * 170),))
    _Outboxes(intake).emit(0, [Answer(b"1-0", "k", reply, ok=True), letter])
    assert intake.size_of(0, b"1-0") == len(reply)
    assert intake.size_of(0, b"2-0") == 60 + 4 + 170  # its reply and its dead letter
    assert intake.used() == intake.answer_bytes == len(reply) + 234
    intake.published(0, [b"1-0", b"2-0"])
    assert intake.used() == 0 and intake.answer_bytes == 0


def test_answers_filling_the_room_stop_reads_and_batches_but_one_always_goes() -> None:
    intake = Intake(read_ahead_budgets=4.0, read_ahead_bytes=64 * 1024,
                    max_entry_bytes=4096, max_input_tokens=64)
    intake.hold(0, [(b"%d-0" % i, {b"t": b"x" * 100}) for i in range(5)])
    assert intake.read_count(10_000, 0, readers=1, cap=64) > 0
    # buffered encodings take room too: 40 bytes a token
    assert intake.read_count(10_000, 64 * 1024 // 40, readers=1, cap=64) == 0
    huge = b"r" * (3 * 64 * 1024)  # one answer larger than the whole room
    assert intake.answers_fit()  # nothing waits: it may be made
    intake.emitted(0, [b"0-0"], [len(huge)])
    assert not intake.answers_fit(), "answers fill the room: the device must wait"
    assert intake.read_count(10_000, 0, readers=1, cap=64) == 0, "and nothing more is read"
    intake.published(0, [b"0-0"])
    assert intake.answers_fit() and intake.read_count(10_000, 0, readers=1, cap=64) > 0


# ------------------------------------------------------------------- a real worker


@pytest.mark.fault
def test_a_worker_whose_replies_are_refused_holds_its_room_and_loses_nothing(
    full: tuple[str, redis.Redis], worker_env: dict[str, str], tmp_path: Path, queue_name: str,
) -> None:
    url, r = full
    q = keys.QueueRef(queue_name)
    stream = keys.requests(q)
    with r.pipeline(transaction=False) as pipe:
        for i in range(REQUESTS):
            pipe.xadd(stream, {"v": "1", "id": f"r{i}", "text": f"request {i} " + "word " * 30})
        pipe.execute()
    fleet = Fleet({**worker_env, "TOKENQ_REDIS_URL": url}, tmp_path, ready_timeout=60)
    try:
        worker = fleet.start(*MODEL.flags(
            "--read-ahead-bytes", str(ROOM), "--max-batch-size", "32", "--sim-batch-ms", "5",
            "--heartbeat-s", "0.5"), ready=r, queue=queue_name)
        start_rss = rss_bytes(worker.process.pid)  # joined: everything imported and built
        fill(r)
        answered_before = REQUESTS - r.xlen(stream)
        assert answered_before < REQUESTS // 2, "the worker answered most before Redis filled"

        # (b) it stops reading: what is pending to it stops growing, the rest stays unread
        last, still_since, peak = -1, time.monotonic(), start_rss
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now_pending = pending(r, stream)
            peak = max(peak, rss_bytes(worker.process.pid))
            if now_pending != last:
                last, still_since = now_pending, time.monotonic()
            elif time.monotonic() - still_since > 3.0:
                break
            time.sleep(0.1)
        held = pending(r, stream)
        assert held == last, "reads went on while the answers filled the room"
        unread = r.xlen(stream) - held
        assert unread > REQUESTS // 2, (held, unread, worker.output()[-3000:])
        time.sleep(1.0)  # six heartbeats more: still nothing read
        assert pending(r, stream) == held
        peak = max(peak, rss_bytes(worker.process.pid))

        # (a) its resident memory grew by a small multiple of the room
        growth = peak - start_rss
        assert growth < 3 * ROOM + SLACK, (growth, held, worker.output()[-3000:])
        assert worker.process.poll() is None, worker.output()

        # (c) maxmemory is raised (the replies take 64 MB): every request is answered once
        free(r)
        r.config_set("maxmemory", str(256 * 1024 * 1024))
        wait_for(lambda: r.xlen(stream) == 0 and pending(r, stream) == 0, 60,
                 "every request to be answered", fleet=fleet)
        with r.pipeline(transaction=False) as pipe:
            for i in range(REQUESTS):
                pipe.llen(keys.reply(q, f"r{i}"))
            lengths = pipe.execute()
        assert lengths == [1] * REQUESTS, [i for i, n in enumerate(lengths) if n != 1][:10]
        assert r.xlen(keys.dead(q)) == 0
        print(f"room under OOM: {answered_before} answered before Redis filled, held {held} "
              f"entries, RSS grew {growth / 2**20:.1f} MiB "
              f"(bound {(3 * ROOM + SLACK) / 2**20:.0f} MiB)")
    finally:
        fleet.close()
