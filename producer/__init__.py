"""tokenq's producer side: what a web backend imports to enqueue texts and get results.

Needs only redis, msgpack and pydantic-settings (no torch, transformers or numpy):

    from tokenq.producer import Client

    with Client("redis://localhost:6379/0", "embed") as client:
        result = client.infer("hello world")          # Result(embedding=array('f', ...))
        ids = client.submit_many(["a", "b"])          # fire now ...
        results = client.results(ids, timeout_s=10)   # ... collect later, anywhere
"""

from tokenq.producer.aio import AsyncClient
from tokenq.producer.client import Client
from tokenq.producer.config import HEURISTIC_MARGIN, Estimator, InputTooLong
from tokenq.producer.estimate import estimate_tokens
from tokenq.producer.replies import ReplyTimeout, Result
from tokenq.producer.tokenizer import TokenizerEstimator
from tokenq.shared.errors import (
    BadRequest,
    BrokerOutOfMemory,
    BrokerUnavailable,
    ConfigError,
    DeadlineExceeded,
    NotReplicated,
    QueueFull,
    RemoteError,
    TokenqError,
)

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
    "RemoteError",
    "ReplyTimeout",
    "Result",
    "TokenizerEstimator",
    "TokenqError",
    "estimate_tokens",
]
