"""One client's state, shared by all its calls and lanes (no I/O): the calls take its parts
directly (settings, config cache, lanes, preparer, shard chooser)."""

from __future__ import annotations

import math
import threading
from typing import Any

import pydantic

from tokenq.producer.config import DEFAULT_CONFIG_TTL_S, EstimatorChoice, config_cache
from tokenq.producer.lanes import Lanes
from tokenq.producer.prepare import Preparer
from tokenq.producer.prepare import TextItem as TextItem  # the gateway's import
from tokenq.producer.shards import ShardChooser
from tokenq.shared import keys
from tokenq.shared.errors import BadRequest
from tokenq.shared.redis_url import redact
from tokenq.shared.settings import ClientSettings, describe_errors

UNCONFIRMED_WARN_EVERY_S = 60.0
"""The warning for requests a durable enqueue wrote unconfirmed comes at most this often per
client (the rest at DEBUG): a replica down for an hour must not log a line per request."""


class Unconfirmed:
    """How many requests durable enqueues wrote that too few replicas confirmed in time
    (``Client.unreplicated``), and when to warn of it next (thread-safe)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._warned_at = -math.inf

    def add(self, n: int, now_s: float) -> bool:
        """Count ``n`` more; whether a warning is due (monotonic ``now_s``)."""
        with self._lock:
            self.count += n
            due = now_s - self._warned_at >= UNCONFIRMED_WARN_EVERY_S
            if due:
                self._warned_at = now_s
            return due


def make_settings(settings: ClientSettings | None, **overrides: Any) -> ClientSettings:
    """Settings from ``TOKENQ_*`` (or ``settings``), with non-None keyword overrides on top. An
    invalid value is a :class:`BadRequest` naming the first setting at fault, before any connection
    is made."""
    given = {name: value for name, value in overrides.items() if value is not None}
    try:
        if settings is None:
            return ClientSettings(**given)
        return ClientSettings.model_validate({**settings.model_dump(), **given})
    except pydantic.ValidationError as exc:
        problems = "; ".join(describe_errors(exc, ClientSettings, flags=False))
        where = exc.errors()[0]["loc"] if exc.errors() else ()
        param = str(where[0]) if where else "settings"
        raise BadRequest(f"invalid client settings: {problems}", param=param) from None


class ClientCore:
    """The parts one client's calls share; made from its settings and constructor options."""

    __slots__ = ("chooser", "config", "lanes", "preparer", "settings", "unconfirmed", "url")

    def __init__(
        self,
        settings: ClientSettings,
        estimator: EstimatorChoice = None,
        config_ttl_s: float = DEFAULT_CONFIG_TTL_S,
        refuse_early: bool = True,
    ) -> None:
        queue = settings.queue_ref
        self.settings = settings
        self.url = redact(settings.redis_url)
        """The Redis URL, password masked (error text and logs)."""
        self.config = config_cache(estimator, config_ttl_s, keys.config(queue))
        self.lanes = Lanes(queue, settings.shards, self.config.config)
        self.preparer = Preparer(settings, self.config, refuse_early)
        self.chooser = ShardChooser(settings.shard_choice)
        self.unconfirmed = Unconfirmed()
