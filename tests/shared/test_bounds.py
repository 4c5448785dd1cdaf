"""Every id, option and setting is bounded where it enters.

Settings: every int and float of every command's settings is walked, so a
setting added later is tried too; a value is either refused with one line
naming its flag, or one that Python's clocks, msgpack and Redis (in a script
or not) all take. Options: hypothesis over each numeric option's whole space.
Ids: an id's shard part names a shard only where the queue has one. A
Cluster URL whose nodes are unreachable: the client is made, the first call
is ``BrokerUnavailable`` within its deadline.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import threading
import time
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from tests.redis_server import free_ports
from tokenq.producer import AsyncClient, BadRequest, BrokerUnavailable, Client, ReplyTimeout
from tokenq.producer.core import ClientCore
from tokenq.producer.deadline import check_seconds
from tokenq.shared import keys, wire
from tokenq.shared.request_options import MAX_DIMENSIONS, ModelFacts, parse_options
from tokenq.shared.settings import (
    MAX_EXACT_INT,
    MAX_SECONDS,
    ClientSettings,
    DlqSettings,
    EmbedSettings,
    ServeSettings,
    StatsSettings,
    TopSettings,
    UpSettings,
    describe_errors,
    flag,
)
from tokenq.worker.settings import WorkerSettings

COMMANDS: list[type[BaseModel]] = [
    ClientSettings, WorkerSettings, EmbedSettings, ServeSettings, UpSettings, TopSettings,
    StatsSettings, DlqSettings,
]
REQUIRED: dict[type[BaseModel], dict[str, Any]] = {
    EmbedSettings: {"file": "in.txt", "output": "out.jsonl"},
    DlqSettings: {"action": "list"},
}


def numeric_fields(settings_cls: type[BaseModel]) -> list[str]:
    """Every int or float setting (``int | None`` and ``int | 'auto'`` too)."""
    out = []
    for name, info in settings_cls.model_fields.items():
        annotation = info.annotation
        kinds = getattr(annotation, "__args__", (annotation,))
        if any(kind in (int, float) for kind in kinds) and annotation is not bool:
            out.append(name)
    return out


FIELDS = [(cls, name) for cls in COMMANDS for name in numeric_fields(cls)]

numbers = st.one_of(
    st.integers(),
    st.integers(min_value=2**50, max_value=2**70),
    st.integers(min_value=-(2**70), max_value=-(2**50)),
    st.sampled_from([10**30, -(10**30), 2**53, 2**53 + 1, 2**63, 2**64, MAX_SECONDS,
                     MAX_SECONDS + 1, 1e16, 1e300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.inf, -math.inf, math.nan]),
    st.booleans(),
)


@pytest.mark.unit
def test_every_command_has_numeric_settings_to_walk() -> None:
    names = {name for _, name in FIELDS}
    for expected in ("dedupe_ttl_s", "reply_ttl_s", "heartbeat_s", "claim_idle_s",
                     "durable_timeout_ms", "block_ms", "max_queue_length", "timeout_s"):
        assert expected in names


@pytest.mark.unit
@pytest.mark.parametrize(("settings_cls", "name"), FIELDS,
                         ids=[f"{cls.__name__}.{name}" for cls, name in FIELDS])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=numbers)
def test_a_numeric_setting_is_refused_in_one_line_or_taken_by_redis_and_python(
    settings_cls: type[BaseModel], name: str, value: object
) -> None:
    given_ = {**REQUIRED.get(settings_cls, {}), name: value}
    if settings_cls is WorkerSettings:
        given_["backend"] = "plugin.for:tests"  # no other backend's options are refused
    try:
        made = settings_cls(**given_)
    except ValidationError as exc:
        lines = describe_errors(exc, settings_cls)
        assert len(lines) == 1, lines  # this setting's flag, or the one a cross-check names
        assert lines[0].startswith(f"{flag(settings_cls, name)} / ") or (
            "/ TOKENQ_" in lines[0] and name in lines[0]), lines
        return
    kept = getattr(made, name)
    if not isinstance(kept, (int, float)) or isinstance(kept, bool):
        return  # 'auto', None
    if math.isinf(kept):
        assert kept > 0 and name == "max_padding_ratio"  # its help says what inf means
        return
    assert not math.isnan(kept)
    if name.endswith("_s"):
        assert abs(kept) <= MAX_SECONDS
        # A worker's liveness key lives 3 heartbeats, in ms: still exact in Lua.
        assert int(abs(kept) * 3000) <= MAX_EXACT_INT
        time.monotonic() + kept  # a deadline Python can hold
    elif name.endswith("_ms"):
        assert abs(kept) <= MAX_SECONDS * 1000
    else:
        assert abs(kept) <= MAX_EXACT_INT


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "line"), [
    (["--backend", "sim", "--reply-ttl-s", "inf"],
     "  --reply-ttl-s / TOKENQ_REPLY_TTL_S: reply_ttl_s must be finite, got inf"),
    (["--backend", "sim", "--heartbeat-s", "1e16"],
     "  --heartbeat-s / TOKENQ_HEARTBEAT_S: heartbeat_s must be at most 1,000,000,000 "
     "(about 31 years), got 1e+16"),
    (["--backend", "sim", "--claim-idle-s", "nan"],
     "  --claim-idle-s / TOKENQ_CLAIM_IDLE_S: Input should be greater than 0"),
])
def test_a_bad_ttl_is_the_one_line_exit_2_of_a_bad_setting(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = importlib.import_module("tokenq.worker.cli").main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["tokenq worker: invalid settings:", line], err


@pytest.mark.unit
def test_a_bad_ttl_in_the_environment_is_refused_by_the_producer_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENQ_DEDUPE_TTL_S", "inf")
    with pytest.raises(BadRequest, match=r"dedupe_ttl_s / TOKENQ_DEDUPE_TTL_S: .* finite"):
        Client(queue="q")


def test_the_longest_ttls_are_taken_by_a_real_redis(redis_url: str, queue_name: str) -> None:
    """At the ceiling, the dedupe key's SET PX runs inside enqueue.lua, and a liveness key
    of three of the longest heartbeats is a plain SET PX and a PEXPIRE: Redis takes all."""
    longest = ClientSettings(redis_url=redis_url, queue=queue_name, dedupe_ttl_s=MAX_SECONDS)
    r = redis.Redis.from_url(redis_url)
    with Client(settings=longest) as client:
        ids = client.submit_many(["a", "b", "c"])  # all or nothing: all
    q = keys.QueueRef(queue_name)
    assert r.xlen(keys.requests(q)) == 3
    assert r.pttl(keys.seen_call(q, ids)) > (MAX_SECONDS - 60) * 1000
    alive = keys.worker_alive(q, "w")
    assert r.set(alive, b"1", px=MAX_SECONDS * 3000)
    assert r.pexpire(alive, MAX_SECONDS * 3000)
    r.close()


# ------------------------------------------------------------------------ options


option_values = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**62, max_value=2**80),
    st.sampled_from([10**30, -(10**30), 2**63, 2**64, MAX_DIMENSIONS, MAX_DIMENSIONS + 1]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
)
OPTIONS = ["dimensions", "priority", "deadline_s", "deadline_ms"]


@pytest.mark.unit
@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(OPTIONS), value=option_values,
       timeout_s=st.one_of(st.none(), option_values))
def test_every_numeric_option_is_a_bad_request_or_a_request_the_worker_reads(
    name: str, value: object, timeout_s: object
) -> None:
    core = ClientCore(ClientSettings(queue="q"), estimator="heuristic")
    now_ms = int(time.time() * 1000)
    try:
        if timeout_s is not None:  # a wait Python's threads and sockets can hold
            assert 0 < check_seconds(timeout_s, "timeout_s") <= threading.TIMEOUT_MAX
        prepared = core.preparer.prepare(core.lanes.home, "text", now_ms=now_ms,
                                         **{name: value})  # type: ignore[misc]
    except BadRequest:
        return
    request = wire.decode_request(prepared.fields)  # what a worker reads
    assert parse_options(request.opts, ModelFacts()).dimensions in (None, value)


@pytest.mark.unit
@given(st.one_of(st.integers(), st.sampled_from([10**30, 2**64, -(2**64)])))
def test_dimensions_are_bounded_even_when_the_model_is_unknown(value: int) -> None:
    try:
        checked = parse_options({"dimensions": value}, ModelFacts())
    except ValueError as exc:
        assert "dimensions must be from 1 to 65536" in str(exc)
        assert not 1 <= value <= MAX_DIMENSIONS
    else:
        assert checked.dimensions == value and 1 <= value <= MAX_DIMENSIONS


def test_huge_dimensions_are_a_bad_request_at_the_enqueue(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        with pytest.raises(BadRequest, match="dimensions must be from 1 to 65536"):
            client.submit("x", dimensions=10**30)
        with pytest.raises(BadRequest, match="msgpack"):
            client.submit("x", opts={"someday": 10**30})  # an option this version does not know
        assert client.queue_length() == 0


def test_the_gateway_answers_huge_dimensions_with_422(redis_url: str, queue_name: str) -> None:
    testclient = pytest.importorskip("fastapi.testclient")
    from tokenq.producer.serve.app import create_app

    app = create_app(ServeSettings(redis_url=redis_url, queue=queue_name, timeout_s=2))
    with testclient.TestClient(app) as http:
        answer = http.post("/v1/embeddings",
                           json={"model": "m", "input": "x", "dimensions": 10**30})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == "dimensions"


# ---------------------------------------------------------------------------- ids


def push_reply(r: redis.Redis, q: keys.QueueRef, request_id: str) -> None:
    """What a worker does with a request read from ``q`` whose reply_to is the default."""
    reply = wire.scores_reply(request_id, [0.5])
    r.rpush(keys.reply(q, request_id), wire.encode_reply(reply))


def test_an_id_that_looks_sharded_is_a_plain_id_of_a_one_shard_queue(
    redis_url: str, queue_name: str,
) -> None:
    """``7.order-42`` from a producer in another language, on a queue of one shard."""
    r = redis.Redis.from_url(redis_url)
    plain = keys.QueueRef(queue_name)
    push_reply(r, plain, "7.order-42")
    with Client(redis_url, queue_name) as client:
        assert client.result("7.order-42", timeout_s=2).scores == (0.5,)

    async def main() -> None:
        push_reply(r, plain, "3.again")
        async with AsyncClient(redis_url, queue_name) as aclient:
            assert (await aclient.result("3.again", timeout_s=2)).scores == (0.5,)

    asyncio.run(main())


def test_an_id_names_a_shard_the_queue_has_or_had(redis_url: str, queue_name: str) -> None:
    """On a queue of 4 shards: ``2.x`` is shard 2's, ``6.y`` is ``{q}``'s unless shard 6
    was retired (the queue had it once, and answers there while it drains)."""
    r = redis.Redis.from_url(redis_url)
    plain = keys.QueueRef(queue_name)
    r.hset(keys.config(plain), mapping={"shards": "4"})
    push_reply(r, keys.QueueRef(queue_name, shard=2), "2.x")
    push_reply(r, plain, "6.y")
    push_reply(r, keys.QueueRef(queue_name, shard=5), "5.z")
    r.set(keys.retired(keys.QueueRef(queue_name, shard=5)), b"1")
    with Client(redis_url, queue_name) as client:
        got = client.results(["2.x", "6.y", "5.z"], timeout_s=2)
        assert [result.id for result in got] == ["2.x", "6.y", "5.z"]
        started = time.monotonic()
        with pytest.raises(ReplyTimeout):
            client.result("6.never", timeout_s=0.3)
        assert time.monotonic() - started < 1.5


# ---------------------------------------------------------------- cluster, unreachable


def test_an_unreachable_cluster_is_broker_unavailable_at_the_first_call() -> None:
    first = free_ports(2)  # nothing listens on these two
    url = f"redis+cluster://127.0.0.1:{first},127.0.0.1:{first + 1}"
    client = Client(url, "q", timeout_s=1)  # made without reaching anything
    try:
        for call in (lambda: client.submit("x"), lambda: client.infer("x", timeout_s=0.5),
                     client.queue_length):
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable, match="unreachable"):
                call()
            assert time.monotonic() - started < 1.5
    finally:
        client.close()

    async def main() -> None:
        async with AsyncClient(url, "q", timeout_s=1) as aclient:
            with pytest.raises(BrokerUnavailable):
                await aclient.submit("x")

    asyncio.run(main())
