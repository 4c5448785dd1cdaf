"""The synchronous producer client: the blocking driver of :mod:`tokenq.producer.calls`, each
command run in the calling thread under the caller's deadline (:mod:`.redis_deadlines`)."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from tokenq.producer import calls, nodes, redis_deadlines
from tokenq.producer.core import ClientCore, ProducerBase
from tokenq.producer.deadline import Deadline
from tokenq.shared import functions

T = TypeVar("T")
P = ParamSpec("P")


def blocking(
    call: Callable[Concatenate[ClientCore, P], calls.Call[T]],
) -> Callable[Concatenate[Client, P], T]:
    """The method of :class:`Client` that performs ``call`` in the calling thread."""

    def method(self: Client, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(call(self._core, *args, **kwargs))

    functools.update_wrapper(method, call)
    return method


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
        self._config_read = threading.Lock()  # held by the thread reading the config hash
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

    submit = blocking(calls.submit)
    submit_many = blocking(calls.submit_many)
    result = blocking(calls.result)
    results = blocking(calls.results)
    forget = blocking(calls.forget)
    infer = blocking(calls.infer)
    infer_many = blocking(calls.infer_many)
    workers_alive = blocking(calls.workers_alive)
    queue_length = blocking(calls.queue_length)
    pending_tokens = blocking(calls.pending_tokens)
    config = blocking(calls.config)

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
        """Read the config hash in this thread unless another thread's read is under way: wait
        for that (until the deadline), then read only if it did not succeed."""
        if not self._config_read.acquire(timeout=deadline.left()):
            return
        try:
            if self._core.config.due(time.monotonic()):
                self._run(calls.read_config(self._core, deadline, strict=False))
        finally:
            self._config_read.release()
