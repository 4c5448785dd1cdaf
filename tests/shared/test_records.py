"""The records on Redis besides requests and replies: config hash, heartbeat, dead letter.

Each has one sans-I/O module in ``tokenq.shared``; these tests drive the
encode/parse pairs directly (round trips, and parsers that never raise
anything but their one error), and check that the Lua twin of the dead-letter
rule (``shared/lua/dead_letter.lua``) writes what the Python one writes.
"""

from __future__ import annotations

import string

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenq.shared import dead_letter, keys, lua_scripts
from tokenq.shared.dead_letter import Death, encode_letter, is_dead_field, parse_letter
from tokenq.shared.errors import DecodeError
from tokenq.shared.heartbeat import Heartbeat, decode_heartbeat, encode_heartbeat
from tokenq.shared.queue_config import QueueConfig, encode_config, parse_config

PROPERTY = settings(max_examples=200, deadline=None)
words = st.text(min_size=1, max_size=40)
counts = st.integers(min_value=0, max_value=1 << 40)
positive = st.integers(min_value=1, max_value=1 << 40)
seconds = st.floats(min_value=0, max_value=1e10, allow_nan=False)

# ------------------------------------------------------------------ config hash

configs = st.builds(
    QueueConfig,
    max_input_tokens=st.none() | positive,
    policy=st.none() | st.sampled_from(["reject", "truncate", "chunk"]),
    pairs=st.none() | st.booleans(),
    tokenizer=st.none() | words,
    model=st.none() | words,
    protocol=st.none() | counts,
    backend=st.none() | words,
    task=st.none() | st.sampled_from(["embed", "classify", "rerank"]),
    padded=st.none() | st.booleans(),
    max_batch_tokens=st.none() | positive,
    dim=st.none() | positive,
    normalized=st.none() | st.booleans(),
    labels=st.none() | st.lists(st.text(max_size=20), max_size=5).map(tuple),
    updated_at=st.none() | counts,
)


@pytest.mark.unit
@PROPERTY
@given(configs)
def test_a_config_hash_reads_back_as_written(config: QueueConfig) -> None:
    fields = encode_config(config)
    assert all(isinstance(v, str) for v in fields.values())  # redis-cli HGETALL reads it
    raw = {k.encode(): v.encode() for k, v in fields.items()}  # what HGETALL returns
    expected = config if fields else None  # an empty hash is a missing one
    assert parse_config(fields) == expected and parse_config(raw) == expected


@pytest.mark.unit
@PROPERTY
@given(st.dictionaries(st.text(max_size=20), st.text(max_size=30)))
def test_any_config_hash_parses_without_raising(fields: dict[str, str]) -> None:
    config = parse_config(fields)
    assert (config is None) == (not fields)


@pytest.mark.unit
def test_the_worker_side_writes_the_fields_producers_read() -> None:
    fields = encode_config(QueueConfig(max_input_tokens=512, policy="reject", pairs=False,
                                       padded=True, dim=384, protocol=1))
    assert fields == {"max_input_tokens": "512", "policy": "reject", "pairs": "0",
                      "padded": "1", "dim": "384", "protocol": "1"}


@pytest.mark.unit
@PROPERTY
@given(st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=4),
       st.none() | st.lists(st.text(max_size=10), max_size=4), st.text(max_size=10))
def test_prompts_and_labels_round_trip_through_the_hash(
    prompts: dict[str, str], labels: list[str] | None, default: str
) -> None:
    config = QueueConfig(prompts=prompts, labels=None if labels is None else tuple(labels),
                         default_prompt_name=default or None)
    parsed = parse_config(encode_config(config))
    assert parsed is not None
    assert parsed.prompts == prompts and parsed.default_prompt_name == (default or None)
    assert parsed.labels == config.labels


# -------------------------------------------------------------------- heartbeat

heartbeats = st.builds(
    Heartbeat,
    host=st.none() | words,
    pid=st.none() | positive,
    model=st.none() | words,
    at=st.none() | seconds,
    started_at=st.none() | seconds,
    max_batch_tokens=st.none() | positive,
    configured_batch_tokens=st.none() | positive,
    max_batch_size=st.none() | positive,
    buffered=counts,
    requests_ok=counts,
    requests_failed=counts,
    batches=counts,
    tokens=counts,
    padded_tokens=counts,
    device_ms=seconds,
    oom_splits=counts,
    reclaimed=counts,
    dead_lettered=counts,
    padding_efficiency=st.floats(min_value=0, max_value=1),
    tenants=st.none() | st.dictionaries(words, st.lists(counts.map(float), min_size=3,
                                                        max_size=3), max_size=5),
)


@pytest.mark.unit
@PROPERTY
@given(heartbeats)
def test_a_heartbeat_reads_back_as_written(beat: Heartbeat) -> None:
    assert decode_heartbeat(encode_heartbeat(beat)) == beat


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10,
)
beat_names = st.sampled_from(["at", "started_at", "host", "pid", "requests_ok", "tokens",
                              "device_ms", "model", "other"])


@pytest.mark.unit
@PROPERTY
@given(st.binary(max_size=64) | st.dictionaries(beat_names, msgpack_values).map(msgpack.packb))
def test_any_heartbeat_row_decodes_or_raises_decode_error(raw: bytes) -> None:
    try:
        beat = decode_heartbeat(raw)
    except DecodeError:
        return
    assert isinstance(beat, Heartbeat)


@pytest.mark.unit
def test_a_row_from_an_older_worker_reads_with_defaults() -> None:
    beat = decode_heartbeat(msgpack.packb({"requests_ok": 5, "at": 10.0, "future": [1]}))
    assert beat == Heartbeat(requests_ok=5, at=10.0) and beat.requests == 5
    with pytest.raises(DecodeError, match="'at'"):
        decode_heartbeat(msgpack.packb({"at": "yesterday"}))


# ------------------------------------------------------------------ dead letter

deaths = st.builds(
    Death,
    code=st.sampled_from(["dead_letter", "bad_request"]),
    message=st.text(max_size=60),
    worker=words,
    deliveries=st.integers(min_value=1, max_value=1000),
    at_ms=st.integers(min_value=0, max_value=1 << 45),
    source_id=st.integers(min_value=0, max_value=1 << 45).map(lambda ms: f"{ms}-0"),
    tenant=st.sampled_from([keys.DEFAULT_TENANT, "acme", "A-z_0.9"]),
)
request_fields = st.dictionaries(
    st.text(min_size=1, max_size=12).filter(lambda n: not n.startswith("dead_")),
    st.text(max_size=200),
    max_size=12,
)


@pytest.mark.unit
@PROPERTY
@given(request_fields, deaths)
def test_a_letter_within_its_cap_reads_back_as_the_request_and_its_death(
    fields: dict[str, str], death: Death
) -> None:
    letter = parse_letter(death.source_id, dict(encode_letter(fields, death, max_bytes=1 << 20)))
    assert letter.request == fields and letter.truncated is None
    assert (letter.error_code, letter.error, letter.worker, letter.deliveries, letter.at_ms,
            letter.source_id, letter.tenant) == (death.code, death.message, death.worker,
                                                 death.deliveries, death.at_ms, death.source_id,
                                                 death.tenant)
    named = () if death.tenant == keys.DEFAULT_TENANT else (dead_letter.TENANT,)
    assert set(letter.dead) == {*dead_letter.DEATH_FIELDS, *named}


@pytest.mark.unit
@PROPERTY
@given(request_fields, deaths, st.integers(min_value=0, max_value=300))
def test_a_capped_letter_names_what_it_cut(
    fields: dict[str, str], death: Death, max_bytes: int
) -> None:
    letter = parse_letter("1-0", dict(encode_letter(fields, death, max_bytes=max_bytes)))
    assert size(letter.request) <= max_bytes
    assert (letter.truncated is None) == (size(fields) <= max_bytes)
    for name, value in letter.request.items():  # each kept value is the request's, or its start
        original = fields[name].encode()
        assert original.startswith(value.encode() if isinstance(value, str) else value)


def size(fields: dict[str, str] | dict[str, str | bytes]) -> int:
    return sum(len(k.encode()) + len(v.encode() if isinstance(v, str) else v)
               for k, v in fields.items())


@pytest.mark.unit
def test_the_dead_prefix_rule() -> None:
    assert is_dead_field("dead_error") and is_dead_field(b"dead_truncated")
    assert not is_dead_field("text") and not is_dead_field(b"deadline_ms")
    letter = parse_letter(b"1-0", {b"id": b"x", b"dead_error_code": b"bad_request",
                                   b"opts": b"\xff", b"dead_new_field": b"kept"})
    assert letter.request == {"id": "x", "opts": b"\xff"}
    assert letter.dead == {"dead_error_code": "bad_request", "dead_new_field": "kept"}


# The Lua side of the same rule, run on a real Redis: the fragments publish.lua
# copies, then one call of each function.
LUA_LETTER = lua_scripts.assemble("""
-- tokenq:include dead_fields.lua
-- tokenq:end dead_fields.lua
-- tokenq:include dead_letter.lua
-- tokenq:end dead_letter.lua
local record, fields = {}, {}
for i = 9, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
copy_capped(fields, tonumber(ARGV[1]), record)
append_death(record, ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7],
             ARGV[8])
return record
""")
ascii_names = st.text(alphabet=string.ascii_letters + string.digits + "_", min_size=1,
                      max_size=80).map(str.encode)
lua_entries = st.dictionaries(ascii_names | st.just(b"dead_old"), st.binary(max_size=300),
                              max_size=40)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entry=lua_entries, death=deaths, max_bytes=st.integers(min_value=0, max_value=2000))
def test_publish_lua_writes_the_letter_python_writes(
    r: redis.Redis, entry: dict[bytes, bytes], death: Death, max_bytes: int
) -> None:
    flat = [part for pair in entry.items() for part in pair]
    args = [max_bytes, death.code, death.message, death.worker, death.deliveries,
            death.at_ms, death.source_id,
            keys.tenant_requests(keys.QueueRef("q", shard=2), death.tenant), *flat]
    from_lua = r.eval(LUA_LETTER, 0, *args)
    python = encode_letter(entry, death, max_bytes=max_bytes)
    as_bytes = [part if isinstance(part, bytes) else part.encode()
                for pair in python for part in pair]
    assert from_lua == as_bytes
