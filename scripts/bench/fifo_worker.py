"""The baseline: a classic fixed-count micro-batcher on the same stream and simulated device.

What a team builds before tokenq: take the next N requests in arrival order,
run them as one batch, answer them. It reads tokenq's stream through the same
consumer group, speaks the same wire format, and runs on the same
:class:`~tokenq.worker.backends.sim.SimBackend` parameters, so the only difference the
benchmark measures is the batching policy. It is given tokenq's plumbing
advantages on purpose: a reader thread reads and tokenizes the next batch
while the device runs the current one, replies go out in one MULTI per batch
(RPUSH, PEXPIRE, XACK, XDEL) from a third thread, and a partial batch waits
at most ``--linger-ms`` (tokenq's default, 2 ms) for company.

An out-of-memory batch is not split or retried (that is tokenq's job): each
of its requests gets an ``out_of_memory`` error reply, as a micro-batcher
without recovery would give.

Run by the benchmark as ``python scripts/bench/fifo_worker.py --batch-size 32
--sim-...``, with ``TOKENQ_REDIS_URL`` and ``TOKENQ_QUEUE`` in the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import queue
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import redis

from tokenq.shared import keys, wire
from tokenq.shared.errors import DecodeError, DeviceOutOfMemory, ErrorCode
from tokenq.worker.backends.base import TextInput
from tokenq.worker.backends.sim import SimBackend

REPLY_TTL_MS = 300_000


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("TOKENQ_REDIS_URL"))
    parser.add_argument("--queue", default=os.environ.get("TOKENQ_QUEUE"))
    parser.add_argument("--consumer", default="fifo")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--linger-ms", type=float, default=2.0)
    parser.add_argument("--batch-log", type=Path)
    parser.add_argument("--sim-dim", type=int, default=32)
    parser.add_argument("--sim-max-input-tokens", type=int, default=2048)
    parser.add_argument("--sim-batch-ms", type=float, default=0.5)
    parser.add_argument("--sim-token-us", type=float, default=0.05)
    parser.add_argument("--sim-bytes-per-token", type=int, default=4096)
    parser.add_argument("--sim-capacity-bytes", type=int, default=1 << 30)
    return parser.parse_args(argv)


class FifoWorker:
    """Read N in order -> run -> publish, in three threads joined by queues of one."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.q = keys.QueueRef(args.queue)
        self.stream = keys.requests(self.q)
        self.client = redis.Redis.from_url(args.redis_url)
        self.backend = SimBackend(
            dim=args.sim_dim, max_input_tokens=args.sim_max_input_tokens,
            batch_ms=args.sim_batch_ms, token_us=args.sim_token_us,
            bytes_per_token=args.sim_bytes_per_token, capacity_bytes=args.sim_capacity_bytes,
        )
        self.stopping = threading.Event()
        self.batches: queue.Queue[list | None] = queue.Queue(maxsize=1)
        self.answers: queue.Queue[list | None] = queue.Queue(maxsize=8)
        self.log = args.batch_log.open("a", buffering=1) if args.batch_log else None
        self.default_reply_to = functools.partial(keys.reply, self.q)

    def serve(self) -> None:
        try:
            self.client.xgroup_create(self.stream, keys.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        alive = keys.worker_alive(self.q, self.args.consumer)
        self.client.set(alive, b"1", px=600_000)
        reader = threading.Thread(target=self.read_loop, name="read")
        publisher = threading.Thread(target=self.publish_loop, name="publish")
        reader.start()
        publisher.start()
        try:
            self.run_loop()
            publisher.join()
            reader.join()
            self.client.delete(alive)
        finally:
            # Written whatever happened, so a benchmark never reads a missing figure.
            if self.log:
                self.log.close()
            stats = os.environ.get("BENCH_SIM_STATS")
            if stats:
                from sim_probe import sim_counters

                Path(stats).write_text(json.dumps(sim_counters(self.backend)))

    # -------------------------------------------------------------------- read

    def read_loop(self) -> None:
        """Gather the next ``batch_size`` entries in stream order, tokenize, hand over."""
        try:
            self._read()
        finally:  # a reader that dies must not leave the run loop waiting forever
            self.batches.put(None)

    def _read(self) -> None:
        size, linger_s = self.args.batch_size, self.args.linger_ms / 1000.0
        pending: list = []
        first_at = 0.0
        while not self.stopping.is_set() or pending:
            if pending:
                block_ms = max(1, int((first_at + linger_s - time.monotonic()) * 1000))
            else:
                block_ms = 200
            if not self.stopping.is_set():
                reply = self.client.xreadgroup(
                    keys.GROUP, self.args.consumer, {self.stream: ">"},
                    count=size - len(pending), block=block_ms,
                )
                entries = reply[0][1] if reply else []
                if entries and not pending:
                    first_at = time.monotonic()
                pending += entries
            if pending and (
                len(pending) >= size or self.stopping.is_set()
                or time.monotonic() >= first_at + linger_s
            ):
                self.batches.put(self.tokenize(pending))
                pending = []

    def tokenize(self, entries: list) -> list:
        jobs = []
        for entry_id, fields in entries:
            try:
                request = wire.decode_request(fields, default_reply_to=self.default_reply_to)
            except DecodeError:
                continue
            encoding = self.backend.tokenize(
                [TextInput(request.text)], self.backend.info.max_input_tokens
            )[0]
            jobs.append((entry_id, request, encoding))
        return jobs

    # --------------------------------------------------------------------- run

    def run_loop(self) -> None:
        """Run each batch exactly as read; an OOM fails every request in it."""
        try:
            self._run()
        finally:  # likewise for the publisher
            self.answers.put(None)

    def _next_batch(self) -> list | None:
        """The reader's next batch, waiting in short steps.

        Why not one untimed ``get``: the SIGTERM handler runs on this (the
        main) thread, and a signal the kernel gave to another thread (the
        reader's, numpy's) does not interrupt an untimed wait: the stop was
        missed and the seed suite lost this worker's counters. Each timed
        step returns to Python, which then runs the handler.
        """
        while True:
            with contextlib.suppress(queue.Empty):
                return self.batches.get(timeout=0.2)

    def _run(self) -> None:
        while (jobs := self._next_batch()) is not None:
            encodings = [encoding for _, _, encoding in jobs]
            started = time.perf_counter()
            try:
                vectors = self.backend.run(encodings)
                error = None
            except DeviceOutOfMemory as exc:
                vectors, error = [], str(exc)
            device_ms = (time.perf_counter() - started) * 1000.0
            answers = []
            for index, (entry_id, request, encoding) in enumerate(jobs):
                if error is None:
                    vector = np.ascontiguousarray(vectors[index], dtype="<f4")
                    reply = wire.embedding_reply(
                        request.id, vector.tobytes(), int(vector.shape[0]), tokens=encoding.length
                    )
                else:
                    reply = wire.error_reply(request.id, ErrorCode.OUT_OF_MEMORY.value, error)
                answers.append((entry_id, request.reply_to, wire.encode_reply(reply)))
            self.record(encodings, device_ms, failed=len(jobs) if error else 0)
            self.answers.put(answers)

    def record(self, encodings: list, device_ms: float, failed: int) -> None:
        if self.log is None or not encodings:
            return
        lengths = [encoding.length for encoding in encodings]
        padded = len(lengths) * max(lengths)
        self.log.write(json.dumps({
            "worker": self.args.consumer, "rows": len(lengths), "tokens": sum(lengths),
            "padded_tokens": padded, "cost": padded, "max_batch_tokens": None,
            "max_batch_size": self.args.batch_size, "sealed": True,
            "device_ms": round(device_ms, 3), "failed": failed, "oom_splits": 0,
        }) + "\n")

    # ----------------------------------------------------------------- publish

    def publish_loop(self) -> None:
        """Replies, XACK and XDEL of a batch in one MULTI, as tokenq publishes."""
        while (answers := self.answers.get()) is not None:
            if not answers:
                continue
            with self.client.pipeline(transaction=True) as pipe:
                for _, reply_to, payload in answers:
                    pipe.rpush(reply_to, payload)
                for reply_to in {reply_to for _, reply_to, _ in answers}:
                    pipe.pexpire(reply_to, REPLY_TTL_MS)
                ids = [entry_id for entry_id, _, _ in answers]
                pipe.xack(self.stream, keys.GROUP, *ids)
                pipe.xdel(self.stream, *ids)
                pipe.execute()


def main(argv: Sequence[str] | None = None) -> None:
    worker = FifoWorker(parse(argv))
    signal.signal(signal.SIGTERM, lambda *_: worker.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: worker.stopping.set())
    worker.serve()


if __name__ == "__main__":
    main()
