"""tokenq's producer side: what a web backend imports to enqueue texts and get results.

Needs only redis, msgpack and pydantic-settings (no torch, transformers or numpy):

    from tokenq.producer import Client

    with Client("redis://localhost:6379/0", "embed") as client:
        result = client.infer("hello world")          # Result(embedding=array('f', ...))
        ids = client.submit_many(["a", "b"])          # fire now ...
        results = client.results(ids, timeout_s=10)   # ... collect later, anywhere
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tokenq.shared.errors import (
    BadRequest,
    BrokerOutOfMemory,
    BrokerUnavailable,
    ConfigError,
    DeadlineExceeded,
    NotReplicated,
    QueueFull,
    QuotaExceeded,
    RemoteError,
    TokenqError,
)

if TYPE_CHECKING:
    from tokenq.producer.aio import AsyncClient
    from tokenq.producer.client import Client
    from tokenq.producer.config import HEURISTIC_MARGIN, Estimator, InputTooLong
    from tokenq.producer.estimate import estimate_tokens
    from tokenq.producer.replies import ReplyTimeout, Result
    from tokenq.producer.tokenizer import TokenizerEstimator

_HOMES = {
    "AsyncClient": "aio", "Client": "client", "HEURISTIC_MARGIN": "config",
    "Estimator": "config", "InputTooLong": "config", "estimate_tokens": "estimate",
    "ReplyTimeout": "replies", "Result": "replies", "TokenizerEstimator": "tokenizer",
}
"""Where each public name lives, imported at its first use: a process that needs one submodule
(a worker reading ``lua/``, ``tokenq stats --help``) loads neither client nor redis.asyncio."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "HEURISTIC_MARGIN",
    "AsyncClient",
    "BadRequest",
    "BrokerOutOfMemory",
    "BrokerUnavailable",
    "Client",
    "ConfigError",
    "DeadlineExceeded",
    "Estimator",
    "InputTooLong",
    "NotReplicated",
    "QueueFull",
    "QuotaExceeded",
    "RemoteError",
    "ReplyTimeout",
    "Result",
    "TokenizerEstimator",
    "TokenqError",
    "estimate_tokens",
]
