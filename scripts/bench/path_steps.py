"""Where a null worker's CPU per request goes, step by step, with no Redis and no asyncio.

``python scripts/bench/path_steps.py [--reads N] [--json PATH]``

A diagnostic beside the ``cpu`` suite, not a figure of its own: the ``cpu``
suite says what a worker process costs per request (with Redis, asyncio,
threads and the kernel in it); this says which of the worker's own steps
that cost is made of, so a change can be aimed and checked in seconds.
Each read of ``READ`` short requests (the ``cpu`` suite's 10-40 characters)
is replayed in one thread through the worker's real code, one step after
another, and each step's time is summed:

1. redis-py's reply turned into entries (``(id, {name: value})``, as its parser does);
2. the read-ahead room counting the read as held (``Intake.hold``);
3. decoding and dead-lettering (``decode_entries``);
4. admission: references, ``Admit``, options, tokenizing (the null backend), jobs;
5. buffering the jobs (``Packer.add_all``, through the device feed's tuple);
6. picking every batch (``Packer.next_batch``);
7. running each batch (``Pipeline.run_batch``: the null backend, checks, settling);
8. the answers and their reply bytes (``answers_by_lane``);
9. ``publish.lua``'s arguments, packed by hiredis as the worker's connection packs them;
10. the room given back (``Intake.published``).

The collector is set up as the ``tokenq worker`` command sets it
(``worker/process.py``), so young collections cost what they cost there.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from null_backend import NullBackend
from texts import uniform_mix

from tokenq.shared import keys, packing, wire
from tokenq.shared.packer import Budget, CostModel, Packer
from tokenq.worker import process as collector
from tokenq.worker.loop.intake import Intake
from tokenq.worker.loop.lanes import Lane
from tokenq.worker.loop.outbox import answers_by_lane
from tokenq.worker.loop.publish import Publisher, Target
from tokenq.worker.pipeline.jobs import DeadLetterPolicy, decode_entries
from tokenq.worker.pipeline.pipeline import Admit, Pipeline

READ = 1024
"""Entries per read: the worker's most (``reader.MAX_READ_COUNT``)."""
NOW_MS = 1_700_000_000_000


def stream_read(queue: keys.QueueRef, count: int) -> list[tuple[bytes, list[bytes]]]:
    """One read as hiredis hands it to redis-py: ids and flat name/value lists."""
    reply_to = keys.reply(queue, "client-1")
    read = []
    for index, text in enumerate(uniform_mix(count, 10, 40).texts):
        request = wire.Request(id=f"req-{index:08d}", text=text, tokens=len(text) // 4 + 2,
                               reply_to=reply_to)
        flat: list[bytes] = []
        for name, value in wire.encode_request(request).items():
            flat += [name.encode(), value.encode() if isinstance(value, str) else value]
        read.append((f"{NOW_MS}-{index}".encode(), flat))
    return read


def as_entries(read: list[tuple[bytes, list[bytes]]]) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """What redis-py's XREADGROUP parser makes of the read."""
    return [(entry_id, _pairs(iter(flat))) for entry_id, flat in read]


def _pairs(names_and_values: Any) -> dict[bytes, bytes]:
    return dict(zip(names_and_values, names_and_values))  # noqa: B905 (one iterator, twice)


def measure(reads: int) -> dict[str, Any]:
    queue = keys.QueueRef("path-steps")
    policy = DeadLetterPolicy(
        worker="w", max_deliveries=5, default_reply_to=functools.partial(keys.reply, queue),
        max_request_bytes=wire.DEFAULT_MAX_REQUEST_BYTES,
        check_reply_to=keys.reply_to_check(queue), max_letter_bytes=1000,
    )
    pipeline: Pipeline[Any] = Pipeline(NullBackend())
    publisher = Publisher(aioredis.Redis(), Target("s", "d", "g", "c"),
                          reply_ttl_ms=60_000, dead_max_len=10, dead_max_letter_bytes=10)
    lane = Lane(0, queue, policy, None, publisher)  # type: ignore[arg-type]  # nothing reclaims
    pack_command = packing.HiredisPacking().pack_command
    read = stream_read(queue, READ)
    spent: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def step(name: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        spent[name] += time.perf_counter() - started

    collector.settle_after_startup()
    batches = 0
    for _ in range(reads):
        intake = Intake(read_ahead_budgets=4, read_ahead_bytes=1 << 30,
                        max_entry_bytes=1 << 20, max_input_tokens=512)
        packer: Packer[Any] = Packer(Budget(16_384, 256, CostModel.PADDED))
        with step("1 parse"):
            entries = as_entries(read)
        with step("2 hold"):
            intake.hold(0, entries)
        with step("3 decode"):
            decoded = decode_entries(entries, policy=policy, deliveries={}, now_epoch_ms=NOW_MS)
        with step("4 admit"):
            refs = lane.refs([entry_id for entry_id, _ in decoded.requests])
            jobs = pipeline.admit([
                Admit(ref, request, wire.deadline_of(request, entry_id), 0.0)
                for ref, (entry_id, request) in zip(refs, decoded.requests, strict=True)
            ], NOW_MS).jobs
        with step("5 buffer"):
            packer.add_all([(job.encoding.length, job.arrived_ms, job, job.request.priority)
                            for job in jobs])
        with step("6 pick"):
            picked = []
            while (batch := packer.next_batch(0.0, flush=True)) is not None:
                picked.append(batch)
        batches += len(picked)
        with step("7 run"):
            ran = [pipeline.run_batch(batch.payloads, NOW_MS) for batch in picked]
        with step("8 answer"):
            owed = [answers for outcome in ran
                    for answers in answers_by_lane(pipeline, outcome.answered).values()]
        with step("9 publish arguments"):
            for answers in owed:
                names, args = publisher.arguments(answers)
                pack_command("FCALL", "publish", len(names), *names, *args)
        with step("10 release"):
            for answers in owed:
                intake.published(0, [answer.entry_id for answer in answers])
    order = sorted(spent, key=lambda name: int(name.split()[0]))
    per_request = {name: round(spent[name] / reads / READ * 1e6, 3) for name in order}
    return {"us_per_request": per_request, "total_us": round(sum(per_request.values()), 3),
            "reads": reads, "entries_per_read": READ, "rows_per_batch": round(
                reads * READ / max(1, batches), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.reads)
    for name, us in result["us_per_request"].items():
        print(f"{us:7.2f} µs  {name}")
    print(f"{result['total_us']:7.2f} µs  in all ({result['rows_per_batch']} rows a batch)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
