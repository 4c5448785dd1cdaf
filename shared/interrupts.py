"""Ctrl-C as a recorded fact: a library may wrap a ``KeyboardInterrupt`` in its own error
(pydantic's serializer does), so after a recorded SIGINT any error is the interruption."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NoReturn


class InterruptRecord:
    """Whether a SIGINT reached this command, with the handler that records it."""

    def __init__(self) -> None:
        self.seen = False

    def interrupt(self, signum: int, frame: FrameType | None) -> NoReturn:
        """The handler: record the interrupt, then raise it as Python's default would."""
        self.seen = True
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Handle SIGINT with :meth:`interrupt` for the block, from the main thread and only
        over Python's default handler."""
        if (threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
            yield
            return
        previous = signal.signal(signal.SIGINT, self.interrupt)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def unwrapped(interrupted: Callable[[], bool]) -> Iterator[None]:
    """Any error escaping the block once ``interrupted()`` holds is re-raised as the interrupt."""
    try:
        yield
    except Exception as exc:
        if not interrupted():
            raise
        raise KeyboardInterrupt(f"interrupted (surfaced as {type(exc).__name__})") from exc
