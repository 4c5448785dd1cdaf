"""The synchronous producer client: enqueue texts, wait for their replies.

What each call sends and waits for is written once, in
:mod:`tokenq.producer.calls`, for this client and :class:`AsyncClient`
alike; this module is the blocking driver that performs those steps
(:meth:`Client._run`). Every wait is a loop of bounded blocking reads (each
shorter than the socket timeout, and none removing a reply before it is in
hand: docs/RELIABILITY.md) that ends at the caller's deadline, so no call can
hang; Redis being unreachable until then is reported as
:class:`BrokerUnavailable`, a missing reply as :class:`ReplyTimeout`. A
``Client`` holds no per-call state, so one instance may be shared by
threads.

A caller's timeout is a promise, kept for every Redis command made on its
behalf (config read, enqueue, each blocking read and removal): the command runs in the
calling thread with the caller's deadline in
:data:`~tokenq.producer.redis_deadlines.CALLER_DEADLINE`, which the connection
class, the pool and the ``Retry`` of :mod:`tokenq.producer.redis_deadlines`
read, so a socket wait, a wait for a pooled connection, a reconnect or a
retry never outlasts the caller by more than ``DEADLINE_GRACE_S``.

Before an enqueue the client makes sure its copy of the queue's config hash
is at most ``config_ttl_s`` old (one HGETALL when it is not), so that the
core can refuse what the workers would refuse (see
:mod:`tokenq.producer.config`); every other enqueue is one round trip. Of
concurrent callers that find the copy stale one reads, in its own thread,
and the others wait for that read, each only until its own deadline; a read
that fails leaves the copy stale for the next call. A tokenizer the config
names is loaded in a thread of its own, once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from tokenq.producer import calls, nodes, redis_deadlines
from tokenq.producer.base import ProducerBase
from tokenq.producer.call_options import RequestOptions, SubmitOptions
from tokenq.producer.core import Deadline, Prepared, Result, TextItem
from tokenq.producer.tokenizer import load_estimator
from tokenq.shared import functions

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")


class Client(ProducerBase):
    """A producer for one queue.

    Settings come from ``settings`` (or ``TOKENQ_*`` environment variables
    when omitted); keyword arguments that are not None override them.
    ``max_connections`` caps the Redis connection pool (default: one per
    concurrent thread); a thread beyond the cap waits for a free connection,
    at most until its own deadline.

    Every call returns or raises by its deadline plus a fraction of a
    second (``DEADLINE_GRACE_S``), whatever state Redis is in: ``infer``,
    ``infer_many``, ``result`` and ``results`` by their ``timeout_s``, the
    others (``submit``, ``submit_many``, ``queue_length``, ``config``) by
    ``settings.timeout_s``.

    ``estimator`` chooses the ``tokens`` count sent with each request and
    used for early refusal: ``"auto"`` counts exactly with the tokenizer.json
    the queue's config names when the ``tokenizers`` package can load it,
    else uses the heuristic :func:`tokenq.producer.estimate_tokens`;
    ``"heuristic"`` never loads a tokenizer; ``"exact"`` raises
    :class:`~tokenq.shared.errors.ConfigError` rather than enqueue without
    one; a callable ``f(text)`` or ``f(text, text_pair)`` replaces both
    (give it ``exact = True`` to have it compared without a margin, as
    :class:`tokenq.producer.TokenizerEstimator` does). ``config_ttl_s`` is
    how long a read of the queue's config hash is trusted.
    ``refuse_early=False`` sends everything on to the workers, which answer
    what they refuse with an error reply (to test a worker's own checks).

    The enqueueing calls take the keyword options of
    :class:`~tokenq.producer.call_options.RequestOptions` (``deadline_s``,
    ``deadline_ms``, ``opts``); the submits also ``reply_to``.
    """

    def _connect(self, max_connections: int | None) -> None:
        self._config_state = threading.Lock()  # held only to look at or update the two below
        self._config_read: threading.Event | None = None  # set when the read in flight ends
        self._loading: dict[str, threading.Event] = {}
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

    # ------------------------------------------------------------ lifecycle

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
        """Enqueue one text and return its request id; fetch the reply with :meth:`result`.

        ``deadline_s`` (relative seconds) or ``deadline_ms`` (absolute epoch
        milliseconds, converted with this machine's clock) tells workers when
        the answer stops being useful; it travels as ``timeout_ms``, counted
        on Redis's clock. ``reply_to`` overrides the reply key (``result``
        only reads the default one). Raises :class:`QueueFull` when the queue
        is at its limit and :class:`BadRequest` for invalid input; nothing is
        written in either case. :class:`InputTooLong` (a ``BadRequest``)
        means the queue's config rejects input that long. Returns or raises
        within ``settings.timeout_s`` (plus a fraction of a second).
        """
        return self._run(calls.submit(self._core, text, text_pair, options))

    def submit_many(
        self, texts: Iterable[TextItem], *, unique: Sequence[str] | None = None,
        **options: Unpack[SubmitOptions],
    ) -> list[str]:
        """Enqueue a batch (texts or ``(text, text_pair)`` tuples) all or nothing.

        If the whole batch does not fit under the queue's limit, nothing is
        written and :class:`QueueFull` is raised. ``unique``: the requests' ids
        (32 hex digits each), as :meth:`AsyncClient.submit_many` takes them.
        """
        return self._run(calls.submit_many(self._core, texts, options, unique))

    def result(self, request_id: str, timeout_s: float | None = None) -> Result:
        """Wait for the reply to ``request_id`` (from this or any other process).

        Raises the worker's error as :class:`RemoteError` (or
        :class:`DeadlineExceeded`), :class:`ReplyTimeout` when no reply comes
        in time. A reply is consumed by the first caller that fetches it.
        """
        return self.results([request_id], timeout_s)[0]

    def results(
        self, request_ids: Sequence[str], timeout_s: float | None = None, *,
        return_exceptions: bool = False, keep: bool = False,
    ) -> list[Any]:
        """Wait for the replies to several submitted requests; results in input order.

        One script call reads every still-missing reply key (and one
        ``BLMOVE`` waits when none has landed), so waiting for many requests
        costs one connection; keys are deleted once their replies are in
        hand, unless ``keep`` (then :meth:`forget` deletes them, or the
        worker's ``reply_ttl_s``). With ``return_exceptions`` errors are
        returned in place instead of the first being raised.
        """
        return self._run(calls.results(self._core, request_ids, timeout_s, return_exceptions,
                                       keep))

    def forget(self, request_ids: Sequence[str]) -> None:
        """Delete the replies :meth:`results` kept for ``request_ids`` (best effort)."""
        self._run(calls.forget_replies(self._core, request_ids))

    def infer(
        self, text: str, *, text_pair: str | None = None, timeout_s: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> Result:
        """Enqueue one text and wait for its result.

        Returns or raises within ``timeout_s`` (plus a fraction of a second),
        whatever state Redis is in: an outage is retried until then and
        reported as :class:`BrokerUnavailable`, no answer as
        :class:`ReplyTimeout`. Unless a deadline is given, the request
        carries what is left of the timeout as its deadline, so no worker
        spends device time on an answer nobody waits for any more. The
        reply lands on the request's own key.
        """
        return self._run(calls.infer(self._core, text, text_pair, timeout_s, options, None))

    def infer_many(
        self, texts: Iterable[TextItem], *, timeout_s: float | None = None,
        return_exceptions: bool = False, **options: Unpack[RequestOptions],
    ) -> list[Any]:
        """Enqueue a batch all or nothing and wait for every result, in input order.

        All replies of the call land on one shared reply key, read with
        ``LRANGE`` (``BLMOVE`` waits while it is empty) and trimmed once in
        hand, and are matched by request id. Without
        ``return_exceptions`` the first failed item (in input order) is raised
        once every reply is in or the timeout has passed. Bounded by
        ``timeout_s`` as :meth:`infer` is.
        """
        call = calls.infer_many(self._core, texts, timeout_s, return_exceptions, options, None)
        return self._run(call)

    def workers_alive(self) -> int:
        """How many workers of the queue are alive now (0: nobody would answer).

        A worker is alive while its liveness key is set: it expires three
        heartbeats after the worker's last beat. Needs the optional reads of
        docs/SECURITY.md (``HKEYS`` of the workers hash, ``EXISTS``).
        """
        return self._run(calls.workers_alive(self._core))

    def queue_length(self) -> int:
        """How many requests the queue's stream holds (pending and in flight)."""
        return self._run(calls.queue_length(self._core))

    def config(self) -> dict[str, str]:
        """The queue's config hash as workers published it (empty before any started).

        Reading it also refreshes the copy enqueues are checked against, so
        call this after changing a queue's workers to stop waiting out
        ``config_ttl_s``.
        """
        return self._run(calls.read_config(self._core, self._core.deadline(), strict=True))

    def _enqueue(self, batch: Sequence[Prepared], deadline: Deadline | None = None) -> None:
        """Write prepared requests as ``submit_many`` would (tests replay batches with it)."""
        self._run(calls.enqueue(self._core, batch, deadline or self._core.deadline()))

    # --------------------------------------------------------------- driver

    def _run(self, call: calls.Call[T]) -> T:
        """Perform ``call``'s steps in this thread, one after the other, until it returns."""
        try:
            step = calls.resume(call)
            while not isinstance(step, calls.Done):
                try:
                    answer = self._perform(step)
                except Exception as exc:
                    step = calls.resume(call, failure=redis_deadlines.failure(exc))
                else:
                    step = calls.resume(call, answer)
            return step.value
        finally:
            call.close()

    def _perform(self, step: calls.Step) -> Any:
        if type(step) is calls.Send:  # the common step, ahead of the match below
            with redis_deadlines.for_caller(step.deadline):
                return self._command(step.command)(*step.args, **step.kwargs)
        match step:
            case calls.Sleep(seconds):
                time.sleep(seconds)
            case calls.ShareConfigRead(deadline):
                self._share_config_read(deadline)
            case calls.LoadTokenizer(path, deadline):
                self._load_tokenizer(path, deadline)
            case _:  # Listen, Collect: this client has no listener
                raise TypeError(f"Client cannot perform {step!r}")
        return None

    def _share_config_read(self, deadline: Deadline) -> None:
        """Read the config hash in this thread, or wait for another thread's read to end."""
        with self._config_state:
            if not self._core.config_due(time.monotonic()):
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

    def _load_tokenizer(self, path: str, deadline: Deadline) -> None:
        """Load ``path`` in a thread of its own, unless it is loading; wait until the deadline."""
        with self._config_state:
            done = self._loading.get(path)
            if done is None:
                done = self._loading[path] = threading.Event()
                threading.Thread(
                    target=self._load_in_background,
                    args=(path, done),
                    name=f"tokenq-tokenizer-{self.client_id[:12]}",
                    daemon=True,
                ).start()
        done.wait(deadline.left())

    def _load_in_background(self, path: str, done: threading.Event) -> None:
        try:
            loaded: Any = load_estimator(path)
        except Exception as exc:  # load_estimator never raises; a bug must not strand waiters
            loaded = exc
        self._core.take_tokenizer(path, loaded)
        with self._config_state:
            self._loading.pop(path, None)
        done.set()
