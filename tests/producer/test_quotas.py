"""Tenant quotas (``keys.quotas``, docs/OPERATIONS.md "Quotas"): enqueue refuses the entries
that would take one tenant's pending tokens past its cap, atomically and that tenant only;
``tokenq quotas`` sets, shows and clears them; a hostile value in the hash is a clear error for
that tenant and loses nothing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis

from tokenq.producer import AsyncClient, BadRequest, Client, QueueFull, QuotaExceeded
from tokenq.producer.ops import quotas
from tokenq.shared import keys

TEXT = "one two three four five six seven"
"""Nine tokens as the client estimates them (seven words and two special tokens)."""


def held(r: redis.Redis, q: keys.QueueRef) -> dict[str, int]:
    return keys.tenant_pending(r.hgetall(keys.pending(q)))


def lengths(r: redis.Redis, q: keys.QueueRef) -> tuple[int, ...]:
    return tuple(r.xlen(keys.tenant_requests(q, t)) for t in ("default", "a", "b"))


def run(redis_url: str, queue: str, *args: str) -> int:
    return quotas.main(["--redis-url", redis_url, "--queue", queue, *args])


def test_a_tenant_over_its_quota_is_refused_alone_naming_it_and_its_cap(
    r: redis.Redis, redis_url: str, queue_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    q = keys.QueueRef(queue_name)
    assert run(redis_url, queue_name, "set", "--tenant", "a", "--tokens", "30") == 0
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.submit_many([TEXT, TEXT], tenant="a")  # 18 of 30
        before = (lengths(r, q), held(r, q))
        with pytest.raises(QuotaExceeded) as refused:
            client.submit_many([TEXT, TEXT], tenant="a")  # 36 > 30: neither written
        assert isinstance(refused.value, QueueFull)
        assert refused.value.tenant == "a" and refused.value.quota == 30
        assert "tenant 'a'" in str(refused.value) and "quota of 30" in str(refused.value)
        assert (lengths(r, q), held(r, q)) == before  # nothing written, atomically
        client.submit_many([TEXT], tenant="a")  # 27 of 30 fits
        for _ in range(20):  # b, and requests of no tenant, flow on
            client.submit_many([TEXT, TEXT], tenant="b")
            client.submit_many([TEXT])
        with pytest.raises(QuotaExceeded):
            client.submit_many([TEXT], tenant="a")
    assert held(r, q) == {"default": 180, "a": 27, "b": 360}
    assert lengths(r, q) == (20, 3, 40)
    capsys.readouterr()
    assert run(redis_url, queue_name, "show", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {
        "a": {"quota": "30", "pending_tokens": 27},
        "b": {"quota": None, "pending_tokens": 360},
        "default": {"quota": None, "pending_tokens": 180}}


def test_the_star_caps_every_tenant_not_named_the_default_tenant_too(
    r: redis.Redis, redis_url: str, queue_name: str
) -> None:
    q = keys.QueueRef(queue_name)
    run(redis_url, queue_name, "set", "--tenant", "*", "--tokens", "20")
    run(redis_url, queue_name, "set", "--tenant", "b", "--tokens", "100")
    with Client(redis_url=redis_url, queue=queue_name) as client:
        for tenant in (None, "a"):
            client.submit_many([TEXT, TEXT], tenant=tenant)
            with pytest.raises(QuotaExceeded, match="quota of 20"):
                client.submit_many([TEXT], tenant=tenant)
        client.submit_many([TEXT] * 11, tenant="b")
        assert run(redis_url, queue_name, "clear", "--tenant", "*") == 0
        client.submit_many([TEXT] * 5, tenant="a")
        assert run(redis_url, queue_name, "clear", "--all") == 0
        client.submit_many([TEXT] * 20, tenant="b")
    assert held(r, q) == {"default": 18, "a": 63, "b": 279}
    assert not r.exists(keys.quotas(q))


def test_a_request_larger_than_the_cap_alone_is_a_clear_bad_request(
    r: redis.Redis, redis_url: str, queue_name: str
) -> None:
    run(redis_url, queue_name, "set", "--tenant", "a", "--tokens", "5")
    with Client(redis_url=redis_url, queue=queue_name) as client:
        with pytest.raises(BadRequest, match=r"request of 9 tokens is over the quota of tenant "
                           r"'a'.*can never be queued"):
            client.submit_many(["x", TEXT], tenant="a")
        client.submit_many(["x"], tenant="a")  # 3 tokens fit
    assert held(r, keys.QueueRef(queue_name))["a"] == 3


@pytest.mark.parametrize("value", [b"0", b"-1", b"ten", b"1.5", b"", b"9" * 16, b" 7"])
def test_a_hostile_quota_refuses_that_tenant_clearly_and_loses_nothing(
    r: redis.Redis, redis_url: str, queue_name: str, value: bytes
) -> None:
    """0 pauses the tenant (QuotaExceeded, retry later); anything not 0 to 15 digits refuses
    its enqueue with an error naming the hash and the value; other tenants flow on."""
    q = keys.QueueRef(queue_name)
    r.hset(keys.quotas(q), "a", value)
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.submit_many([TEXT], tenant="b")
        expected: Any = (QuotaExceeded, "quota of 0") if value == b"0" else (
            redis.ResponseError, f"quota for tenant a in {keys.quotas(q)} is .*not a count of "
            "tokens.*tokenq quotas")
        with pytest.raises(expected[0], match=expected[1]):
            client.submit_many([TEXT], tenant="a")
        client.submit_many([TEXT], tenant="b")
    assert lengths(r, q) == (0, 0, 2) and held(r, q) == {"default": 0, "b": 18}


def test_show_bounds_a_hostile_cap_and_field_written_by_hand(
    r: redis.Redis, redis_url: str, queue_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    q = keys.QueueRef(queue_name)
    r.hset(keys.quotas(q), mapping={"a": "9" * 100_000, "x" * 100_000: "5", "e": "\x1b[2J1"})
    for args in ((), ("--json",)):
        assert run(redis_url, queue_name, "show", *args) == 0
        out = capsys.readouterr().out
        assert len(out) < 1000 and "\x1b" not in out and "9" * 37 + "..." in out, out


def test_show_names_a_64_character_tenant_whole_its_quota_beside_its_pending_tokens(
    r: redis.Redis, redis_url: str, queue_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tenant = "t" * 64  # the longest tenant name
    assert run(redis_url, queue_name, "set", "--tenant", tenant, "--tokens", "30") == 0
    with Client(redis_url=redis_url, queue=queue_name) as client:
        client.submit_many([TEXT], tenant=tenant)
    capsys.readouterr()
    assert run(redis_url, queue_name, "show", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {
        tenant: {"quota": "30", "pending_tokens": 9},
        "default": {"quota": None, "pending_tokens": 0}}


def test_the_command_refuses_a_bad_quota_before_it_writes(
    r: redis.Redis, redis_url: str, queue_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for bad in (["set", "--tenant", "a", "--tokens", "-1"], ["set", "--tenant", "a"],
                ["set", "--tenant", "a b", "--tokens", "5"], ["clear"],
                ["set", "--tenant", "a", "--tokens", str(10**15)]):
        assert run(redis_url, queue_name, *bad) == 2, bad
    assert not r.exists(keys.quotas(keys.QueueRef(queue_name)))
    assert "--tokens" in capsys.readouterr().err


def test_a_producer_that_may_not_read_the_quotas_is_not_capped(
    r: redis.Redis, redis_url: str, queue_name: str
) -> None:
    """docs/SECURITY.md: a producer's ACL from before quotas (no ``HMGET`` there) still
    enqueues, uncapped, as one from before the pending tokens writes uncounted entries."""
    q = keys.QueueRef(queue_name)
    r.hset(keys.quotas(q), "a", 0)
    user = f"old-{queue_name}"
    r.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"],
                  commands=["+@all", "-hmget", "-hgetall"])
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw@", 1)
        with Client(redis_url=url, queue=queue_name) as client:
            client.submit_many([TEXT], tenant="a")
    finally:
        r.acl_deluser(user)
    assert held(r, q)["a"] == 9


def test_the_async_client_raises_the_same_quota_exceeded(
    r: redis.Redis, redis_url: str, queue_name: str
) -> None:
    r.hset(keys.quotas(keys.QueueRef(queue_name)), "a", 10)

    async def main() -> None:
        async with AsyncClient(redis_url, queue_name) as client:
            await client.submit_many([TEXT], tenant="a")
            with pytest.raises(QuotaExceeded) as refused:
                await client.submit_many([TEXT], tenant="a")
            assert (refused.value.tenant, refused.value.quota) == ("a", 10)

    asyncio.run(main())


def test_a_quotas_key_that_is_no_hash_fails_the_enqueue_writing_nothing(
    r: redis.Redis, redis_url: str, queue_name: str
) -> None:
    q = keys.QueueRef(queue_name)
    r.set(keys.quotas(q), "not a hash")
    with Client(redis_url=redis_url, queue=queue_name) as client:
        for tenant in (None, "a"):
            with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                client.submit_many([TEXT], tenant=tenant)
    assert lengths(r, q) == (0, 0, 0) and not r.exists(keys.pending(q))
