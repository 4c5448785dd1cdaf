"""The worker's connection packs commands in C (hiredis) exactly as redis-py would in Python."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from tokenq.worker.redis_connect import HiredisPacking, connect
from tokenq.worker.settings import WorkerSettings

pytest.importorskip("hiredis")

arguments = st.one_of(
    st.binary(max_size=64), st.text(max_size=32), st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
)


class Packed(HiredisPacking, Connection):
    pass


@pytest.mark.unit
@given(st.sampled_from(["EVALSHA", "XREADGROUP", "SCRIPT LOAD", b"XACK", b"CLIENT SETNAME"]),
       st.lists(arguments, max_size=12))
def test_hiredis_packing_is_byte_for_byte_redis_pys(command: str | bytes, args: list) -> None:
    expected = b"".join(Connection().pack_command(command, *args))
    assert b"".join(Packed().pack_command(command, *args)) == expected


packable = st.one_of(st.binary(max_size=64), st.text(max_size=32),
                     st.integers(-(2**63), 2**63 - 1))


@pytest.mark.unit
@pytest.mark.parametrize("in_c", [True, False], ids=["hiredis", "redis-py"])
@given(command=st.sampled_from(["FCALL", "EVALSHA", "SCRIPT LOAD", b"XACK"]),
       head=st.lists(arguments, max_size=6), tail=st.lists(packable, max_size=40))
def test_packed_arguments_are_sent_as_the_same_bytes(
    command: str | bytes, head: list, tail: list, in_c: bool,
) -> None:
    """A command whose last arguments come packed (PackedArgs) is the same bytes as one
    that names them one by one, through hiredis or through redis-py's own packer (no
    hiredis installed), and the packed tail reads back as the arguments it was made of."""
    from unittest import mock

    from tokenq.shared import packing

    expected = b"".join(Connection().pack_command(command, *head, *tail))
    tail_packed = packing.PackedArgs(len(tail), b"".join(map(packing.bulk, tail)))
    with mock.patch.object(packing, "_hiredis_pack", packing._hiredis_pack if in_c else None):
        assert b"".join(Packed().pack_command(command, *head, tail_packed)) == expected
    assert tail_packed.values() == [Connection().encoder.encode(value) for value in tail]


@pytest.mark.unit
@pytest.mark.parametrize("data", [b"$3\r\nab\r\n", b"x1\r\na\r\n", b"$1\r\na\r\nextra",
                                  b"$-5\r\n\r\n", b"$9\r\nab\r\n"])
def test_packed_arguments_that_are_not_resp_are_refused_when_read_back(data: bytes) -> None:
    from tokenq.shared.packing import PackedArgs

    with pytest.raises(ValueError):
        PackedArgs(1, data).values()


@pytest.mark.unit
def test_what_cannot_be_sent_is_refused_by_the_bulk_packer_by_name() -> None:
    from tokenq.shared.packing import bulk

    for value in (True, 1.5, None, ["a"]):
        with pytest.raises(TypeError, match="cannot send a"):
            bulk(value)  # type: ignore[arg-type]
    assert bulk("\ud800x") == b"$2\r\n?x\r\n"  # text never raises: a lone surrogate is ?


def test_only_clients_tokenq_made_are_handed_packed_arguments(redis_url: str) -> None:
    import redis
    import redis.asyncio as aioredis

    from tokenq.shared.packing import takes_packed

    assert takes_packed(connect(WorkerSettings(redis_url=redis_url, queue="q")))
    assert not takes_packed(aioredis.Redis.from_url(redis_url))
    assert not takes_packed(redis.Redis.from_url(redis_url))
    assert not takes_packed(object())


@pytest.mark.unit
def test_what_hiredis_refuses_gets_redis_pys_error() -> None:
    with pytest.raises(DataError):
        Packed().pack_command("SET", "key", True)


@pytest.mark.unit
def test_the_workers_client_packs_in_c_whatever_the_url_scheme() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://127.0.0.1:6380/0", "unix:///tmp/r.sock"):
        client = connect(WorkerSettings(redis_url=url, queue="q", backend="sim"))
        connection_class = client.connection_pool.connection_class
        assert issubclass(connection_class, HiredisPacking), url
        # Right after tokenq's mixins: the scheme's own redis-py connection class.
        first_redis = next(c for c in connection_class.__mro__ if c.__module__.startswith("redis"))
        assert first_redis.__name__.endswith("Connection"), url


@pytest.mark.unit
@given(
    st.lists(st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), min_size=1,
                     max_size=12), min_size=1, max_size=4),
    st.sampled_from(["workers", "streams", "STREAMS"]),
    st.booleans(),
)
def test_a_stream_reads_keys_are_found_without_asking_redis(
    streams: list[str], consumer: str, with_count: bool
) -> None:
    """The worker's Cluster client routes XREADGROUP by the keys after STREAMS, however named."""
    from tokenq.worker.redis_connect import stream_read_keys

    options = ["COUNT", 10, "BLOCK", 100] if with_count else []
    args = ("XREADGROUP", "GROUP", "workers", consumer, *options, "STREAMS", *streams,
            *([">"] * len(streams)))
    assert stream_read_keys(args) == streams
    assert stream_read_keys(("XREAD", "STREAMS", *streams, *(["0"] * len(streams)))) == streams
    assert stream_read_keys(("GET", "x")) is None
    assert stream_read_keys(("XREADGROUP", "GROUP", "g", "c", "STREAMS", "odd")) is None


def test_a_connection_closed_under_a_command_fails_it_as_a_connection_error(
    redis_url: str,
) -> None:
    """redis-py's asyncio send awaits its health check before writing; a concurrent
    disconnect then (a Cluster client dropping a node's connections on a failover) left
    it writing to None: AttributeError, which killed a worker's publisher. Every async
    connection class tokenq makes gets the mixin, and it raises ConnectionError instead,
    which redis-py retries and the worker's loops wait out."""
    import asyncio

    import redis.asyncio as aioredis
    from redis.exceptions import ConnectionError as RedisConnectionError

    from tokenq.shared.packing import AsyncHiredisPacking, packing_mixin

    assert packing_mixin(Connection) is AsyncHiredisPacking
    client = connect(WorkerSettings(redis_url=redis_url, queue="q"))
    assert issubclass(client.connection_pool.connection_class, AsyncHiredisPacking)

    async def closed_while_checking() -> Exception:
        connection = client.connection_pool.connection_class(
            **aioredis.Redis.from_url(redis_url).connection_pool.connection_kwargs)
        await connection.connect()

        async def disconnected_meanwhile() -> None:
            await connection.disconnect()

        connection.check_health = disconnected_meanwhile  # type: ignore[method-assign]
        try:
            await connection.send_packed_command(connection.pack_command("PING"))
        except Exception as exc:  # which exception is the point
            return exc
        finally:
            await connection.disconnect()
            await client.aclose()
        raise AssertionError("the send did not fail")

    failure = asyncio.run(closed_while_checking())
    assert isinstance(failure, RedisConnectionError), repr(failure)
    # Before redis-py 8.2 the write reached None and the mixin turned that
    # AttributeError into this ConnectionError; 8.2 checks the writer itself.
    assert failure.__cause__ is None or isinstance(failure.__cause__, AttributeError)


def test_a_sync_socket_closed_under_a_command_fails_it_as_a_connection_error(
    redis_url: str,
) -> None:
    """The same race on the producer's sync connection (another thread's disconnect, as a
    Cluster or Sentinel client does on a failover): ConnectionError, which the producer
    retries within the caller's deadline, not AttributeError."""
    import redis
    from redis.exceptions import ConnectionError as RedisConnectionError

    from tokenq.producer import Client
    from tokenq.shared.packing import SyncHiredisPacking

    with Client(redis_url=redis_url, queue="q") as client:
        connection_class = client._redis.connection_pool.connection_class
    assert issubclass(connection_class, SyncHiredisPacking)
    connection = connection_class(
        **redis.Redis.from_url(redis_url).connection_pool.connection_kwargs)
    connection.connect()
    connection.check_health = connection.disconnect  # type: ignore[method-assign]
    with pytest.raises(RedisConnectionError) as failure:
        connection.send_command("PING")
    assert isinstance(failure.value.__cause__, AttributeError)
    connection.disconnect()


def test_the_start_up_check_warns_of_eviction_and_no_append_only_file(
    redis_url: str, r, caplog: pytest.LogCaptureFixture,
) -> None:
    import asyncio
    import logging

    from tokenq.worker.redis_connect import check_server

    async def check() -> None:
        client = connect(WorkerSettings(redis_url=redis_url))
        try:
            await check_server(client)
        finally:
            await client.aclose()

    before = r.config_get("maxmemory-policy")["maxmemory-policy"], r.config_get("appendonly")
    logger = logging.getLogger("tokenq.worker")
    logger.addHandler(caplog.handler)
    try:
        r.config_set("maxmemory-policy", "allkeys-lru")
        r.config_set("appendonly", "no")
        asyncio.run(check())
        assert "Redis maxmemory-policy is 'allkeys-lru'" in caplog.text
        assert "Redis appendonly is off" in caplog.text
        caplog.clear()
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("appendonly", "yes")
        asyncio.run(check())
        assert "maxmemory-policy" not in caplog.text and "appendonly" not in caplog.text
    finally:
        logger.removeHandler(caplog.handler)
        r.config_set("maxmemory-policy", before[0])
        r.config_set("appendonly", before[1]["appendonly"])
