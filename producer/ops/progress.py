"""The progress bar of ``tokenq embed``: rich if installed, else tqdm, else none.

It always draws on **stderr**: stdout stays free for whatever a script pipes
on, and the bar never lands in a file the operator redirected stdout to.
The caller advances it as results arrive, whichever group they belong to.
"""

from __future__ import annotations

import sys
from typing import Protocol


class Progress(Protocol):
    """What ``embed`` needs of a bar: count inputs done, and stop drawing."""

    def advance(self, n: int) -> None: ...

    def close(self) -> None: ...


class _NoProgress:
    def advance(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _RichProgress:
    def __init__(self, total: int | None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        self._bar = Bar(TextColumn("embed"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TimeRemainingColumn(), transient=False,
                        console=Console(stderr=True))
        self._task = self._bar.add_task("embed", total=total)
        self._bar.start()

    def advance(self, n: int) -> None:
        if n:
            self._bar.advance(self._task, n)

    def close(self) -> None:
        self._bar.stop()


class _TqdmProgress:
    def __init__(self, total: int | None) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="input", desc="embed", file=sys.stderr)

    def advance(self, n: int) -> None:
        if n:
            self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


def progress_bar(total: int | None, enabled: bool) -> Progress:
    """A bar over ``total`` inputs (None: unknown, as for stdin); ``--no-progress``: none."""
    if not enabled:
        return _NoProgress()
    for kind in (_RichProgress, _TqdmProgress):
        try:
            return kind(total)
        except ImportError:
            continue
    return _NoProgress()
