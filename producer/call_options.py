"""The keyword options of the producer's constructors and enqueueing calls, declared once for
both clients; a new worker option is one line in ``WorkerOptions``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

from tokenq.producer.config import EstimatorChoice
from tokenq.shared.request_options import WorkerOptions


class ClientOptions(TypedDict, total=False):
    """The keyword options of ``Client`` and ``AsyncClient`` (see ``Client``)."""

    prefix: str | None
    max_queue_length: int | None
    timeout_s: float | None
    estimator: EstimatorChoice
    max_connections: int | None
    config_ttl_s: float
    refuse_early: bool


class RequestOptions(WorkerOptions, total=False):
    """The keyword options of ``infer`` and ``infer_many``, and of the submits."""

    deadline_s: float | None
    """When the answer stops being useful, in seconds from now; travels as ``timeout_ms``
    (Redis's clock). ``infer`` sends what is left of its ``timeout_s`` when none is given."""
    deadline_ms: int | None
    """The same as an absolute epoch-milliseconds time, converted with this machine's clock."""
    opts: Mapping[str, Any] | None
    """The request's ``opts`` map as is: string keys, msgpack-encodable values."""
    priority: int | None
    """Scheduling class from 0 (the default) to 9: a worker batches a higher class first, and
    lower classes age into the front (docs/PROTOCOL.md)."""
    tenant: str | None
    """Whose request this is: it goes to that tenant's stream, which workers read in weighted
    fair share by tokens with the other tenants' (None: the default tenant, the queue's stream)."""


class SubmitOptions(RequestOptions, total=False):
    """The keyword options of ``submit`` and ``submit_many``."""

    reply_to: str | None
    """The key the reply is pushed on, instead of the request's own (which ``result`` reads)."""


WORKER_OPTIONS: frozenset[str] = WorkerOptions.__optional_keys__
"""The names of :class:`WorkerOptions`, sent in the request's ``opts`` map."""


def refuse_unknown(options: Mapping[str, Any], accepted: type, call: str) -> None:
    """Raise TypeError for a keyword in ``call``'s ``options`` not declared by ``accepted``."""
    names = accepted.__optional_keys__ | accepted.__required_keys__  # type: ignore[attr-defined]
    for name in options:
        if name not in names:
            raise TypeError(f"{call}() got an unexpected keyword argument {name!r}")


def worker_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`WorkerOptions` among ``options`` that were given (not None)."""
    return {name: options[name] for name in WORKER_OPTIONS if options.get(name) is not None}
