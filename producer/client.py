"""The synchronous producer client: the blocking driver of :mod:`tokenq.producer.calls`, each
command run in the calling thread under the caller's deadline (:mod:`.redis_deadlines`)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from tokenq.producer import calls, nodes, redis_deadlines
from tokenq.producer.call_options import RequestOptions, SubmitOptions
from tokenq.producer.core import ProducerBase
from tokenq.producer.deadline import Deadline
from tokenq.producer.prepare import TextItem
from tokenq.producer.replies import Result
from tokenq.shared import functions

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")


class Client(ProducerBase):
    """A producer for one queue: ``Client(redis_url=None, queue=None, *, settings=None, ...)``.

    Settings come from ``settings`` (or ``TOKENQ_*`` environment variables when omitted);
    ``prefix``, ``max_queue_length`` and ``timeout_s`` override them when not None.
    ``max_connections`` caps the connection pool (default: one per concurrent thread).

    Every call returns or raises by its deadline plus ``DEADLINE_GRACE_S``, whatever state
    Redis is in: ``infer``, ``infer_many``, ``result`` and ``results`` by their ``timeout_s``,
    the others by ``settings.timeout_s``.

    ``estimator`` picks the ``tokens`` count sent and checked early: ``"auto"`` counts exactly
    with the tokenizer.json the queue's config names when ``tokenizers`` can load it, else
    with :func:`tokenq.producer.estimate_tokens`; ``"heuristic"`` never loads one;
    ``"exact"`` raises ConfigError rather than enqueue without one; a callable ``f(text)``
    or ``f(text, text_pair)`` replaces both (``exact = True`` on it: no margin).
    ``config_ttl_s``: how long a read of the config hash is trusted. ``refuse_early=False``
    sends everything on to the workers, which answer what they refuse.
    """

    def _connect(self, max_connections: int | None) -> None:
        self._config_state = threading.Lock()  # held only to look at or update the one below
        self._config_read: threading.Event | None = None  # set when the read in flight ends
        self._redis = redis_deadlines.sync_redis(self.settings, self.client_id, max_connections)
        self._scripts = {name: functions.Function(self._redis, name) for name in calls.SCRIPTS}

    def _durable_enqueue(
        self, *, keys: list[str], args: list[Any], replicas: int, timeout_ms: int
    ) -> tuple[Any, int]:
        def enqueue_and_wait(node: Any) -> tuple[Any, int]:
            with node.pipeline(transaction=False) as pipe:
                self._scripts[calls.ENQUEUE](keys=keys, args=args, client=pipe)
                pipe.execute_command("WAIT", replicas, timeout_ms)
                with redis_deadlines.slow_reply(timeout_ms / 1000):  # WAIT's own time
                    written, confirmed = pipe.execute()
            return written, int(confirmed)

        enqueue = self._scripts[calls.ENQUEUE]  # on a node without tokenq's functions: load, again
        return nodes.run_pinned(
            self._redis, keys[0], lambda node: enqueue.guarded(node, lambda: enqueue_and_wait(node))
        )

    def close(self) -> None:
        """Close every connection this client opened."""
        self._redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- calls

    def submit(
        self, text: str, *, text_pair: str | None = None, **options: Unpack[SubmitOptions]
    ) -> str:
        """Enqueue one text; its request id, for :meth:`result`. ``deadline_s`` (from now) or
        ``deadline_ms`` (epoch ms): when the answer stops being useful; ``reply_to``: another reply
        key. QueueFull at the queue's limit, BadRequest (InputTooLong) for bad input: no write."""
        return self._run(calls.submit(self._core, text, text_pair, options))

    def submit_many(
        self, texts: Iterable[TextItem], *, unique: Sequence[str] | None = None,
        **options: Unpack[SubmitOptions],
    ) -> list[str]:
        """Enqueue a batch (texts or ``(text, text_pair)`` tuples) all or nothing; the ids.
        ``unique``: the requests' ids (32 hex digits each) instead of fresh ones: a retry that names
        the same ids is written once (``dedupe_ttl_s``)."""
        return self._run(calls.submit_many(self._core, texts, options, unique))

    def result(self, request_id: str, timeout_s: float | None = None) -> Result:
        """Wait for the reply to ``request_id`` (from this or any other process). Raises the
        worker's error as RemoteError (or DeadlineExceeded), ReplyTimeout when no reply comes in
        time. The first caller to fetch a reply consumes it."""
        return self.results([request_id], timeout_s)[0]

    def results(
        self, request_ids: Sequence[str], timeout_s: float | None = None, *,
        return_exceptions: bool = False, keep: bool = False,
    ) -> list[Any]:
        """Wait for several submitted requests' replies; results in input order. Keys are deleted
        once their replies are in hand, unless ``keep`` (then :meth:`forget` or the worker's
        ``reply_ttl_s`` does). ``return_exceptions``: errors in place."""
        return self._run(calls.results(self._core, request_ids, timeout_s, return_exceptions,
                                       keep))

    def forget(self, request_ids: Sequence[str]) -> None:
        """Delete the replies :meth:`results` kept for ``request_ids`` (best effort)."""
        self._run(calls.forget_replies(self._core, request_ids))

    def infer(
        self, text: str, *, text_pair: str | None = None, timeout_s: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> Result:
        """Enqueue one text and wait for its result on its own reply key: an outage is retried
        within ``timeout_s`` (then BrokerUnavailable), no answer is ReplyTimeout. Without a deadline
        the request carries the rest of the timeout: no device time on answers nobody awaits."""
        return self._run(calls.infer(self._core, text, text_pair, timeout_s, options, None))

    def infer_many(
        self, texts: Iterable[TextItem], *, timeout_s: float | None = None,
        return_exceptions: bool = False, **options: Unpack[RequestOptions],
    ) -> list[Any]:
        """Enqueue a batch all or nothing and wait for every result, in input order. The replies
        land on one key of the call's. Without ``return_exceptions`` the first failed item is raised
        once every reply is in or the timeout has passed."""
        call = calls.infer_many(self._core, texts, timeout_s, return_exceptions, options, None)
        return self._run(call)

    def workers_alive(self) -> int:
        """How many workers of the queue are alive now (0: nobody would answer); needs the
        optional reads of docs/SECURITY.md (``HKEYS``, ``EXISTS``)."""
        return self._run(calls.workers_alive(self._core))

    def queue_length(self, timeout_s: float | None = None) -> int:
        """How many requests the queue's stream holds (pending and in flight); raises
        ``BrokerUnavailable`` past ``timeout_s`` (default ``settings.timeout_s``)."""
        return self._run(calls.queue_length(self._core, timeout_s))

    def config(self) -> dict[str, str]:
        """The queue's config hash as workers published it (empty before any started); also
        refreshes the copy enqueues are checked against."""
        deadline = Deadline.after(self.settings.timeout_s)
        return self._run(calls.read_config(self._core, deadline, strict=True))

    # --------------------------------------------------------------- driver

    def _run(self, call: calls.Call[T]) -> T:
        """Perform ``call``'s steps in this thread, one after the other, until it returns."""
        try:
            step = calls.resume(call)
            while not isinstance(step, calls.Done):
                step = calls.resume(call, self._perform(step))
            return step.value
        finally:
            call.close()

    def _perform(self, step: calls.Step) -> Any:
        """The step's answer, or its failure (thrown into the call)."""
        try:
            if type(step) is calls.Send:  # the common step, ahead of the match below
                with redis_deadlines.for_caller(step.deadline):
                    return self._command(step.command)(*step.args, **step.kwargs)
            match step:
                case calls.Sleep(seconds):
                    time.sleep(seconds)
                case calls.ShareConfigRead(deadline):
                    self._share_config_read(deadline)
                case calls.LoadTokenizer(path, deadline):
                    concurrent.futures.wait([self._tokenizer_load(path)], deadline.left())
                case _:  # Listen, Collect: this client has no listener
                    raise TypeError(f"Client cannot perform {step!r}")
        except Exception as exc:
            return redis_deadlines.failure(exc)
        return None

    def _share_config_read(self, deadline: Deadline) -> None:
        """Read the config hash in this thread, or wait for another thread's read to end."""
        with self._config_state:
            if not self._core.config.due(time.monotonic()):
                return  # read meanwhile
            done = self._config_read
            leading = done is None
            if done is None:
                done = self._config_read = threading.Event()
        if not leading:
            done.wait(deadline.left())
            return
        try:
            self._run(calls.read_config(self._core, deadline, strict=False))
        finally:
            with self._config_state:
                self._config_read = None
            done.set()
