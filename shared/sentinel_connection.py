"""Sentinel-managed connections that ask the sentinels where the master is on every reconnect.

redis-py's managed connection looks the master up in ``connect()``, which a
pool calls for a fresh connection. But a connection that drops in the middle
of a command (its master died) is reconnected by that command's own retry,
through ``send_packed_command`` → ``connect_check_health``: the plain
connection's method, which connects to the address the connection already
had, and retries *that* under the whole retry policy (redis-py issue #3874,
open as of redis-py 8.1). After a failover that address is the dead master:
a worker's read spent its ten retries, ~13 s, on it while the promoted
replica served everyone else, and every caller waited
(``tests/faults/test_cluster_connections.py::test_a_command_begun_during_a_sentinel_failover_…``).

Here every way into a connection goes through the lookup: a reconnect made
inside a command is one lookup and one connect attempt, and the command's
own retry (which wraps every send) does the retrying, each attempt asking
the sentinels afresh (retrying inside it as well would nest one retry
policy in another). :func:`managed_connection` gives the class for each of
tokenq's Sentinel pools (:mod:`tokenq.shared.redis_client`), sync or asyncio,
plain or TLS.
"""

from __future__ import annotations

import functools
from typing import Any

import redis.asyncio.sentinel
import redis.sentinel


class FollowsMaster:
    """Mixin in front of redis-py's sync ``SentinelManagedConnection`` (or its TLS twin)."""

    connection_pool: Any
    host: str
    port: int

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if getattr(self, "_sock", None) is None:
            self._connect_retry()  # type: ignore[attr-defined]  # the lookup, then connect_to

    def connect_to(self, address: tuple[str, int]) -> None:
        self.host, self.port = address
        super(redis.sentinel.SentinelManagedConnection, self).connect_check_health(  # type: ignore[misc]
            check_health=self.connection_pool.check_connection, retry_socket_connect=False
        )


class AsyncFollowsMaster:
    """The asyncio twin of :class:`FollowsMaster`."""

    connection_pool: Any
    host: str
    port: int

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not self.is_connected:  # type: ignore[attr-defined]
            await self._connect_retry()  # type: ignore[attr-defined]

    async def connect_to(self, address: tuple[str, int]) -> None:
        self.host, self.port = address
        await super(  # type: ignore[misc]
            redis.asyncio.sentinel.SentinelManagedConnection, self
        ).connect_check_health(
            check_health=self.connection_pool.check_connection, retry_socket_connect=False
        )


@functools.cache
def managed_connection(*, tls: bool, asyncio: bool) -> type:
    """The Sentinel-managed connection class that follows the master, made once per kind."""
    if asyncio:
        base: type = (redis.asyncio.sentinel.SentinelManagedSSLConnection if tls
                      else redis.asyncio.sentinel.SentinelManagedConnection)
        mixin: type = AsyncFollowsMaster
    else:
        base = (redis.sentinel.SentinelManagedSSLConnection if tls
                else redis.sentinel.SentinelManagedConnection)
        mixin = FollowsMaster
    return type(f"Following{base.__name__}", (mixin, base), {})
