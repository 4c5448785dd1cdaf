"""What :class:`~tokenq.producer.Client` and :class:`~tokenq.producer.AsyncClient` share
besides their calls: how they are made (settings, core, id) and how a :class:`Send` names
what it runs. Each twin adds its connection (:meth:`ProducerBase._connect`) and its driver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenq.producer.calls import DURABLE_ENQUEUE
from tokenq.producer.config import DEFAULT_CONFIG_TTL_S
from tokenq.producer.core import ClientCore, EstimatorChoice, make_settings
from tokenq.shared.settings import ClientSettings


class ProducerBase:
    """Settings, the :class:`ClientCore` and the client id (arguments: see ``Client``)."""

    _redis: Any
    _scripts: dict[str, Any]
    """The functions a :class:`Send` may name (:data:`~tokenq.producer.calls.SCRIPTS`):
    :class:`tokenq.shared.functions.Function` or its asyncio twin."""

    def __init__(
        self,
        redis_url: str | None = None,
        queue: str | None = None,
        *,
        prefix: str | None = None,
        max_queue_length: int | None = None,
        timeout_s: float | None = None,
        estimator: EstimatorChoice = "auto",
        settings: ClientSettings | None = None,
        max_connections: int | None = None,
        config_ttl_s: float = DEFAULT_CONFIG_TTL_S,
        refuse_early: bool = True,
    ) -> None:
        self.settings = make_settings(
            settings,
            redis_url=redis_url,
            queue=queue,
            prefix=prefix,
            max_queue_length=max_queue_length,
            timeout_s=timeout_s,
        )
        self._core = ClientCore(self.settings, estimator, config_ttl_s, refuse_early)
        self.client_id = self._core.new_id()
        self._connect(max_connections)

    def _connect(self, max_connections: int | None) -> None:
        """Make the Redis client(s) and the functions they call; connections open lazily."""
        raise NotImplementedError

    def _command(self, name: str) -> Callable[..., Any]:
        """What a :class:`~tokenq.producer.calls.Send` named: a redis-py method, a script,
        or :data:`~tokenq.producer.calls.DURABLE_ENQUEUE`."""
        if name == DURABLE_ENQUEUE:
            return self._durable_enqueue
        script = self._scripts.get(name)
        return script if script is not None else getattr(self._redis, name)

    def _durable_enqueue(
        self, *, keys: list[str], args: list[Any], replicas: int, timeout_ms: int
    ) -> Any:
        """The enqueue script and ``WAIT`` in one pipeline, so both run on one connection."""
        raise NotImplementedError

    @property
    def unreplicated(self) -> int:
        """How many requests this client's durable enqueues wrote that too few replicas
        confirmed in time (``durable_replicas``): raised as NotReplicated by the submits,
        logged by ``infer`` and ``infer_many``, which wait for the replies as usual."""
        return self._core.unconfirmed_requests.count

    @property
    def queue(self) -> str:
        """The queue's name."""
        return self._core.queue.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._core.url!r}, queue={self._core.queue.name!r})"
