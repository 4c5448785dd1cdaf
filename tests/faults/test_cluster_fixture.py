"""The multi-node fixtures themselves: a cluster and a sentinel group that form
as promised and fail over as real ones do, so tests built on them can trust
what a failover shows them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from redis.sentinel import Sentinel

from tests.redis_cluster import (  # noqa: F401 - the fixtures are used by name
    SLOTS,
    LocalCluster,
    LocalSentinel,
    redis_cluster,
    redis_sentinel,
    start_cluster,
)

QUEUE_TAGS = ("{q:0}", "{q:1}", "{q:2}")


def _write_replicated(port: int, key: str, value: str) -> None:
    """SET on the master and WAIT until a replica has it: WAIT counts only this
    connection's writes, hence a plain client on the master's own port."""
    with redis.Redis(host="127.0.0.1", port=port, socket_timeout=5) as client:
        client.set(key, value)
        assert client.wait(1, 5000) == 1, "no replica acknowledged the write"


def test_cluster_shape(redis_cluster: LocalCluster) -> None:  # noqa: F811
    masters = redis_cluster.masters()
    assert len(masters) == 3
    assert masters == redis_cluster.initial_masters
    assert all(len(redis_cluster.replicas_of(m)) == 1 for m in masters)
    assert redis_cluster.url == "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in masters)
    assert len(redis_cluster.startup_nodes) == 6

    with redis_cluster.client(decode_responses=True) as client:
        assert int(client.cluster_info()["cluster_slots_ok"]) == SLOTS
        client.set("plain-key", "hello")
        assert client.get("plain-key") == "hello"
        homes = {tag: redis_cluster.master_for_key(f"{tag}:jobs") for tag in QUEUE_TAGS}
        for tag, port in homes.items():
            assert port in masters
            assert client.get_node_from_key(f"{tag}:jobs").port == port  # redis-py agrees
    print("hash tag -> master port:", homes)


@pytest.mark.fault
def test_cluster_failover_promotes_replica(redis_cluster: LocalCluster) -> None:  # noqa: F811
    key = "{q:0}:probe"
    master = redis_cluster.master_for_key(key)
    [replica] = redis_cluster.replicas_of(master)
    _write_replicated(master, key, "survives")

    started = time.monotonic()
    redis_cluster.kill(master)
    promoted = redis_cluster.wait_promoted(master, timeout_s=10)
    print(f"promoted {promoted} in {time.monotonic() - started:.1f} s")
    assert promoted == replica
    assert redis_cluster.master_for_key(key) == promoted
    with redis_cluster.client(decode_responses=True) as client:
        assert client.get(key) == "survives"

    redis_cluster.restart(master)
    redis_cluster.wait_ok()
    assert redis_cluster.replicas_of(promoted) == [master]  # the old master came back as replica
    assert len(redis_cluster.masters()) == 3


def test_cluster_by_hand_when_redis_cli_cannot(tmp_path: Path) -> None:
    """One master is below redis-cli's minimum of 3, so this forms it with
    MEET/ADDSLOTSRANGE/REPLICATE: the path taken where there is no redis-cli."""
    with start_cluster(tmp_path, masters=1, replicas_per_master=1) as cluster:
        [master] = cluster.masters()
        assert len(cluster.replicas_of(master)) == 1
        with cluster.client() as client:
            client.set("k", "v")
            assert client.get("k") == b"v"


@pytest.mark.fault
def test_sentinel_failover_keeps_acknowledged_write(redis_sentinel: LocalSentinel) -> None:  # noqa: F811
    ports = redis_sentinel.sentinel_ports
    assert redis_sentinel.url == (
        "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/tokenq")
    master = redis_sentinel.current_master()
    assert master == redis_sentinel.master_port
    _write_replicated(master, "probe", "survives")

    old = redis_sentinel.kill_master()
    promoted = redis_sentinel.wait_promoted(old, timeout_s=30)
    assert promoted in redis_sentinel.replica_ports
    sentinel = Sentinel([("127.0.0.1", p) for p in ports], socket_timeout=2)
    client = sentinel.master_for("tokenq", socket_timeout=2, decode_responses=True)
    try:
        assert client.get("probe") == "survives"
    finally:
        client.close()

    redis_sentinel.restart(old)
    with redis.Redis(port=old, decode_responses=True) as back:
        role = back.execute_command("ROLE")
    assert role[0] == "slave" and int(role[2]) == promoted
