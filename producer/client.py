"""The synchronous producer client: enqueue texts, wait for their replies.

All decisions live in :mod:`tokenq.producer.core`; this module only talks to
Redis. Every wait is a loop of bounded BLPOPs (each shorter than the socket
timeout) that ends at the caller's deadline, so no call can hang; Redis being
unreachable until then is reported as :class:`BrokerUnavailable`, a missing
reply as :class:`ReplyTimeout`. A ``Client`` holds no per-call state, so one
instance may be shared by threads.

A caller's timeout is a promise, kept for every Redis command made on its
behalf (config read, enqueue, each BLPOP and LPOP): the calling thread's
deadline is put in :data:`~tokenq.producer.core.CALLER_DEADLINE`, and the
connection class, the pool and the ``Retry`` this client gives redis-py read
it, so a socket wait, a wait for a pooled connection, a reconnect or a retry
never outlasts the caller by more than ``DEADLINE_GRACE_S``. A connection
cut off that way is disconnected by redis-py, never reused mid-reply.

Before an enqueue the client makes sure its copy of the queue's config hash
is at most ``config_ttl_s`` old (one HGETALL when it is not), so that the
core can refuse what the workers would refuse (see
:mod:`tokenq.producer.config`); every other enqueue is one round trip. Of
concurrent callers that find the copy stale one reads and the others wait
for that read, each only until its own deadline; a read that fails leaves
the copy stale for the next call and its waiters carry on without it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import redis
from redis.retry import Retry

from tokenq.producer.config import DEFAULT_CONFIG_TTL_S
from tokenq.producer.core import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    CALLER_DEADLINE,
    ENQUEUE_SCRIPT,
    REDIS_DOWN,
    ClientCore,
    Deadline,
    DeadlinePoolWait,
    DeadlineTimeouts,
    EstimatorChoice,
    Outcome,
    Prepared,
    Result,
    TextItem,
    busy_as_down,
    deadline_bound,
    make_settings,
    retry_pause,
)
from tokenq.producer.tokenizer import load_estimator
from tokenq.shared.errors import BrokerUnavailable
from tokenq.shared.settings import ClientSettings

T = TypeVar("T")


def _now_ms() -> int:
    return int(time.time() * 1000)


class DeadlineRetry(Retry):
    """redis-py's ``Retry``, which never retries or backs off past the caller's deadline."""

    def call_with_retry(  # type: ignore[override]
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        self._backoff.reset()
        failures = 0
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                if 0 <= self._retries < failures:
                    raise error
                pause = retry_pause(self._backoff.compute(failures))
                if pause is None:
                    raise error
                if pause > 0:
                    time.sleep(pause)


class _BoundedSockets(DeadlineTimeouts):
    """Sets the socket's timeout before each command: a pooled socket keeps the last one."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):  # a dead socket: the send below reports it
                sock.settimeout(self.socket_timeout)
        super().send_packed_command(command, check_health)  # type: ignore[misc]


class _Pool(redis.ConnectionPool):
    """A connection pool whose connections wait no longer than their caller."""

    def __init__(self, connection_class: type = redis.Connection, **kwargs: Any) -> None:
        super().__init__(connection_class=deadline_bound(connection_class, _BoundedSockets),
                         **kwargs)


class _BlockingPool(DeadlinePoolWait, redis.BlockingConnectionPool):
    """The same, capped at ``max_connections``; waits for a free one end by the deadline."""

    def __init__(self, connection_class: type = redis.Connection, **kwargs: Any) -> None:
        super().__init__(connection_class=deadline_bound(connection_class, _BoundedSockets),
                         **kwargs)


class _ConfigRead:
    """One read of the config hash in flight; callers that need it wait on ``done``."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


class Client:
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
    """

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
        self._config_state = threading.Lock()  # held only to look at or update the cache
        self._config_read: _ConfigRead | None = None
        self._loading: dict[str, threading.Event] = {}
        self.client_id = self._core.new_id()
        options = self._core.connection_options(DeadlineRetry, self.client_id)
        if max_connections is None:
            pool: redis.ConnectionPool = _Pool.from_url(self.settings.redis_url, **options)
        else:
            pool = _BlockingPool.from_url(
                self.settings.redis_url,
                max_connections=max_connections,
                timeout=self.settings.timeout_s,
                **options,
            )
        self._redis = redis.Redis.from_pool(pool)
        self._enqueue_script = self._redis.register_script(ENQUEUE_SCRIPT)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every connection this client opened."""
        self._redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self._core.url!r}, queue={self._core.queue.name!r})"

    @property
    def queue(self) -> str:
        """The queue's name."""
        return self._core.queue.name

    @contextlib.contextmanager
    def _broker(self) -> Iterator[None]:
        """Report Redis being unreachable (after redis-py's retries) as BrokerUnavailable."""
        try:
            yield
        except REDIS_DOWN as exc:
            raise BrokerUnavailable(f"Redis at {self._core.url} is unreachable: {exc}") from exc

    def _deadline(self, timeout_s: float | None = None, *, persist: bool = False) -> Deadline:
        """The deadline of a call that has no ``timeout_s`` of its own: ``settings.timeout_s``."""
        return Deadline.after(self._core.timeout(timeout_s), persist=persist)

    def _command(
        self, deadline: Deadline, command: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """Run one Redis command for a caller, bounded by its deadline (see the module).

        Raises redis-py's ConnectionError or TimeoutError when Redis did not
        answer in time; with ``deadline.persist`` only once the deadline has
        passed, otherwise after redis-py's own retries.
        """
        token = CALLER_DEADLINE.set(deadline.at)
        failures = 0
        try:
            while True:
                try:
                    try:
                        return command(*args, **kwargs)
                    except redis.ResponseError as exc:
                        down = busy_as_down(exc)
                        if down is None:
                            raise
                        raise down from exc
                except REDIS_DOWN:
                    failures += 1
                    if not deadline.persist:
                        raise
                    self._pause(failures, deadline.at)
                    if deadline.remaining() <= 0:
                        raise
        finally:
            CALLER_DEADLINE.reset(token)

    # --------------------------------------------------------------- submit

    def submit(
        self,
        text: str,
        *,
        text_pair: str | None = None,
        deadline_s: float | None = None,
        deadline_ms: int | None = None,
        reply_to: str | None = None,
        opts: Mapping[str, Any] | None = None,
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
        deadline = self._deadline()
        self._ensure_config(deadline)
        prepared = self._core.prepare(
            text,
            now_ms=_now_ms(),
            text_pair=text_pair,
            deadline_s=deadline_s,
            deadline_ms=deadline_ms,
            reply_to=reply_to,
            opts=opts,
        )
        self._enqueue([prepared], deadline)
        return prepared.id

    def submit_many(
        self,
        texts: Iterable[TextItem],
        *,
        deadline_s: float | None = None,
        deadline_ms: int | None = None,
        reply_to: str | None = None,
        opts: Mapping[str, Any] | None = None,
    ) -> list[str]:
        """Enqueue a batch (texts or ``(text, text_pair)`` tuples) all or nothing.

        If the whole batch does not fit under the queue's limit, nothing is
        written and :class:`QueueFull` is raised.
        """
        deadline = self._deadline()
        self._ensure_config(deadline)
        batch = self._core.prepare_many(
            texts,
            now_ms=_now_ms(),
            deadline_s=deadline_s,
            deadline_ms=deadline_ms,
            reply_to=reply_to,
            opts=opts,
        )
        self._enqueue(batch, deadline)
        return [p.id for p in batch]

    def _ensure_config(self, deadline: Deadline) -> None:
        """Re-read the queue's config hash if the cached copy is older than ``config_ttl_s``.

        One caller reads; the others wait for its read until their own
        deadlines, then carry on with what the cache holds. Only the reader
        sees the read's failure (BrokerUnavailable): the cache stays stale,
        so the next call reads again.
        """
        with self._config_state:
            if not self._core.config_cache.due(time.monotonic()):
                return
            read = self._config_read
            leading = read is None
            if read is None:
                read = self._config_read = _ConfigRead()
        if not leading:
            read.done.wait(max(0.0, deadline.remaining()))
            return
        try:
            self._read_config(deadline, strict=False)
        finally:
            with self._config_state:
                self._config_read = None
            read.done.set()

    def _read_config(self, deadline: Deadline, *, strict: bool) -> dict[str, str]:
        """HGETALL the config hash into the cache, loading a newly named tokenizer.

        Not ``strict``: a refused read (an ACL without access to the hash)
        leaves the client without early checks instead of failing enqueues.
        """
        key = self._core.config_key
        with self._broker():
            try:
                raw = self._command(deadline, self._redis.hgetall, key)
            except redis.ResponseError as exc:
                if strict:
                    raise
                with self._config_state:
                    self._core.config_unreadable(exc, time.monotonic())
                return {}
        with self._config_state:
            path = self._core.take_config(raw, time.monotonic())
        if path is not None:
            self._load_tokenizer(path, deadline)
        return self._core.decode_config(raw)

    def _load_tokenizer(self, path: str, deadline: Deadline) -> None:
        """Load ``path`` in a thread of its own and wait for it until the deadline.

        A load that takes longer goes on without the caller, who carries on
        with the heuristic; whoever calls next finds the exact count, and a
        path already being loaded is not loaded twice.
        """
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
        done.wait(max(0.0, deadline.remaining()))

    def _load_in_background(self, path: str, done: threading.Event) -> None:
        try:
            loaded = load_estimator(path)
        except Exception as exc:  # load_estimator never raises; a bug must not strand waiters
            loaded = f"cannot load {path}: {exc}"
        with self._config_state:
            self._core.config_cache.take_tokenizer(path, loaded)
            self._loading.pop(path, None)
        done.set()

    def _enqueue(self, batch: Sequence[Prepared], deadline: Deadline | None = None) -> None:
        if not batch:
            return
        if deadline is None:
            deadline = self._deadline()
        keys = self._core.script_keys(batch)
        args = self._core.script_args(batch)
        with self._broker():
            try:
                # With ``persist`` a lost reply is retried with the same ids and
                # seen keys, which the script answers without adding anything.
                self._command(deadline, self._enqueue_script, keys=keys, args=args)
            except redis.OutOfMemoryError:
                raise self._core.broker_full(len(batch)) from None
            except redis.ResponseError as exc:
                full = self._core.queue_full(str(exc), len(batch))
                if full is not None:
                    raise full from None
                raise

    # -------------------------------------------------------------- results

    def result(self, request_id: str, timeout_s: float | None = None) -> Result:
        """Wait for the reply to ``request_id`` (from this or any other process).

        Raises the worker's error as :class:`RemoteError` (or
        :class:`DeadlineExceeded`), :class:`ReplyTimeout` when no reply comes
        in time. A reply is consumed by the first caller that fetches it.
        """
        return self.results([request_id], timeout_s)[0]

    def results(
        self,
        request_ids: Sequence[str],
        timeout_s: float | None = None,
        *,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Wait for the replies to several submitted requests; results in input order.

        One BLPOP watches every still-missing reply key, so waiting for many
        requests costs one connection. With ``return_exceptions`` errors are
        returned in place instead of the first being raised.
        """
        started = time.monotonic()
        timeout = self._core.timeout(timeout_s)
        wanted = self._core.reply_keys(request_ids)
        return self._wait_own_keys(request_ids, wanted, Deadline(started + timeout), started,
                                   return_exceptions)

    def _wait_own_keys(
        self,
        request_ids: Sequence[str],
        wanted: dict[str, str],
        deadline: Deadline,
        started: float,
        return_exceptions: bool,
    ) -> list[Any]:
        """BLPOP the requests' own reply keys until every reply is in or the deadline passed."""
        outcomes: dict[str, Outcome | Exception] = {}
        unreachable: BaseException | None = None
        failures = 0
        once = Deadline(deadline.at)  # each BLPOP once; this loop does the retrying
        while wanted:
            remaining = deadline.remaining()
            if remaining <= 0:
                break
            block = self._core.block_s(remaining)
            try:
                popped = self._command(once, self._redis.blpop, list(wanted), timeout=block)
            except REDIS_DOWN as exc:
                unreachable, failures = exc, failures + 1
                self._pause(failures, deadline.at)
                continue
            unreachable, failures = None, 0
            if popped is None:
                continue
            self._core.own_key_reply(wanted, *popped, outcomes)
        self._core.missing(list(wanted.values()), outcomes, time.monotonic() - started, unreachable)
        return self._core.settle(request_ids, outcomes, return_exceptions)

    @staticmethod
    def _pause(failures: int, deadline: float) -> None:
        """Back off after redis-py gave up on a connection, without passing the deadline."""
        delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**failures)
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))

    # ---------------------------------------------------------------- infer

    def infer(
        self,
        text: str,
        *,
        text_pair: str | None = None,
        timeout_s: float | None = None,
        deadline_s: float | None = None,
        deadline_ms: int | None = None,
        opts: Mapping[str, Any] | None = None,
    ) -> Result:
        """Enqueue one text and wait for its result.

        Returns or raises within ``timeout_s`` (plus a fraction of a second),
        whatever state Redis is in: an outage is retried until then and
        reported as :class:`BrokerUnavailable`, no answer as
        :class:`ReplyTimeout`. Unless a deadline is given, the request
        carries what is left of the timeout as its deadline, so no worker
        spends device time on an answer nobody waits for any more.
        """
        started = time.monotonic()
        deadline = Deadline(started + self._core.timeout(timeout_s), persist=True)
        self._ensure_config(deadline)
        deadline_s, deadline_ms = self._core.infer_deadline(
            deadline.remaining(), deadline_s, deadline_ms
        )
        prepared = self._core.prepare(
            text,
            now_ms=_now_ms(),
            text_pair=text_pair,
            deadline_s=deadline_s,
            deadline_ms=deadline_ms,
            opts=opts,
        )
        self._enqueue([prepared], deadline)
        wanted = {prepared.reply_to: prepared.id}
        results = self._wait_own_keys([prepared.id], wanted, deadline, started, False)
        return results[0]

    def infer_many(
        self,
        texts: Iterable[TextItem],
        *,
        timeout_s: float | None = None,
        return_exceptions: bool = False,
        deadline_s: float | None = None,
        deadline_ms: int | None = None,
        opts: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Enqueue a batch all or nothing and wait for every result, in input order.

        All replies of the call land on one shared reply key, drained with
        BLPOP then LPOP ``count``, and are matched by request id. Without
        ``return_exceptions`` the first failed item (in input order) is raised
        once every reply is in or the timeout has passed. Bounded by
        ``timeout_s`` as :meth:`infer` is.
        """
        started = time.monotonic()
        deadline = Deadline(started + self._core.timeout(timeout_s), persist=True)
        reply_key = self._core.reply_key(self._core.new_id())
        self._ensure_config(deadline)
        deadline_s, deadline_ms = self._core.infer_deadline(
            deadline.remaining(), deadline_s, deadline_ms
        )
        batch = self._core.prepare_many(
            texts,
            now_ms=_now_ms(),
            deadline_s=deadline_s,
            deadline_ms=deadline_ms,
            reply_to=reply_key,
            opts=opts,
        )
        self._enqueue(batch, deadline)
        ids = [p.id for p in batch]
        outcomes = self._drain(reply_key, set(ids), deadline, started)
        return self._core.settle(ids, outcomes, return_exceptions)

    def _drain(
        self, reply_key: str, pending: set[str], deadline: Deadline, started: float
    ) -> dict[str, Outcome | Exception]:
        """Collect replies for ``pending`` ids from one shared key until the deadline."""
        outcomes: dict[str, Outcome | Exception] = {}
        unreachable: BaseException | None = None
        failures = 0
        once = Deadline(deadline.at)  # each BLPOP once; this loop does the retrying
        while pending:
            remaining = deadline.remaining()
            if remaining <= 0:
                break
            block = self._core.block_s(remaining)
            raws: list[bytes] = []  # what was popped counts even if the LPOP fails
            try:
                popped = self._command(once, self._redis.blpop, [reply_key], timeout=block)
                if popped is not None:
                    raws.append(popped[1])
                    if len(pending) > 1:
                        more = self._command(once, self._redis.lpop, reply_key, len(pending) - 1)
                        raws += more or []
                unreachable, failures = None, 0
            except REDIS_DOWN as exc:
                unreachable, failures = exc, failures + 1
            for raw in raws:
                reply = self._core.decode(raw)
                if reply is None or reply.id not in pending:
                    continue  # a duplicate, or a reply for nobody: logged by decode or dropped
                pending.discard(reply.id)
                outcomes[reply.id] = self._core.outcome(reply)
            if failures and pending:
                self._pause(failures, deadline.at)
        self._core.missing(sorted(pending), outcomes, time.monotonic() - started, unreachable)
        return outcomes

    # ---------------------------------------------------------------- admin

    def queue_length(self) -> int:
        """How many requests the queue's stream holds (pending and in flight)."""
        with self._broker():
            return int(self._command(self._deadline(), self._redis.xlen, self._core.stream_key))

    def config(self) -> dict[str, str]:
        """The queue's config hash as workers published it (empty before any started).

        Reading it also refreshes the copy enqueues are checked against, so
        call this after changing a queue's workers to stop waiting out
        ``config_ttl_s``.
        """
        return self._read_config(self._deadline(), strict=True)
