"""What :class:`~tokenq.producer.Client` and :class:`~tokenq.producer.AsyncClient` share
besides their calls: how they are made, and how a :class:`~.calls.Send` names what it runs."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenq.producer.call_options import ClientOptions, refuse_unknown
from tokenq.producer.calls import DURABLE_ENQUEUE
from tokenq.producer.config import DEFAULT_CONFIG_TTL_S
from tokenq.producer.core import ClientCore, make_settings
from tokenq.producer.tokenizer import load_estimator
from tokenq.shared.settings import ClientSettings

if TYPE_CHECKING:
    from typing_extensions import Unpack


class ProducerBase:
    """Settings, the :class:`ClientCore` and the client id; each twin adds its connection
    (:meth:`_connect`) and its driver."""

    _redis: Any
    _scripts: dict[str, Any]
    """The functions a Send may name (:data:`~.calls.SCRIPTS`), sync or asyncio."""

    def __init__(
        self, redis_url: str | None = None, queue: str | None = None, *,
        settings: ClientSettings | None = None, **options: Unpack[ClientOptions],
    ) -> None:
        refuse_unknown(options, ClientOptions, type(self).__name__)
        self.settings = make_settings(
            settings, redis_url=redis_url, queue=queue, prefix=options.get("prefix"),
            max_queue_length=options.get("max_queue_length"), timeout_s=options.get("timeout_s"),
        )
        self._core = ClientCore(
            self.settings, options.get("estimator", "auto"),
            options.get("config_ttl_s", DEFAULT_CONFIG_TTL_S), options.get("refuse_early", True),
        )
        self.client_id = self._core.lanes.home.new_id()
        self._loading: dict[str, concurrent.futures.Future[None]] = {}
        self._loading_lock = threading.Lock()
        self._connect(options.get("max_connections"))

    def _connect(self, max_connections: int | None) -> None:
        """Make the Redis client(s) and the functions they call; connections open lazily."""
        raise NotImplementedError

    def _command(self, name: str) -> Callable[..., Any]:
        """What a Send named: a redis-py method, a script, or the durable enqueue."""
        if name == DURABLE_ENQUEUE:
            return self._durable_enqueue
        script = self._scripts.get(name)
        return script if script is not None else getattr(self._redis, name)

    def _durable_enqueue(
        self, *, keys: list[str], args: list[Any], replicas: int, timeout_ms: int
    ) -> Any:
        """The enqueue script and ``WAIT`` in one pipeline, so both run on one connection."""
        raise NotImplementedError

    def _tokenizer_load(self, path: str) -> concurrent.futures.Future[None]:
        """The load of ``path`` into the config cache, started once in a daemon thread of its
        own; callers wait for it only until their deadlines."""
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
        confirmed in time: raised as NotReplicated by the submits, logged by the infers."""
        return self._core.unconfirmed.count

    @property
    def queue(self) -> str:
        """The queue's name."""
        return self.settings.queue

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._core.url!r}, queue={self.settings.queue!r})"
