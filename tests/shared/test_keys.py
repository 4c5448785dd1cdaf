"""Key names: one hash tag per queue (or shard), so a MULTI or Lua script may touch them all.

The slot check below is Redis Cluster's own rule (CRC16 of the part between
the first ``{`` and the next ``}``), so these tests fail if any key of a queue
would land in a different slot than its siblings, which would make the
reply + XACK + XDEL MULTI a CROSSSLOT error on a cluster.
"""

from __future__ import annotations

import fnmatch
import string
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenq.shared import keys
from tokenq.shared.keys import QueueRef

pytestmark = pytest.mark.unit

PROPERTY = settings(max_examples=200, deadline=None)
NAME_ALPHABET = string.ascii_letters + string.digits + "_.-"
names = st.text(alphabet=NAME_ALPHABET, min_size=1, max_size=128)
shards = st.none() | st.integers(min_value=0, max_value=10_000)
# Reply ids and consumer names come from users; braces in them must not matter.
free_text = st.text(min_size=1, max_size=40)


def crc16(data: bytes) -> int:
    """CRC16-CCITT (XMODEM), the checksum Redis Cluster uses for key slots."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def hash_tag(key: str) -> str:
    """The part of a key Redis Cluster hashes (the whole key when there is no tag)."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def slot(key: str) -> int:
    return crc16(hash_tag(key).encode()) % 16384


def all_keys(q: QueueRef, reply_id: str = "r1", consumer: str = "c1") -> list[str]:
    return [
        keys.requests(q),
        keys.dead(q),
        keys.config(q),
        keys.workers(q),
        keys.worker_alive(q, consumer),
        keys.reply(q, reply_id),
    ]


def test_crc16_matches_redis() -> None:
    """The reference value from the Redis Cluster specification."""
    assert crc16(b"123456789") == 0x31C3
    assert slot("user:{1000}:following") == slot("user:{1000}:followers")


def test_default_layout_matches_the_module_docstring() -> None:
    q = QueueRef("q")
    assert all_keys(q, "abc", "host-1") == [
        "tokenq:{q}:requests",
        "tokenq:{q}:dead",
        "tokenq:{q}:config",
        "tokenq:{q}:workers",
        "tokenq:{q}:worker:host-1",
        "tokenq:{q}:reply:abc",
    ]
    assert keys.reply_pattern(q) == "tokenq:{q}:reply:*"
    assert keys.GROUP == "workers"
    for line in ("tokenq:{q}:requests", "tokenq:{q}:reply:<id>", "tokenq:{q}:worker:<name>"):
        assert line in (keys.__doc__ or "")


def test_shards_and_prefixes() -> None:
    assert keys.requests(QueueRef("emb", shard=3)) == "tokenq:{emb:3}:requests"
    assert keys.reply(QueueRef("emb", prefix="app.tq", shard=0), "x") == "app.tq:{emb:0}:reply:x"
    assert QueueRef("emb", shard=3).tag == "tokenq:{emb:3}"


@PROPERTY
@given(names, shards, free_text, free_text)
def test_every_key_of_a_queue_shares_one_hash_tag(
    name: str, shard: int | None, reply_id: str, consumer: str
) -> None:
    q = QueueRef(name, shard=shard)
    expected_tag = name if shard is None else f"{name}:{shard}"
    for key in all_keys(q, reply_id, consumer):
        assert key.startswith(f"tokenq:{{{expected_tag}}}:")
        assert hash_tag(key) == expected_tag
        assert slot(key) == slot(keys.requests(q))
    assert fnmatch.fnmatchcase(keys.reply(q, reply_id), keys.reply_pattern(q))


@PROPERTY
@given(names, st.integers(min_value=0, max_value=100), st.integers(min_value=0, max_value=100))
def test_shards_of_a_queue_never_share_keys(name: str, a: int, b: int) -> None:
    if a == b:
        return
    unsharded, first, second = QueueRef(name), QueueRef(name, shard=a), QueueRef(name, shard=b)
    key_sets = [set(all_keys(q)) for q in (unsharded, first, second)]
    assert not key_sets[0] & key_sets[1] and not key_sets[1] & key_sets[2]
    assert not fnmatch.fnmatchcase(keys.reply(first, "x"), keys.reply_pattern(unsharded))


@pytest.mark.parametrize(
    "name",
    ["", "has space", "a{b", "a}b", "q:1", "x" * 129, "ключ", "tab\t", "new\nline", "*"],
)
def test_invalid_queue_names_are_refused_clearly(name: str) -> None:
    with pytest.raises(ValueError, match=r"queue name .* is invalid: use 1-128 characters"):
        QueueRef(name)


@pytest.mark.parametrize("name", [None, 5, b"q"])
def test_non_string_queue_names_are_refused(name: object) -> None:
    with pytest.raises(ValueError, match="queue name"):
        QueueRef(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefix", ["", "a b", "{x}", "p:q"])
def test_invalid_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="key prefix"):
        QueueRef("q", prefix=prefix)


@pytest.mark.parametrize("shard", [-1, True, "1", 1.0])
def test_invalid_shards_are_refused(shard: object) -> None:
    with pytest.raises(ValueError, match="shard"):
        QueueRef("q", shard=shard)  # type: ignore[arg-type]


@PROPERTY
@given(names)
def test_valid_names_are_accepted(name: str) -> None:
    assert QueueRef(name).name == name


@pytest.mark.parametrize(
    "key_of",
    [keys.requests, keys.dead, keys.config, keys.workers],
)
def test_key_functions_are_pure(key_of: Callable[[QueueRef], str]) -> None:
    """Equal refs give equal keys, so call sites may build refs freely."""
    assert key_of(QueueRef("q")) == key_of(QueueRef("q"))
    assert QueueRef("q") == QueueRef("q") and hash(QueueRef("q")) == hash(QueueRef("q"))
