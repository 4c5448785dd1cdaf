"""Redis commands packed by hiredis in C, or already by the caller (:class:`PackedArgs`); a
connection closed under a command fails as a ``ConnectionError`` (docs/decisions/0023)."""

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
    """One argument as a RESP bulk string, as redis-py sends it (a lone surrogate is ``?``); a
    bool or another type is a ``TypeError``."""
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
    """A command's last ``count`` arguments as RESP bulk strings (for :func:`takes_packed`)."""

    count: int
    data: bytes

    def values(self) -> list[bytes]:
        """The arguments as bytes (for a client that cannot take them packed)."""
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
    """Whether ``client``'s connections take :class:`PackedArgs` (any client tokenq made)."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        connection_class = getattr(pool, "connection_class", None)
    else:  # a cluster client keeps its nodes' class in its connection options
        connection_class = getattr(client, "connection_kwargs", {}).get("connection_class")
    return isinstance(connection_class, type) and issubclass(connection_class, HiredisPacking)


def _joined(chunks: list[bytes], packed: PackedArgs) -> list[bytes]:
    """A packed command's chunks with ``packed`` after them, counted in the header."""
    first = chunks[0]
    end = first.index(b"\r\n")
    count = int(first[1:end]) + packed.count
    return [b"*%d\r\n" % count + first[end + 2:], *chunks[1:], packed.data]


class HiredisPacking:
    """Connection mixin: ``pack_command`` in C, byte for byte redis-py's; what hiredis refuses
    goes to redis-py's packer, for its errors."""

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
    """The sync connection's mixin: ``send_command`` packs through :meth:`pack_command` (redis-py's
    calls its own serializer)."""

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        self.send_packed_command(self.pack_command(*args), kwargs.get("check_health", True))

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        """redis-py's, with a socket closed under it failing as ``ConnectionError``."""
        try:
            super().send_packed_command(command, check_health)  # type: ignore[misc]
        except AttributeError as exc:
            raise _lost(exc) from exc


class AsyncHiredisPacking(HiredisPacking):
    """The asyncio connection's mixin (a concurrent ``disconnect`` leaves redis-py writing to
    ``None``)."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except AttributeError as exc:
            raise _lost(exc) from exc


def _lost(exc: AttributeError) -> redis.exceptions.ConnectionError:
    """The ``ConnectionError`` an ``AttributeError`` on ``None`` (the writer or socket, closed
    under the send) is; raises any other, a bug."""
    if "'NoneType' object" not in str(exc):
        raise exc
    return redis.exceptions.ConnectionError(
        f"the connection was closed while a command was being sent ({exc})")


def packing_mixin(connection_class: type) -> type:
    if issubclass(connection_class, redis.asyncio.connection.AbstractConnection):
        return AsyncHiredisPacking
    return SyncHiredisPacking


def packed(connection_class: type) -> type:
    """``connection_class`` packing in C (the worker's hook into :mod:`.redis_client`)."""
    return with_mixins(connection_class, packing_mixin(connection_class))
