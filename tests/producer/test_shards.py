"""Sharded queues on one Redis: producers spread calls, workers read every shard into one packer.

The same behaviour on a real Redis Cluster (shards on different nodes,
failover) is tests/faults/test_cluster.py; here the rules themselves: how K is
learned, where each request and reply goes, what a worker reads and
reclaims, and that a queue of one shard is unchanged.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter

import numpy as np
import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from tests.support import SimModel, fleet_fixture, wait_lane_ready
from tests.workers import Fleet, WorkerProcess
from tokenq.producer import AsyncClient, Client
from tokenq.producer.shards import ShardChooser, shard_count
from tokenq.shared import keys, wire
from tokenq.shared.errors import ConfigError
from tokenq.shared.queue_config import QueueConfig, parse_config
from tokenq.shared.settings import ClientSettings
from tokenq.worker.backends.sim import expected_vector
from tokenq.worker.loop.lanes import Ref

DIM = 16
MAX_INPUT = 512
fleet = fleet_fixture(*SimModel(DIM, MAX_INPUT).flags())


def start(fleet: Fleet, r: redis.Redis, queue: str, *flags: str, shards: int = 3,
          name: str | None = None) -> WorkerProcess:
    worker = fleet.start("--shards", str(shards), *flags, name=name)
    wait_lane_ready(worker, r, queue, shards)
    return worker


def shard_lengths(r: redis.Redis, queue: str, shards: int) -> list[int]:
    return [r.xlen(keys.requests(s)) for s in keys.shards_of(keys.QueueRef(queue), shards)]


def check_vector(embedding: object, text: str) -> None:
    np.testing.assert_allclose(np.asarray(embedding, dtype=np.float32),
                               expected_vector(text, DIM, MAX_INPUT), rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the rules, sans-I/O


@pytest.mark.unit
@given(st.integers(0, keys.MAX_SHARDS - 1), st.text("0123456789abcdef", min_size=1, max_size=40))
def test_a_request_id_names_its_shard(shard: int, unique: str) -> None:
    assert keys.shard_in_id(keys.id_on_shard(shard, unique)) == shard
    assert keys.shard_in_id(keys.id_on_shard(None, unique)) is None


@pytest.mark.unit
@given(st.text(max_size=40))
def test_any_other_id_names_no_shard_or_a_valid_one(request_id: str) -> None:
    shard = keys.shard_in_id(request_id)
    assert shard is None or 0 <= shard < keys.MAX_SHARDS


@pytest.mark.unit
@given(st.integers(1, 64))
def test_lanes_are_the_shards_then_the_plain_queue(shards: int) -> None:
    q = keys.QueueRef("q")
    lanes = keys.lanes_of(q, shards)
    if shards == 1:
        assert lanes == (q,) and keys.requests(q) == "tokenq:{q}:requests"
        return
    assert [lane.shard for lane in lanes] == [*range(shards), None]
    assert len({keys.requests(lane) for lane in lanes}) == shards + 1
    assert all(keys.queue_of(keys.requests(lane)) == lane for lane in lanes)


@pytest.mark.unit
@given(st.integers(1, 64), st.integers(0, keys.MAX_SHARDS + 8))
def test_retired_shards_are_exactly_the_served_ones_no_lane_reads(shards: int, served: int) -> None:
    """After any change of K, every numbered shard ever served is read or retired, not both."""
    q = keys.QueueRef("q")
    retired = keys.retired_shards(q, shards, served)
    reading = set(keys.lanes_of(q, shards))
    assert not reading & set(retired)
    numbered = [count for count in (shards, min(served, keys.MAX_SHARDS)) if count > 1]
    ever = set(range(max(numbered, default=0)))  # a count of 1 is the plain {q} alone
    assert {lane.shard for lane in (*reading, *retired) if lane.shard is not None} == ever
    assert all(keys.retired(lane) == f"tokenq:{{q:{lane.shard}}}:retired" for lane in retired)
    if served <= shards:
        assert retired == ()


@pytest.mark.unit
def test_bad_shard_counts_are_refused_by_name() -> None:
    for bad in (0, -1, keys.MAX_SHARDS + 1, 2.0, True):
        with pytest.raises(ValueError, match="shards must be an integer"):
            keys.shards_of(keys.QueueRef("q"), bad)  # type: ignore[arg-type]


@pytest.mark.unit
@given(st.lists(st.tuples(st.integers(0, 7), st.binary(min_size=1, max_size=20).filter(
    lambda b: b"/" not in b)), max_size=30))
def test_references_undo_to_their_lane_and_entry(entries: list[tuple[int, bytes]]) -> None:
    for lane, entry_id in entries:
        ref = Ref(lane, entry_id)
        assert (ref.lane, ref.entry_id) == (lane, entry_id)


@pytest.mark.unit
@given(st.integers(2, 16), st.integers(1, 500))
def test_round_robin_spreads_calls_evenly(shards: int, calls: int) -> None:
    chooser = ShardChooser("round_robin")
    counts = Counter(chooser.pick(shards) for _ in range(calls))
    assert max(counts.values()) - min(counts.get(k, 0) for k in range(shards)) <= 1


@pytest.mark.unit
@given(st.lists(st.integers(0, 1000), min_size=2, max_size=8), st.integers(1, 50))
def test_shortest_goes_to_the_shortest_and_counts_what_it_added(
    lengths: list[int], batch: int
) -> None:
    chooser = ShardChooser("shortest")
    chooser.take_lengths(lengths, now_s=0.0)
    assert not chooser.lengths_due(len(lengths), 0.5)
    assert chooser.lengths_due(len(lengths), 1.0)
    seen = list(lengths)
    for _ in range(20):
        shard = chooser.pick(len(lengths))
        assert seen[shard] == min(seen)
        chooser.added(shard, batch)
        seen[shard] += batch


@pytest.mark.unit
def test_the_shard_count_comes_from_the_workers_and_a_contradiction_is_refused() -> None:
    assert shard_count(None, None, "q") == 1
    assert shard_count(3, None, "q") == 3  # nothing published yet: the setting
    assert shard_count(None, QueueConfig(shards=4), "q") == 4
    assert shard_count(None, QueueConfig(), "q") == 1  # a hash without the field: 1
    with pytest.raises(ConfigError, match=r"set to 3 shards.*workers serve 4"):
        shard_count(3, QueueConfig(shards=4), "q")


@pytest.mark.unit
def test_answers_go_back_to_their_lane_under_their_bare_id() -> None:
    from tokenq.worker.loop.outbox import answers_by_lane
    from tokenq.worker.pipeline.pipeline import Failure, Outcome

    class Encoder:
        def encoded_replies(self, outcomes: list[Outcome]) -> list[tuple[bytes, bool]]:
            return [(b"", True)] * len(outcomes)

    outcomes = [Outcome(Ref(k % 3, b"1-%d" % k), wire.Request(str(k), "t", 1, "r"),
                        Failure("x", "y")) for k in range(9)]
    grouped = answers_by_lane(Encoder(), outcomes)  # type: ignore[arg-type]
    assert sorted(grouped) == [0, 1, 2]
    assert [a.entry_id for a in grouped[1]] == [b"1-1", b"1-4", b"1-7"]


# ----------------------------------------------------------------- one Redis, real workers


def test_clients_learn_the_shards_and_spread_their_calls(fleet, r, redis_url, queue_name):
    start(fleet, r, queue_name)
    base = keys.QueueRef(queue_name)
    for lane in keys.lanes_of(base, 3):
        assert parse_config(r.hgetall(keys.config(lane))).shards == 3
    rng = random.Random(5)
    texts = [" ".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 30)))
             for _ in range(60)]
    with Client(redis_url, queue_name, timeout_s=20) as client:
        ids = [client.submit(text) for text in texts[:30]]
        assert Counter(keys.shard_in_id(i) for i in ids) == {0: 10, 1: 10, 2: 10}
        # The next call goes to the shard after the last one's.
        assert keys.shard_in_id(client.submit("next")) == (keys.shard_in_id(ids[-1]) + 1) % 3
        for result, text in zip(client.results(ids), texts[:30], strict=True):
            check_vector(result.embedding, text)
        # A reply_to in one shard's namespace pins the call to that shard.
        mine = keys.reply(keys.QueueRef(queue_name, shard=2), "mine")
        pinned = [client.submit(text, reply_to=mine) for text in texts[:4]]
        assert {keys.shard_in_id(i) for i in pinned} == {2}
        replies = [wire.decode_reply(r.blpop([mine], timeout=10)[1]) for _ in pinned]
        assert sorted(reply.id for reply in replies) == sorted(pinned)
        many = client.infer_many(texts[30:45])
        for result, text in zip(many, texts[30:45], strict=True):
            check_vector(result.embedding, text)
        assert client.queue_length() == 0

    async def go() -> None:
        async with AsyncClient(redis_url, queue_name, timeout_s=20) as client:
            results = await asyncio.gather(*(client.infer(t) for t in texts[45:]))
            for result, text in zip(results, texts[45:], strict=True):
                check_vector(result.embedding, text)
            # One listener per shard's key: each call's replies land in its shard's slot.
            assert len(client._listeners) == 3

    asyncio.run(go())
    assert all(r.xlen(keys.requests(lane)) == 0 for lane in keys.lanes_of(base, 3))


def test_one_worker_packs_every_shard_into_one_budget(fleet, r, redis_url, queue_name):
    # No worker yet: the setting says where to write.
    settings = ClientSettings(redis_url=redis_url, queue=queue_name, timeout_s=30, shards=3)
    with Client(settings=settings) as client:
        ids = client.submit_many([f"w{i} x" for i in range(10)])
        ids += client.submit_many([f"v{i} y" for i in range(10)])
        ids += client.submit_many([f"u{i} z" for i in range(10)])
        assert sorted(shard_lengths(r, queue_name, 3)) == [10, 10, 10]
        worker = start(fleet, r, queue_name, "--linger-ms", "200")
        assert all(result.embedding is not None for result in client.results(ids))
    rows = [batch["rows"] for batch in worker.batches()]
    assert sum(rows) == 30
    assert max(rows) > 10, f"a batch took requests of several shards: {rows}"


def test_a_sharded_worker_still_answers_the_plain_stream(fleet, r, redis_url, queue_name):
    """A producer that wrote before it learned K (or before resharding) is answered."""
    q = keys.QueueRef(queue_name)
    reply_to = keys.reply(q, "old")
    fields = wire.encode_request(wire.Request(id="old-1", text="hello there", tokens=4,
                                              reply_to=reply_to))
    r.xadd(keys.requests(q), fields)
    start(fleet, r, queue_name)
    popped = r.blpop([reply_to], timeout=15)
    assert popped is not None
    reply = wire.decode_reply(popped[1])
    assert reply.ok and reply.id == "old-1"
    check_vector(np.frombuffer(reply.embedding, dtype="<f4"), "hello there")


def test_a_producer_set_to_other_shards_than_the_workers_is_refused(
    fleet, r, redis_url, queue_name
):
    start(fleet, r, queue_name)
    settings = ClientSettings(redis_url=redis_url, queue=queue_name, timeout_s=5, shards=2)
    with Client(settings=settings) as client, pytest.raises(
        ConfigError, match=r"set to 2 shards.*workers serve 3"
    ):
        client.submit("x")
    assert shard_lengths(r, queue_name, 3) == [0, 0, 0]
    assert r.xlen(keys.requests(keys.QueueRef(queue_name))) == 0


def test_a_killed_workers_entries_are_claimed_on_every_shard(fleet, r, redis_url, queue_name):
    slow = ("--heartbeat-s", "0.5", "--sim-batch-ms", "400")
    first = start(fleet, r, queue_name, *slow, name="first")
    with Client(redis_url, queue_name, timeout_s=60) as client:
        ids = [i for k in range(9) for i in client.submit_many([f"t{k} {j}" for j in range(20)])]
        deadline = time.monotonic() + 10
        held = 0
        while time.monotonic() < deadline:
            held = sum(r.xpending(keys.requests(s), keys.GROUP)["pending"]
                       for s in keys.shards_of(keys.QueueRef(queue_name), 3))
            if held >= 30:
                break
            time.sleep(0.02)
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=10)
        second = start(fleet, r, queue_name, "--heartbeat-s", "0.5", name="second")
        results = client.results(ids)
    assert held >= 30 and all(result.embedding is not None for result in results)
    assert second.output().count("claimed") >= 1, second.output()
    for lane in keys.lanes_of(keys.QueueRef(queue_name), 3):
        assert r.xlen(keys.requests(lane)) == 0


def test_one_shard_writes_exactly_what_an_unsharded_queue_always_did(fleet, r, redis_url,
                                                                       queue_name):
    start(fleet, r, queue_name, shards=1)
    with Client(redis_url, queue_name, timeout_s=20) as client:
        request_id = client.submit("plain")
        assert keys.shard_in_id(request_id) is None and len(request_id) == 32
        assert client.result(request_id).embedding is not None
    found = {key.decode() for key in r.scan_iter(match=f"*{queue_name}*")}
    tag = f"tokenq:{{{queue_name}}}:"
    assert all(key.startswith(tag) for key in found), found
    assert "shards" not in {k.decode() for k in r.hkeys(keys.config(keys.QueueRef(queue_name)))}


def test_embed_and_the_gateway_work_across_shards(fleet, r, redis_url, queue_name, tmp_path,
                                                  capsys):
    """The operator's bulk path and the HTTP gateway use the clients, so they spread too."""
    pytest.importorskip("fastapi")
    from fastapi import testclient

    from tokenq.producer.ops.embed import main as embed_main
    from tokenq.producer.serve.app import create_app
    from tokenq.shared.settings import ServeSettings

    start(fleet, r, queue_name)
    lines = [f"line {i} " + "x " * (i % 17) for i in range(120)]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.npy"
    code = embed_main([str(source), "--output", str(out), "--redis-url", redis_url,
                       "--queue", queue_name, "--no-progress", "--chunk-size", "32",
                       "--batch-size", "8"])
    assert code == 0, capsys.readouterr().err
    matrix = np.load(out)
    for row, text in zip(matrix, lines, strict=True):
        check_vector(row, text)

    app = create_app(ServeSettings(redis_url=redis_url, queue=queue_name))
    with testclient.TestClient(app, raise_server_exceptions=True) as http:
        assert http.get("/ready").status_code == 200
        for start_at in range(0, 12, 3):
            texts = lines[start_at:start_at + 3]
            answer = http.post("/embed", json={"inputs": texts})
            assert answer.status_code == 200, answer.text
            for vector, text in zip(answer.json(), texts, strict=True):
                check_vector(vector, text)
    # Both wrote through every shard: the dedupe keys (kept 60 s) say where.
    for shard in keys.shards_of(keys.QueueRef(queue_name), 3):
        assert any(True for _ in r.scan_iter(match=f"{shard.tag}:seen:*", count=1000)), shard
