"""One client's state, shared by all its calls (:class:`ClientCore`), and what both clients
are made of (:class:`ProducerBase`)."""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pydantic

from tokenq.producer.call_options import ClientOptions, refuse_unknown
from tokenq.producer.calls import DURABLE_ENQUEUE
from tokenq.producer.config import DEFAULT_CONFIG_TTL_S, ConfigCache, EstimatorChoice
from tokenq.producer.lanes import Lane, Lanes
from tokenq.producer.prepare import Preparer
from tokenq.producer.prepare import TextItem as TextItem  # the gateway's import
from tokenq.producer.shards import ShardChooser
from tokenq.producer.tokenizer import load_estimator
from tokenq.shared import keys
from tokenq.shared.errors import BadRequest
from tokenq.shared.redis_url import redact
from tokenq.shared.settings import ClientSettings, describe_errors

if TYPE_CHECKING:
    from typing_extensions import Unpack

UNCONFIRMED_WARN_EVERY_S = 60.0
"""The warning for requests a durable enqueue wrote unconfirmed comes at most this often per
client (the rest at DEBUG)."""


class Unconfirmed:
    """How many requests durable enqueues wrote unconfirmed (``Client.unreplicated``), and when
    to warn of it next (thread-safe)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._warned_at = -math.inf

    def add(self, n: int, now_s: float) -> bool:
        """Count ``n`` more; whether a warning is due."""
        with self._lock:
            self.count += n
            due = now_s - self._warned_at >= UNCONFIRMED_WARN_EVERY_S
            if due:
                self._warned_at = now_s
            return due


def make_settings(settings: ClientSettings | None, **overrides: Any) -> ClientSettings:
    """Settings from ``TOKENQ_*`` (or ``settings``), with non-None keyword overrides on top; an
    invalid value is a :class:`BadRequest` naming the first setting at fault."""
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
    """What one client's calls share: settings, config cache, lanes, preparer, shard chooser."""

    __slots__ = (
        "chooser", "config", "lanes", "listener", "preparer", "settings", "unconfirmed", "url"
    )

    def __init__(
        self, settings: ClientSettings, estimator: EstimatorChoice = None,
        config_ttl_s: float = DEFAULT_CONFIG_TTL_S, refuse_early: bool = True,
    ) -> None:
        queue = settings.queue_ref
        self.settings = settings
        self.url = redact(settings.redis_url)  # for error text and logs
        self.config = ConfigCache(estimator, config_ttl_s, keys.config(queue))
        self.lanes = Lanes(queue, settings.shards, self.config.config)
        self.preparer = Preparer(settings, self.config, refuse_early)
        self.chooser = ShardChooser(settings.shard_choice)
        self.unconfirmed = Unconfirmed()
        self.listener: Callable[[Lane], str] | None = None
        """The reply key an AsyncClient's listener reads for requests written to a lane."""


class ProducerBase:
    """Settings, the :class:`ClientCore` and the client id; each twin adds its connection
    (:meth:`_connect`: the Redis clients and :data:`~.calls.SCRIPTS`) and its driver."""

    _redis: Any
    _scripts: dict[str, Any]
    _connect: Callable[[int | None], None]
    _durable_enqueue: Callable[..., Any]
    """The enqueue script and ``WAIT`` in one pipeline, so both run on one connection."""

    def __init__(
        self, redis_url: str | None = None, queue: str | None = None, *,
        settings: ClientSettings | None = None, **options: Unpack[ClientOptions],
    ) -> None:
        refuse_unknown(options, ClientOptions, type(self).__name__)
        self.settings = make_settings(
            settings, redis_url=redis_url, queue=queue, prefix=options.get("prefix"),
            max_queue_length=options.get("max_queue_length"), timeout_s=options.get("timeout_s"))
        self._core = ClientCore(
            self.settings, options.get("estimator", "auto"),
            options.get("config_ttl_s", DEFAULT_CONFIG_TTL_S), options.get("refuse_early", True))
        self.client_id = self._core.lanes.home.new_id()
        self._loading: dict[str, concurrent.futures.Future[None]] = {}
        self._loading_lock = threading.Lock()
        self._connect(options.get("max_connections"))

    def _command(self, name: str) -> Callable[..., Any]:
        """What a Send named: a redis-py method, a script, or the durable enqueue."""
        if name == DURABLE_ENQUEUE:
            return self._durable_enqueue
        script = self._scripts.get(name)
        return script if script is not None else getattr(self._redis, name)

    def _tokenizer_load(self, path: str) -> concurrent.futures.Future[None]:
        """The load of ``path`` into the config cache, started once in a daemon thread; callers
        wait for it only until their deadlines."""
        with self._loading_lock:
            loading = self._loading.get(path)
            if loading is None:
                loading = self._loading[path] = concurrent.futures.Future()
                loading.set_running_or_notify_cancel()  # a waiter's cancel cannot end it
                threading.Thread(target=self._load, args=(path, loading), daemon=True,
                                 name=f"tokenq-tokenizer-{self.client_id[:12]}").start()
        return loading

    def _load(self, path: str, loading: concurrent.futures.Future[None]) -> None:
        try:
            loaded: Any = load_estimator(path)
        except Exception as exc:  # load_estimator never raises; a bug must not strand waiters
            loaded = exc
        self._core.config.take_tokenizer(path, loaded)
        with self._loading_lock:
            del self._loading[path]
        loading.set_result(None)

    @property
    def unreplicated(self) -> int:
        """How many requests this client's durable enqueues wrote that too few replicas
        confirmed in time: NotReplicated for the submits, logged by the infers."""
        return self._core.unconfirmed.count

    @property
    def queue(self) -> str:
        return self.settings.queue

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._core.url!r}, queue={self.settings.queue!r})"
