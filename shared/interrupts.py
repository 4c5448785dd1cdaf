"""Ctrl-C as a recorded fact, not only as an exception.

Why: a ``KeyboardInterrupt`` raised while a library is running one of its
callbacks can come out as that library's own error. pydantic's serializer
does this: a Ctrl-C landing inside ``model_dump`` surfaces as
``PydanticSerializationError: Error calling function ...: KeyboardInterrupt``,
and a command that only catches ``KeyboardInterrupt`` then prints a traceback
and exits 1 instead of 130 (``tokenq embed`` did, in CI). So a command
records that the signal came (:class:`InterruptRecord`) and, inside
:func:`unwrapped`, any error raised after it is the interruption.
"""

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
        """The signal handler: record the interrupt, then raise it as Python's default would."""
        self.seen = True
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Handle SIGINT with :meth:`interrupt` for the block, where Python's default handles it.

        Only from the main thread (the only one that may set handlers), and
        never over a handler someone else installed: a command with its own
        (``tokenq worker``, ``tokenq embed``) installs it inside the block.
        """
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
    """Any error escaping the block once ``interrupted()`` holds is re-raised as the interrupt.

    The original error is kept as the cause, for a debugger; the command's
    answer is the interrupted one (exit 130, its resume hint), whatever a
    library turned the ``KeyboardInterrupt`` into on its way out.
    """
    try:
        yield
    except Exception as exc:
        if not interrupted():
            raise
        raise KeyboardInterrupt(f"interrupted (surfaced as {type(exc).__name__})") from exc
