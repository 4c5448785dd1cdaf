"""Keeping the device fed: the packer behind a lock, and a thread that takes the next batch the
moment the last finishes; results settle on the loop in order, one wake-up pending at a time."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from tokenq.shared.packer import Batch, Packer

if TYPE_CHECKING:
    from tokenq.worker.pipeline.pipeline import Job

T = TypeVar("T")
R = TypeVar("R")


def monotonic_ms() -> float:
    """The packer's clock: monotonic milliseconds."""
    return time.monotonic() * 1000.0


async def wait_event(event: asyncio.Event, timeout: float | None) -> None:
    """Wait for ``event`` at most ``timeout`` seconds (forever when None)."""
    if timeout is None:
        await event.wait()
        return
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


class Aborted(RuntimeError):
    """A thread's or task's work raised a BaseException that is not an ``Exception``."""


def ordinary(exc: BaseException, who: str = "the device thread") -> Exception:
    """``exc`` when it is an ordinary ``Exception``; else an :class:`Aborted` carrying it."""
    if isinstance(exc, Exception):
        return exc
    aborted = Aborted(f"{who} stopped on {type(exc).__name__}: {exc}")
    aborted.__cause__ = exc
    return aborted


def in_thread(call: Callable[..., R], *args: Any) -> R:
    """``call(*args)``, for a thread off the event loop: a non-``Exception`` it raises
    comes out as :func:`ordinary` makes it (no signal is ever delivered to such a thread)."""
    try:
        return call(*args)
    except Exception:
        raise
    except BaseException as exc:
        raise ordinary(exc, f"{call.__name__} in a thread") from exc


_TAKEN = object()
"""The inbox's message that a batch left the packer (the loop then calls ``Rules.taken``)."""
_FINISHED = object()
"""The device thread's last message when it finished; when it failed, the error is its last."""


class Rules:
    """What the device thread asks the feed's owner (reads of flags only); the defaults: linger,
    never finish, always take. ``taken``, when set, runs on the loop as a batch leaves the packer.
    """

    taken: Callable[[], None] | None = None

    def flushing(self) -> bool:
        """No lingering: every batch goes as soon as it is packed."""
        return False

    def finished(self) -> bool:
        """No more input comes: the thread ends once nothing is left to take."""
        return False

    def may_take(self) -> bool:
        """Take the next batch now (False: hold back until :meth:`DeviceFeed.wake`)."""
        return True

    def prune(self) -> None:
        """Drop abandoned input from the packer (under the feed's lock)."""


class DeviceFeed(Generic[T, R]):
    """A packer shared by the event loop (which adds) and a device thread (which takes):
    ``execute(batch)`` runs in the thread, :meth:`run`'s ``settle`` gets its result on the loop."""

    def __init__(
        self, packer: Packer[T], execute: Callable[[Batch[T]], R], rules: Rules, *,
        max_unsettled: int = 4, name: str = "tokenq-device",
    ) -> None:
        self.packer = packer
        self._execute = execute
        self._rules = rules
        self._name = name
        self._lock = threading.Condition()
        self._unsettled = threading.Semaphore(max_unsettled)
        self._running: Batch[T] | None = None
        self._unsettled_batches: list[Batch[T]] = []
        """Batches whose results are on their way to ``settle`` (still held, not answered)."""
        self._cancelled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._results: asyncio.Queue[tuple[Batch[T], R] | object] | None = None
        self._inbox: collections.deque[object] = collections.deque()
        """Messages from the device thread the loop has not read yet (under the lock)."""
        self._wake_pending = False
        """A wake-up to read the inbox is on its way to the loop (under the lock)."""

    # ------------------------------------------------------- event loop side

    def add(self, jobs: Iterable[Job[Any]]) -> None:
        """Buffer pipeline jobs (their exact length, arrival and priority) and wake the thread."""
        requests = [(job.encoding.length, job.arrived_ms, job, job.request.priority)
                    for job in jobs]
        with self._lock:
            self.packer.add_all(requests)
            self._lock.notify()

    def wake(self) -> None:
        """Make the device thread look again (a flag it reads changed)."""
        with self._lock:
            self._lock.notify()

    def remove_where(self, predicate: Callable[[T], bool]) -> list[T]:
        """Take out every buffered payload that matches."""
        with self._lock:
            return [item.payload for item in self.packer.remove_where(predicate)]

    def held(self) -> list[T]:
        """Every payload buffered, on the device, or ran and not settled (a snapshot); whoever
        stops the feed answers them."""
        with self._lock:
            held = [item.payload for item in self.packer]
            for batch in (self._running, *self._unsettled_batches):
                if batch is not None:
                    held += batch.payloads
            return held

    async def run(self, settle: Callable[[Batch[T], R], Awaitable[None]]) -> None:
        """Start the device thread and settle its results until it finishes."""
        self._loop = asyncio.get_running_loop()
        self._results = asyncio.Queue()
        self._cancelled = False
        with self._lock:  # a run cancelled before left its messages: they were dropped
            self._inbox.clear()
            self._wake_pending = False
        thread = threading.Thread(target=self._device_thread, name=self._name, daemon=True)
        thread.start()
        try:
            while True:
                item = await self._results.get()
                if not isinstance(item, tuple):
                    thread.join()  # its last message was its last act: this returns at once
                    if isinstance(item, Exception):
                        raise item
                    return
                try:
                    await settle(*item)
                finally:
                    with self._lock:
                        self._unsettled_batches.remove(item[0])
                    self._unsettled.release()
        finally:
            with self._lock:
                self._cancelled = True
                self._lock.notify()
            self._unsettled.release()  # in case the thread waits for room

    # ---------------------------------------------------------- device thread

    def _device_thread(self) -> None:
        last: object = _FINISHED
        try:
            while True:
                self._unsettled.acquire()
                batch = self._next()
                if batch is None:
                    break
                if self._rules.taken is not None:
                    self._send(_TAKEN)
                started = time.perf_counter()
                try:
                    result = self._execute(batch)
                except BaseException:
                    with self._lock:  # never answered: held() keeps it for whoever stops
                        self._running = None
                        self._unsettled_batches.append(batch)
                    raise
                elapsed_ms = (time.perf_counter() - started) * 1000.0
                with self._lock:
                    self._running = None
                    self._unsettled_batches.append(batch)
                    self.packer.observe(batch.cost, elapsed_ms)
                if not self._send((batch, result)):
                    return
        except BaseException as exc:  # the loop raises it: a worker failure, not a request's
            last = ordinary(exc)
        self._send(last)

    def _next(self) -> Batch[T] | None:
        """Wait for the packer's next batch; None once finished (or cancelled)."""
        rules = self._rules
        with self._lock:
            while not self._cancelled:
                rules.prune()
                if not rules.may_take():
                    if rules.finished():
                        return None
                    self._lock.wait()  # until wake(): room made
                    continue
                now = monotonic_ms()
                batch = self.packer.next_batch(now, flush=rules.flushing())
                if batch is not None:
                    self._running = batch
                    return batch
                if rules.finished():
                    return None
                ready = self.packer.ready_at()
                self._lock.wait(None if ready is None else max(0.0, (ready - now) / 1000.0))
            return None

    def _send(self, message: object) -> bool:
        """Put ``message`` in the loop's inbox, waking the loop unless a wake-up is already
        on its way; False when the loop is gone (or the feed was cancelled)."""
        loop = self._loop
        if loop is None or self._cancelled:
            return False
        with self._lock:
            self._inbox.append(message)
            wake, self._wake_pending = not self._wake_pending, True
        if not wake:
            return True
        try:
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop closed under us
            return False
        return True

    def _deliver(self) -> None:
        """On the loop: act on every message in the inbox, in the order sent."""
        with self._lock:
            messages = list(self._inbox)
            self._inbox.clear()
            self._wake_pending = False
        for message in messages:
            if message is _TAKEN:
                self._rules.taken()  # type: ignore[misc]  # sent only when it is set
            else:
                self._results.put_nowait(message)  # type: ignore[union-attr, arg-type]
