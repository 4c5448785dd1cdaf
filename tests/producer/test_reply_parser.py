"""The suite runs with the reply parser it was asked for (see tests/pure_python_parser.py)."""

from __future__ import annotations

import importlib.util
import sys

import redis
from redis.utils import HIREDIS_AVAILABLE


def test_the_reply_parser_is_the_one_asked_for(redis_url: str) -> None:
    forced_python = "hiredis" in sys.modules and sys.modules["hiredis"] is None
    if forced_python:
        assert HIREDIS_AVAILABLE is False
    else:
        assert (importlib.util.find_spec("hiredis") is not None) == HIREDIS_AVAILABLE
    client = redis.Redis.from_url(redis_url)
    try:
        client.ping()
        parser = type(client.connection_pool.get_connection()._parser).__name__
    finally:
        client.close()
    assert ("Hiredis" in parser) == HIREDIS_AVAILABLE, parser
