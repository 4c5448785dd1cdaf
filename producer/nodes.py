"""The durable enqueue pinned to one Cluster node: ``WAIT`` counts its own connection's writes
and has no key to route by, so it runs on a plain client of the slot's owner, following a
failover once (:func:`run_pinned`)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
import redis.asyncio

T = TypeVar("T")

_LOST = (redis.ConnectionError, redis.TimeoutError)
_UNREAD = (redis.RedisError, redis.exceptions.RedisClusterException)
"""What re-reading the topology raises when no node answers (the first error stands)."""


def _moved_twice() -> redis.ConnectionError:
    return redis.ConnectionError("the shard's slot moved twice during a durable enqueue")


def run_pinned(client: Any, key: str, operation: Callable[[Any], T]) -> T:
    """``operation`` on the client of the node owning ``key``, following a failover once; on
    a client that is not a cluster's, once on it."""
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
    """The asyncio twin of :func:`run_pinned`; each node's plain client (with the cluster's
    connection settings) is made once into ``made``."""
    if not isinstance(client, redis.asyncio.RedisCluster):
        return await operation(client)
    if not client.get_nodes():
        await client.initialize()
    for attempt in (1, 2):
        node: Any = client.get_node_from_key(key)  # not None: the cluster is initialised
        plain = made.get(node.name)
        if plain is None:
            pool = redis.asyncio.ConnectionPool(
                connection_class=node.connection_class, **node.connection_kwargs)
            plain = made[node.name] = redis.asyncio.Redis(connection_pool=pool)
        try:
            return await operation(plain)
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
