"""What must run on one node's connection in a Redis Cluster: the durable enqueue.

``WAIT`` counts the replicas that have the writes *of its own connection*,
so it must follow the enqueue script on the connection that ran it. A
cluster client routes each command of a pipeline by its keys, and ``WAIT``
has none; so the durable enqueue goes through a plain client of the node
that owns the shard's slot, made from the cluster's own connection settings
(timeouts, retries, the caller-deadline hooks).

A plain client bypasses the cluster client's routing, and with it the
cluster client's own reaction to a failover (it re-reads the topology when
one of *its* commands fails), so :func:`run_pinned` reacts for it:

* ``MOVED`` (the slot has a new owner): the topology is re-read and the
  enqueue tried once more on the new owner; a second ``MOVED`` is reported
  as Redis being unreachable, which the call's retries handle;
* a connection that fails or times out (the owner died, or is frozen): the
  topology is re-read too, and the enqueue tried once more if the slot has
  a new owner by then; otherwise the error goes to the caller's retries,
  whose next try starts from the fresh topology. Without this a producer
  kept the dead node as the slot's owner for good and every durable
  enqueue to that shard failed after the failover
  (``tests/faults/test_cluster.py::test_a_cluster_master_killed_under_load_…``).

For a client that is not a cluster client the operation runs once, on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
import redis.asyncio

T = TypeVar("T")

_LOST = (redis.ConnectionError, redis.TimeoutError)
"""What a command on a dead or frozen node raises."""

_UNREAD = (redis.RedisError, redis.exceptions.RedisClusterException)
"""What re-reading the topology raises when no node answers (the first error then stands)."""


def _moved_twice() -> redis.ConnectionError:
    return redis.ConnectionError("the shard's slot moved twice during a durable enqueue")


def run_pinned(client: Any, key: str, operation: Callable[[Any], T]) -> T:
    """``operation`` on the client of the node owning ``key``, following a failover once."""
    resolve = getattr(client, "resolve", None)  # a LazyCluster: the RedisCluster it stands for
    if resolve is not None:
        client = resolve()
    if not isinstance(client, redis.RedisCluster):
        return operation(client)
    for attempt in (1, 2):
        node = client.get_node_from_key(key)
        try:
            return operation(client.get_redis_connection(node))
        except redis.exceptions.MovedError:
            client.nodes_manager.initialize()
            if attempt == 2:
                raise _moved_twice() from None
        except _LOST:
            with contextlib.suppress(*_UNREAD):
                client.nodes_manager.initialize()
            if attempt == 2 or client.get_node_from_key(key).name == node.name:
                raise
    raise AssertionError("unreachable")


async def async_run_pinned(
    client: Any, key: str, operation: Callable[[Any], Awaitable[T]], made: dict[str, Any]
) -> T:
    """The asyncio twin of :func:`run_pinned`; plain node clients are made once into ``made``."""
    if not isinstance(client, redis.asyncio.RedisCluster):
        return await operation(client)
    if not client.get_nodes():
        await client.initialize()
    for attempt in (1, 2):
        node = client.get_node_from_key(key)
        try:
            return await operation(_async_node_client(node, made))
        except redis.exceptions.MovedError:
            await client.nodes_manager.initialize()
            if attempt == 2:
                raise _moved_twice() from None
        except _LOST:
            with contextlib.suppress(*_UNREAD):
                await client.nodes_manager.initialize()
            # redis-py's asyncio types allow None (an uninitialised cluster; this one is)
            moved = client.get_node_from_key(key).name != node.name  # type: ignore[union-attr]
            if attempt == 2 or not moved:
                raise
    raise AssertionError("unreachable")


def _async_node_client(node: Any, made: dict[str, Any]) -> Any:
    """A plain asyncio client of one cluster node, with the cluster's connection settings."""
    plain = made.get(node.name)
    if plain is None:
        pool = redis.asyncio.ConnectionPool(
            connection_class=node.connection_class, **node.connection_kwargs
        )
        plain = made[node.name] = redis.asyncio.Redis(connection_pool=pool)
    return plain
