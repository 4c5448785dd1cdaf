"""Calling tokenq's Lua: ``FCALL`` of its library (loaded and called again when not found), or
``EVALSHA`` for good where Redis or the user has no ``FCALL`` (docs/decisions/0058)."""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from collections.abc import Awaitable, Callable, Sequence
from types import SimpleNamespace
from typing import Any, TypeVar

import redis
import redis.asyncio
import redis.asyncio.client
import redis.client
import redis.cluster

from tokenq.shared import lua_scripts, redis_refusal

T = TypeVar("T")
ENQUEUE_FUNCTION_FIELD = "enqueue_function"
"""The config hash field in which workers name the enqueue function (docs/PROTOCOL.md)."""
_NOT_FOUND = "Function not found"
_NO_FCALL = re.compile(r"unknown command [`']fcall|no permissions to run the 'fcall(_ro)?' command",
                       re.IGNORECASE)
"""Redis has no Functions (< 7: ``unknown command `fcall```), or this user may not FCALL."""
_NO_FUNCTION_CMD = re.compile(r"unknown command [`']function", re.IGNORECASE)


class FunctionsMissing(redis.exceptions.ResponseError):
    """tokenq's library is not on this Redis and this user may not load it."""


def _missing(cause: BaseException) -> FunctionsMissing:
    name = lua_scripts.library().name
    return FunctionsMissing(
        f"tokenq's Redis functions (library {name}) are not loaded and this user may not "
        f"load them ({cause}): start a tokenq worker of this version, or run "
        "`tokenq functions load --redis-url <an admin's URL>`"
    )


_MODES: weakref.WeakKeyDictionary[Any, SimpleNamespace] = weakref.WeakKeyDictionary()
"""Per Redis client, for all its functions: ``scripts``, whether it must use scripts instead."""


def _is_pipeline(client: Any) -> bool:
    return isinstance(client, (redis.client.Pipeline, redis.cluster.ClusterPipeline,
                               redis.asyncio.client.Pipeline))


class _Base:
    """What both twins share: the names, the mode, and what an error means."""

    def __init__(self, client: Any, short: str) -> None:
        lib = lua_scripts.library()
        self.name = lib.functions[short]
        self._command = lua_scripts.SCRIPTS[short].command
        self._reads_only = "no-writes" in lua_scripts.SCRIPTS[short].flags
        self._scripted = False  # a read run as a script: Redis refused to load the library
        self._source = lib.scripts[short]
        self._client = client
        self._mode = _MODES.setdefault(client, SimpleNamespace(scripts=False))
        self._script: Any = None

    @property
    def _by_script(self) -> bool:
        return self._mode.scripts or self._scripted

    def _issue(self, target: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The call on ``target``: ``FCALL``, or the script once this client (or this read, where
        Redis refused writes and the library) has fallen back."""
        if not self._by_script:
            return getattr(target, self._command)(self.name, len(keys), *keys, *args)
        if self._script is None:
            self._script = self._client.register_script(self._source)
        return self._script(keys=keys, args=args, client=target)

    def _must_load(self, exc: redis.exceptions.ResponseError, loaded: bool) -> bool:
        """After ``exc``, whether to load the library before the next try (False: switched to
        EVALSHA); raises ``exc`` when it is neither."""
        text = str(exc)
        if not self._mode.scripts and _NO_FCALL.search(text):
            self._mode.scripts = True
            return False
        if _NOT_FOUND in text and not loaded:
            return True
        raise exc

    def _load_refused(self, exc: redis.exceptions.ResponseError) -> None:
        """After ``FUNCTION LOAD`` failed with ``exc``: a read-only function runs as a script
        from now on when Redis refuses writes, ``FUNCTION LOAD`` too (``SCRIPT LOAD`` is no
        write); raises ``exc`` otherwise."""
        if not (self._reads_only and redis_refusal.error_code(exc) in redis_refusal.WRITES_REFUSED):
            raise exc
        self._scripted = True


class Function(_Base):
    """One of tokenq's functions on a sync redis-py client (plain, Cluster or Sentinel)."""

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = (),
                 client: Any = None) -> Any:
        target = self._client if client is None else client
        if _is_pipeline(target):  # queued: the pipeline's caller wraps execute in guarded()
            return self._issue(target, keys, args)
        return self.guarded(target, lambda: self._issue(target, keys, args))

    def guarded(self, target: Any, operation: Callable[[], T]) -> T:
        """``operation`` (this function on ``target``), run again after loading the library or
        falling back to scripts when that is what it lacked."""
        loaded = False
        while True:
            try:
                return operation()
            except redis.exceptions.ResponseError as exc:
                if self._must_load(exc, loaded):
                    try:
                        load(target, missing_ok=False)
                    except redis.exceptions.ResponseError as refused:
                        self._load_refused(refused)
                    loaded = True


class AsyncFunction(_Base):
    """The asyncio twin of :class:`Function`."""

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = (),
                       client: Any = None) -> Any:
        target = self._client if client is None else client
        if _is_pipeline(target):
            return await self._send(target, keys, args)
        return await self.guarded(target, lambda: self._send(target, keys, args))

    async def _send(self, target: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        call = self._issue(target, keys, args)  # a script's call is awaited, a queued FCALL not
        return call if _is_pipeline(target) and not self._by_script else await call

    async def guarded(self, target: Any, operation: Callable[[], Awaitable[T]]) -> T:
        """The asyncio twin of :meth:`Function.guarded`."""
        loaded = False
        while True:
            try:
                return await operation()
            except redis.exceptions.ResponseError as exc:
                if self._must_load(exc, loaded):
                    try:
                        await async_load(target, missing_ok=False)
                    except redis.exceptions.ResponseError as refused:
                        self._load_refused(refused)
                    loaded = True


def _load_failed(exc: redis.exceptions.ResponseError, missing_ok: bool) -> None:
    """None when Redis has no Functions and ``missing_ok``, else what the refusal means."""
    if _NO_FUNCTION_CMD.search(str(exc)) and missing_ok:
        return
    if isinstance(exc, redis.exceptions.NoPermissionError) and not missing_ok:
        raise _missing(exc) from exc
    raise exc


def load(client: Any, *, missing_ok: bool = True) -> str | None:
    """``FUNCTION LOAD REPLACE`` tokenq's library (every primary of a Cluster): its name, None
    when Redis has no Functions and ``missing_ok``."""
    try:
        client.function_load(lua_scripts.library().code, replace=True)
    except redis.exceptions.ResponseError as exc:
        _load_failed(exc, missing_ok)
        return None
    return lua_scripts.library().name


async def async_load(client: Any, *, missing_ok: bool = True) -> str | None:
    """The asyncio twin of :func:`load`."""
    try:
        await client.function_load(lua_scripts.library().code, replace=True)
    except redis.exceptions.ResponseError as exc:
        _load_failed(exc, missing_ok)
        return None
    return lua_scripts.library().name


def route_by_keys(client: T) -> T:
    """``client`` (a ``RedisCluster``, either twin) routing ``FCALL`` by its keys, not by
    ``COMMAND GETKEYS`` (a round trip, and a right no tokenq ACL grants)."""
    parser = client.commands_parser  # type: ignore[attr-defined]
    parser.__class__ = _keys_parser(type(parser))  # type: ignore[arg-type]  # a class is hashable
    return client


@functools.cache
def _keys_parser(base: type) -> type:
    """``base`` (redis-py's sync or asyncio command parser) finding an FCALL's keys itself."""
    inherited = base._get_moveable_keys  # type: ignore[attr-defined]
    if inspect.iscoroutinefunction(inherited):
        async def moveable(self: Any, *args: Any) -> Any:
            keys = call_keys(args)
            return keys if keys is not None else await inherited(self, *args)
    else:
        def moveable(self: Any, redis_conn: Any, *args: Any) -> Any:  # type: ignore[misc]
            keys = call_keys(args)
            return keys if keys is not None else inherited(self, redis_conn, *args)
    return type(f"FcallKeys{base.__name__}", (base,), {"_get_moveable_keys": moveable})


def call_keys(args: Sequence[Any]) -> list[Any] | None:
    """The keys of an ``FCALL``/``FCALL_RO`` command line, or None when it is not one."""
    if len(args) < 3:
        return None
    first = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
    if first.upper() not in ("FCALL", "FCALL_RO"):
        return None
    try:
        count = int(args[2])
    except (TypeError, ValueError):
        return None
    return list(args[3:3 + count]) if count > 0 else None
