"""The synchronous producer client: enqueue texts, wait for their replies.

All decisions live in :mod:`tokenq.producer._core`; this module only talks to
Redis. Every wait is a loop of bounded BLPOPs (each shorter than the socket
timeout) that ends at the caller's deadline, so no call can hang; Redis being
unreachable until then is reported as :class:`BrokerUnavailable`, a missing
reply as :class:`ReplyTimeout`. A ``Client`` holds no per-call state, so one
instance may be shared by threads.

Before an enqueue the client makes sure its copy of the queue's config hash
is at most ``config_ttl_s`` old (one HGETALL when it is not), so that the
core can refuse what the workers would refuse (see
:mod:`tokenq.producer._config`); every other enqueue is one round trip.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.retry import Retry

from tokenq.producer._config import DEFAULT_CONFIG_TTL_S
from tokenq.producer._core import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    ENQUEUE_SCRIPT,
    REDIS_DOWN,
    ClientCore,
    EstimatorChoice,
    Outcome,
    Prepared,
    Result,
    TextItem,
    make_settings,
)
from tokenq.producer.tokenizer import load_estimator
from tokenq.shared.errors import BrokerUnavailable
from tokenq.shared.settings import ClientSettings


def _now_ms() -> int:
    return int(time.time() * 1000)


class Client:
    """A producer for one queue.

    Settings come from ``settings`` (or ``TOKENQ_*`` environment variables
    when omitted); keyword arguments that are not None override them.
    ``max_connections`` caps the Redis connection pool (default: one per
    concurrent thread).

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
        self._config_lock = threading.Lock()
        self.client_id = self._core.new_id()
        self._redis = redis.Redis.from_url(
            self.settings.redis_url,
            max_connections=max_connections,
            **self._core.connection_options(Retry, self.client_id),
        )
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

    @contextmanager
    def _broker(self) -> Iterator[None]:
        """Report Redis being unreachable (after redis-py's retries) as BrokerUnavailable."""
        try:
            yield
        except REDIS_DOWN as exc:
            raise BrokerUnavailable(f"Redis at {self._core.url} is unreachable: {exc}") from exc

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
        milliseconds) tells workers when the answer stops being useful.
        ``reply_to`` overrides the reply key (``result`` only reads the
        default one). Raises :class:`QueueFull` when the queue is at its
        limit and :class:`BadRequest` for invalid input; nothing is written
        in either case. :class:`InputTooLong` (a ``BadRequest``) means the
        queue's config rejects input that long.
        """
        self._ensure_config()
        prepared = self._core.prepare(
            text,
            now_ms=_now_ms(),
            text_pair=text_pair,
            deadline_s=deadline_s,
            deadline_ms=deadline_ms,
            reply_to=reply_to,
            opts=opts,
        )
        self._enqueue([prepared])
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
        self._ensure_config()
        batch = self._core.prepare_many(
            texts,
            now_ms=_now_ms(),
            deadline_s=deadline_s,
            deadline_ms=deadline_ms,
            reply_to=reply_to,
            opts=opts,
        )
        self._enqueue(batch)
        return [p.id for p in batch]

    def _ensure_config(self) -> None:
        """Re-read the queue's config hash if the cached copy is older than ``config_ttl_s``."""
        with self._config_lock:
            if self._core.config_cache.due(time.monotonic()):
                self._read_config(strict=False)

    def _read_config(self, *, strict: bool) -> dict[str, str]:
        """HGETALL the config hash into the cache, loading a newly named tokenizer.

        Not ``strict``: a refused read (an ACL without access to the hash)
        leaves the client without early checks instead of failing enqueues.
        """
        with self._broker():
            try:
                raw = self._redis.hgetall(self._core.config_key)
            except redis.ResponseError as exc:
                if strict:
                    raise
                self._core.config_unreadable(exc, time.monotonic())
                return {}
        path = self._core.take_config(raw, time.monotonic())
        if path is not None:
            self._core.config_cache.take_tokenizer(path, load_estimator(path))
        return self._core.decode_config(raw)

    def _enqueue(self, batch: Sequence[Prepared]) -> None:
        if not batch:
            return
        args = self._core.script_args(batch)
        with self._broker():
            try:
                self._enqueue_script(keys=self._core.script_keys(batch), args=args)
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
        timeout = self._core.timeout(timeout_s)
        started = time.monotonic()
        wanted = self._core.reply_keys(request_ids)
        outcomes: dict[str, Outcome | Exception] = {}
        unreachable: BaseException | None = None
        failures = 0
        while wanted:
            remaining = started + timeout - time.monotonic()
            if remaining <= 0:
                break
            try:
                popped = self._redis.blpop(list(wanted), timeout=self._core.block_s(remaining))
            except REDIS_DOWN as exc:
                unreachable, failures = exc, failures + 1
                self._pause(failures, started + timeout)
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

        Unless a deadline is given, the request carries the caller's timeout
        as its deadline, so no worker spends device time on an answer nobody
        waits for any more. (Workers compare it with their own clock; keep
        clocks in sync, or pass a generous ``deadline_s``.)
        """
        started = time.monotonic()
        timeout = self._core.timeout(timeout_s)
        deadline_s, deadline_ms = self._core.infer_deadline(timeout, deadline_s, deadline_ms)
        request_id = self.submit(
            text, text_pair=text_pair, deadline_s=deadline_s, deadline_ms=deadline_ms, opts=opts
        )
        remaining = max(started + timeout - time.monotonic(), 0.001)
        return self.result(request_id, remaining)

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
        once every reply is in or the timeout has passed.
        """
        started = time.monotonic()
        timeout = self._core.timeout(timeout_s)
        deadline_s, deadline_ms = self._core.infer_deadline(timeout, deadline_s, deadline_ms)
        reply_key = self._core.reply_key(self._core.new_id())
        self._ensure_config()
        batch = self._core.prepare_many(
            texts,
            now_ms=_now_ms(),
            deadline_s=deadline_s,
            deadline_ms=deadline_ms,
            reply_to=reply_key,
            opts=opts,
        )
        self._enqueue(batch)
        ids = [p.id for p in batch]
        outcomes = self._drain(reply_key, set(ids), started + timeout, started)
        return self._core.settle(ids, outcomes, return_exceptions)

    def _drain(
        self, reply_key: str, pending: set[str], deadline: float, started: float
    ) -> dict[str, Outcome | Exception]:
        """Collect replies for ``pending`` ids from one shared key until the deadline."""
        outcomes: dict[str, Outcome | Exception] = {}
        unreachable: BaseException | None = None
        failures = 0
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                popped = self._redis.blpop([reply_key], timeout=self._core.block_s(remaining))
                raws = [] if popped is None else [popped[1]]
                if popped is not None and len(pending) > 1:
                    raws += self._redis.lpop(reply_key, len(pending) - 1) or []
            except REDIS_DOWN as exc:
                unreachable, failures = exc, failures + 1
                self._pause(failures, deadline)
                continue
            unreachable, failures = None, 0
            for raw in raws:
                reply = self._core.decode(raw)
                if reply is None or reply.id not in pending:
                    continue  # a duplicate, or a reply for nobody: logged by decode or dropped
                pending.discard(reply.id)
                outcomes[reply.id] = self._core.outcome(reply)
        self._core.missing(sorted(pending), outcomes, time.monotonic() - started, unreachable)
        return outcomes

    # ---------------------------------------------------------------- admin

    def queue_length(self) -> int:
        """How many requests the queue's stream holds (pending and in flight)."""
        with self._broker():
            return int(self._redis.xlen(self._core.stream_key))

    def config(self) -> dict[str, str]:
        """The queue's config hash as workers published it (empty before any started).

        Reading it also refreshes the copy enqueues are checked against, so
        call this after changing a queue's workers to stop waiting out
        ``config_ttl_s``.
        """
        with self._config_lock:
            return self._read_config(strict=True)
