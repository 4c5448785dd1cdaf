"""What must run on one node's connection in a Redis Cluster: the durable enqueue.

``WAIT`` counts the replicas that have the writes *of its own connection*,
so it must follow the enqueue script on the connection that ran it. A
cluster client routes each command of a pipeline by its keys, and ``WAIT``
has none; so the durable enqueue goes through a plain client of the node
that owns the shard's slot, made from the cluster's own connection settings
(timeouts, retries, the caller-deadline hooks). When that node answers
``MOVED`` (a failover moved the slot), the cluster re-reads its topology and
the enqueue is tried once more on the new owner; a second ``MOVED`` is
reported as Redis being unreachable, which the call's retries handle.

For a client that is not a cluster client these return it unchanged.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio


def node_for(client: Any, key: str) -> Any:
    """The sync client that talks to the node owning ``key`` (``client`` unless a cluster)."""
    if not isinstance(client, redis.RedisCluster):
        return client
    return client.get_redis_connection(client.get_node_from_key(key))


def moved(client: Any, *, last: bool) -> None:
    """A slot moved under a pinned command: re-read the topology, or give up as unreachable."""
    client.nodes_manager.initialize()
    if last:
        raise redis.ConnectionError("the shard's slot moved twice during a durable enqueue")


async def async_node_for(client: Any, key: str, made: dict[str, Any]) -> Any:
    """The asyncio client of the node owning ``key``, made once per node into ``made``."""
    if not isinstance(client, redis.asyncio.RedisCluster):
        return client
    if not client.get_nodes():
        await client.initialize()
    node = client.get_node_from_key(key)
    plain = made.get(node.name)
    if plain is None:
        pool = redis.asyncio.ConnectionPool(
            connection_class=node.connection_class, **node.connection_kwargs
        )
        plain = made[node.name] = redis.asyncio.Redis(connection_pool=pool)
    return plain


async def async_moved(client: Any, *, last: bool) -> None:
    """The asyncio twin of :func:`moved`."""
    await client.nodes_manager.initialize()
    if last:
        raise redis.ConnectionError("the shard's slot moved twice during a durable enqueue")
