"""tokenq's producer side: what a web backend imports to enqueue texts and get results.

Needs only redis, msgpack and pydantic-settings; never imports torch,
transformers or numpy, so importing it costs a web process next to nothing.

    from tokenq.producer import Client

    with Client("redis://localhost:6379/0", "embed") as client:
        result = client.infer("hello world")          # Result(embedding=array('f', ...))
        ids = client.submit_many(["a", "b"])          # fire now ...
        results = client.results(ids, timeout_s=10)   # ... collect later, anywhere
"""

from tokenq.producer._core import Estimator, ReplyTimeout, Result
from tokenq.producer.aio import AsyncClient
from tokenq.producer.client import Client
from tokenq.producer.estimate import estimate_tokens
from tokenq.shared.errors import (
    BadRequest,
    BrokerUnavailable,
    DeadlineExceeded,
    QueueFull,
    RemoteError,
    TokenqError,
)

__all__ = [
    "AsyncClient",
    "BadRequest",
    "BrokerUnavailable",
    "Client",
    "DeadlineExceeded",
    "Estimator",
    "QueueFull",
    "RemoteError",
    "ReplyTimeout",
    "Result",
    "TokenqError",
    "estimate_tokens",
]
