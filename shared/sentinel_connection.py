"""Sentinel-managed connections that ask the sentinels where the master is on every reconnect,
also one made inside a command's retry (redis-py reconnects those to the old address).
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
