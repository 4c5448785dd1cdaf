"""Redis commands packed by hiredis's C packer, for the worker's and the producer's connections.

Why: redis-py packs every argument in Python (its asyncio connection
entirely; its sync one passes each argument through a generator before
hiredis), and a batch's script call carries four to fifteen arguments per
request, so packing is the largest single cost per request on both sides.
Without hiredis installed the mixin steps aside and redis-py packs itself. Both mixins
also turn a connection closed under a command into the ``ConnectionError``
it is (:class:`AsyncHiredisPacking` says why): every connection class tokenq
makes passes through :func:`packing_mixin`, so this is its one place.

Arguments can also arrive already packed (:class:`PackedArgs`): a caller
that sends thousands of arguments of a known shape (the worker's publish
call, four per answer) writes them as RESP itself, one format operation per
answer, instead of a list the packer walks one argument at a time. This
module is the one home of that byte format too (:func:`bulk_format`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio.connection
import redis.exceptions

from tokenq.shared.redis_client import with_mixins

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis: the worker extra, tokenq[fast]
    _hiredis_pack = None  # type: ignore[assignment]  # None: hiredis is not installed


def bulk_format(count: int) -> bytes:
    """A %-format for ``count`` RESP bulk strings, each given as (length, bytes)."""
    return b"$%d\r\n%b\r\n" * count


def bulk(value: bytes | str | int) -> bytes:
    """One argument as a RESP bulk string, as redis-py's encoder would send it.

    A str is UTF-8 (a lone surrogate becomes ``?``: this never raises for
    text, where redis-py would); an int its decimal digits. A bool or any
    other type is refused with ``TypeError``, as redis-py refuses it.
    """
    if isinstance(value, str):
        value = value.encode("utf-8", "replace")
    elif isinstance(value, int) and not isinstance(value, bool):
        value = b"%d" % value
    elif not isinstance(value, bytes):
        raise TypeError(f"cannot send a {type(value).__name__} to Redis: {value!r:.80}")
    return _ONE_BULK % (len(value), value)


_ONE_BULK = bulk_format(1)


@dataclass(frozen=True, slots=True)
class PackedArgs:
    """The last arguments of a command, already RESP bulk strings: ``count`` of them.

    Only a connection with the packing mixin takes it (:func:`takes_packed`);
    :meth:`values` gives them back, one by one, for any other.
    """

    count: int
    data: bytes

    def values(self) -> list[bytes]:
        """The arguments as bytes, in order (for a client that cannot take them packed)."""
        out: list[bytes] = []
        data, at = self.data, 0
        for _ in range(self.count):
            end = data.index(b"\r\n", at)
            if data[at:at + 1] != b"$":
                raise ValueError(f"not a RESP bulk string at byte {at}")
            start = end + 2
            stop = start + int(data[at + 1:end])
            out.append(data[start:stop])
            at = stop + 2
        if at != len(data):
            raise ValueError(f"{len(data) - at} bytes after {self.count} arguments")
        return out


def takes_packed(client: Any) -> bool:
    """Whether ``client``'s connections take :class:`PackedArgs` (a client tokenq made:
    plain, Sentinel or Cluster, sync or asyncio)."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        connection_class = getattr(pool, "connection_class", None)
    else:  # a cluster client keeps its nodes' class in its connection options
        connection_class = getattr(client, "connection_kwargs", {}).get("connection_class")
    return isinstance(connection_class, type) and issubclass(connection_class, HiredisPacking)


def _joined(chunks: list[bytes], packed: PackedArgs) -> list[bytes]:
    """A packed command's chunks with ``packed`` after them, its count added to the header."""
    first = chunks[0]
    end = first.index(b"\r\n")
    count = int(first[1:end]) + packed.count
    return [b"*%d\r\n" % count + first[end + 2:], *chunks[1:], packed.data]


class HiredisPacking:
    """Connection mixin: ``pack_command`` in C (hiredis), byte-for-byte redis-py's output.

    What hiredis refuses (a bool, an unknown type) goes to redis-py's own
    packer, so the errors a caller sees are redis-py's. A :class:`PackedArgs`
    last argument is sent as it is, after the others.
    """

    def pack_command(self, *args: Any) -> list[bytes]:
        if args and isinstance(args[-1], PackedArgs):
            return _joined(self._pack(args[:-1]), args[-1])
        return self._pack(args)

    def _pack(self, args: tuple[Any, ...]) -> list[bytes]:
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
