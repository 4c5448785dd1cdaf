"""Redis commands packed by hiredis's C packer, for the worker's and the producer's connections.

Why: redis-py packs every argument in Python (its asyncio connection
entirely; its sync one passes each argument through a generator before
hiredis), and a batch's script call carries four to fifteen arguments per
request, so packing was the largest single cost per request on both sides
(issue 11 for the worker, issue 25 for the producer). Without hiredis
installed the mixin steps aside and redis-py packs as before. Both mixins
also turn a connection closed under a command into the ``ConnectionError``
it is (:class:`AsyncHiredisPacking` says why): every connection class tokenq
makes passes through :func:`packing_mixin`, so this is its one place.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio.connection
import redis.exceptions

from tokenq.shared.redis_client import with_mixins

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis: the worker extra, tokenq[fast]
    _hiredis_pack = None


class HiredisPacking:
    """Connection mixin: ``pack_command`` in C (hiredis), byte-for-byte redis-py's output.

    What hiredis refuses (a bool, an unknown type) goes to redis-py's own
    packer, so the errors a caller sees are redis-py's.
    """

    def pack_command(self, *args: Any) -> list[bytes]:
        if _hiredis_pack is not None and args:
            first = args[0]
            # A command name with a space ("SCRIPT LOAD") is two arguments, as redis-py splits it.
            if isinstance(first, str):
                args = (*first.encode().split(), *args[1:])
            elif isinstance(first, bytes) and b" " in first:
                args = (*first.split(), *args[1:])
            try:
                return [_hiredis_pack(args)]
            except TypeError:
                pass
        return super().pack_command(*args)  # type: ignore[misc]


class SyncHiredisPacking(HiredisPacking):
    """The sync connection's mixin: its ``send_command`` packs through :meth:`pack_command`.

    Why: redis-py's sync ``send_command`` (every command outside a pipeline,
    the producer's enqueue included) calls its own serializer directly, not
    ``pack_command``, so the mixin alone left the producer's enqueue packed
    by redis-py's per-argument generator (the async connection goes through
    ``pack_command``). The async ``send_command`` is a coroutine, hence a
    class of its own.
    """

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        self.send_packed_command(
            self.pack_command(*args), check_health=kwargs.get("check_health", True)
        )

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        """redis-py's, with a socket closed under it (another thread's ``disconnect``)
        failing as ``ConnectionError``: see :class:`AsyncHiredisPacking`."""
        try:
            super().send_packed_command(command, check_health)  # type: ignore[misc]
        except AttributeError as exc:
            if not _closed_under(exc):
                raise
            raise _lost(exc) from exc


class AsyncHiredisPacking(HiredisPacking):
    """The asyncio connection's mixin: C packing, and a connection closed under a command
    fails it with ``ConnectionError``, as any lost connection does.

    Why: redis-py's asyncio ``send_packed_command`` awaits (connecting, the
    health check) before it writes, and a concurrent ``disconnect`` (a Cluster
    client drops a node's connections on a failover, while the worker's
    readers, publishers and heartbeat use them) leaves it writing to
    ``None``: ``AttributeError``, which no retry and no ``except RedisError``
    takes for a connection failure. One failover test lost a worker to it
    (tests/faults/test_cluster.py). Only an ``AttributeError`` on ``None``
    (the writer or socket gone) is converted: any other is a bug and stays one.
    """

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except AttributeError as exc:
            if not _closed_under(exc):
                raise
            raise _lost(exc) from exc


def _closed_under(exc: AttributeError) -> bool:
    """Whether an ``AttributeError`` from redis-py's send means the connection closed under
    it (an attribute of ``None``: its writer or socket); anything else is a bug."""
    return "'NoneType' object" in str(exc)


def _lost(exc: AttributeError) -> redis.exceptions.ConnectionError:
    return redis.exceptions.ConnectionError(
        f"the connection was closed while a command was being sent ({exc})"
    )


def packing_mixin(connection_class: type) -> type:
    """The packing mixin for ``connection_class``: sync or asyncio."""
    if issubclass(connection_class, redis.asyncio.connection.AbstractConnection):
        return AsyncHiredisPacking
    return SyncHiredisPacking


def packed(connection_class: type) -> type:
    """``connection_class`` packing in C: the worker's hook into
    :mod:`tokenq.shared.redis_client`, made once per class."""
    return with_mixins(connection_class, packing_mixin(connection_class))
