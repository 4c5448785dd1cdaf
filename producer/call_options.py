"""The keyword options a producer's enqueueing calls take, declared once for both clients.

``submit``, ``submit_many``, ``infer`` and ``infer_many`` of
:class:`~tokenq.producer.Client` and :class:`~tokenq.producer.AsyncClient`
all take ``**options: Unpack[...]`` of the dicts below, and
:meth:`~tokenq.producer.prepare.Preparer.prepare` turns them into a request.
So a new per-request option the worker reads from a request's ``opts`` map
is one line in :class:`~tokenq.shared.request_options.WorkerOptions`: every
enqueueing call of both clients then accepts it as a keyword and sends it in
``opts`` under its own name (the worker validates it, see docs/PROTOCOL.md).

Python checks no keyword against a ``TypedDict``, so each call first passes
what it was given to :func:`refuse_unknown`, which raises the ``TypeError``
a fixed signature would for a name it does not declare.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenq.shared.request_options import WorkerOptions


class RequestOptions(WorkerOptions, total=False):
    """The keyword options of ``infer`` and ``infer_many``, and of the submits."""

    deadline_s: float | None
    """When the answer stops being useful, in seconds from now; travels as ``timeout_ms``.

    Counted on Redis's clock, so no producer clock skew reaches the workers.
    ``infer`` and ``infer_many`` send what is left of their ``timeout_s``
    when no deadline is given.
    """
    deadline_ms: int | None
    """The same as an absolute epoch-milliseconds time, converted with this machine's clock."""
    opts: Mapping[str, Any] | None
    """The request's ``opts`` map as is: string keys, msgpack-encodable values."""
    priority: int | None
    """Scheduling class from 0 (the default) to 9: a worker puts a higher class into its
    next batch first, and lower classes age into the front (docs/PROTOCOL.md)."""


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
