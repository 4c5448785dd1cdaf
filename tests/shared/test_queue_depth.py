"""queue_depth.lua on a real redis-server: a lane's length over its own stream and each tenant's
its tenants set lists; a tenant stream Redis refuses to read is an error, not a stream left out
of the sum (only a listed key that is no stream is left alone)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from tokenq.shared import functions, keys


@pytest.fixture
def lane(r: redis.Redis, queue_name: str) -> Iterator[keys.QueueRef]:
    """A queue with one entry on its own stream and one on tenant ``acme``'s, both listed."""
    q = keys.QueueRef(queue_name)
    tenant = keys.tenant_requests(q, "acme")
    r.xadd(keys.requests(q), {"v": "1"})
    r.xadd(tenant, {"v": "1"})
    r.sadd(keys.tenants(q), tenant)
    yield q


def depth(client: redis.Redis, q: keys.QueueRef, *args: str) -> list[int]:
    return functions.Function(client, "queue_depth")(keys=[keys.requests(q)], args=list(args))


def test_a_lane_counts_its_tenants_streams_and_leaves_a_key_that_is_no_stream_alone(
    r: redis.Redis, lane: keys.QueueRef
) -> None:
    assert depth(r, lane, "length") == [2]
    junk = keys.tenant_requests(lane, "junk")
    r.set(junk, "not a stream")
    r.sadd(keys.tenants(lane), junk)
    assert depth(r, lane, "length") == [2]
    assert depth(r, lane, "depth", keys.GROUP) == [2, 0, 2, 1]


def test_a_tenant_stream_the_user_may_not_read_is_an_error_not_left_out(
    r: redis.Redis, redis_url: str, lane: keys.QueueRef
) -> None:
    assert depth(r, lane, "length") == [2]  # the library is loaded, by a user who may
    user = f"depth-{uuid.uuid4().hex[:8]}"
    r.acl_setuser(user, enabled=True, nopass=True, commands=["+fcall", "+xlen", "+smembers"],
                  keys=[keys.requests(lane), keys.tenants(lane)])  # no tenant stream
    try:
        with (redis.Redis.from_url(redis_url, username=user, password="") as limited,
              pytest.raises(redis.ResponseError, match=r"(?i)perm|access")):
            depth(limited, lane, "length")
    finally:
        r.acl_deluser(user)
