"""A stand-in worker for the producer tests, and the tests of that stand-in.

The real worker is built separately, so the producer tests talk to this one:
a thread that reads the queue's stream through the consumer group with raw
redis-py and answers each entry on its ``reply_to`` the way the wire format
says a worker must (RPUSH, then XACK and XDEL in one MULTI). It answers each
read batch in reverse order, so tests that check input order cannot pass by
accident. (The module is named ``test_*`` only because the producer owns
those files; it holds two tests of the fake itself.)
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable

import pytest
import redis

from tokenq.shared import keys, wire

Answer = Callable[[wire.Request], wire.Reply]


def embed_answer(request: wire.Request) -> wire.Reply:
    """The default answer, keyed on the text so tests can see which input it came from.

    ``ERR:<code>`` texts get an error reply with that code, ``SCORE`` texts
    get scores; anything else gets the 3-d embedding
    ``[len(text), tokens, len(text_pair or "")]``.
    """
    if request.text.startswith("ERR:"):
        code = request.text[4:]
        return wire.error_reply(request.id, code, f"fake worker refused: {code}")
    if request.text.startswith("SCORE"):
        return wire.scores_reply(request.id, [0.25, 0.75], tokens=request.tokens)
    values = (len(request.text), request.tokens, len(request.text_pair or ""))
    return wire.embedding_reply(request.id, struct.pack("<3f", *values), 3, tokens=request.tokens)


class FakeWorker:
    """Reads ``tokenq:{q}:requests`` through group ``workers`` and answers every entry."""

    def __init__(self, redis_url: str, queue: str, answer: Answer = embed_answer) -> None:
        self.redis = redis.Redis.from_url(redis_url)
        self.stream = keys.requests(keys.QueueRef(queue))
        self.answer = answer
        self.seen: list[wire.Request] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-worker", daemon=True)

    def start(self) -> FakeWorker:
        try:
            self.redis.xgroup_create(self.stream, keys.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.redis.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            streams = self.redis.xreadgroup(
                keys.GROUP, "fake", {self.stream: ">"}, count=500, block=50
            )
            for _, entries in streams or []:
                self._answer(entries)

    def _answer(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        decoded = [(entry_id, wire.decode_request(fields)) for entry_id, fields in entries]
        self.seen.extend(request for _, request in decoded)
        with self.redis.pipeline(transaction=True) as pipe:
            for entry_id, request in reversed(decoded):
                pipe.rpush(request.reply_to, wire.encode_reply(self.answer(request)))
                pipe.pexpire(request.reply_to, 60_000)
                pipe.xack(self.stream, keys.GROUP, entry_id)
                pipe.xdel(self.stream, entry_id)
            pipe.execute()


def test_fake_worker_answers_on_reply_to(redis_url: str, queue_name: str, r: redis.Redis) -> None:
    worker = FakeWorker(redis_url, queue_name).start()
    try:
        request = wire.Request(id="abc", text="hello", tokens=3, reply_to="test:reply:abc")
        r.xadd(worker.stream, wire.encode_request(request))
        popped = r.blpop(["test:reply:abc"], timeout=5)
    finally:
        worker.stop()
    assert popped is not None
    reply = wire.decode_reply(popped[1])
    assert reply.id == "abc" and struct.unpack("<3f", reply.embedding or b"") == (5.0, 3.0, 0.0)
    assert r.xlen(worker.stream) == 0


@pytest.mark.unit
def test_fake_worker_error_answer() -> None:
    request = wire.Request(id="x", text="ERR:too_long", tokens=1, reply_to="k")
    reply = embed_answer(request)
    assert not reply.ok and reply.error is not None and reply.error.code == "too_long"
