"""``tokenq embed``'s progress bar, on stderr (stdout stays free for pipes): rich if
installed, else tqdm, else none."""

from __future__ import annotations

import sys
from collections.abc import Callable


class Progress:
    """Counts inputs done into a bar's ``update``; without one it draws nothing."""

    def __init__(self, update: Callable[[int], object] | None = None,
                 close: Callable[[], object] | None = None) -> None:
        self._update, self._close = update, close

    def advance(self, n: int) -> None:
        if n and self._update is not None:
            self._update(n)

    def close(self) -> None:
        if self._close is not None:
            self._close()


def _rich(total: int | None) -> Progress:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as Bar

    bar = Bar(TextColumn("embed"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
              TimeRemainingColumn(), transient=False, console=Console(stderr=True))
    task = bar.add_task("embed", total=total)
    bar.start()
    return Progress(lambda n: bar.advance(task, n), bar.stop)


def _tqdm(total: int | None) -> Progress:
    from tqdm import tqdm

    bar = tqdm(total=total, unit="input", desc="embed", file=sys.stderr)
    return Progress(bar.update, bar.close)


def progress_bar(total: int | None, enabled: bool) -> Progress:
    """A bar over ``total`` inputs (None: unknown, as for stdin); ``--no-progress``: none."""
    if enabled:
        for kind in (_rich, _tqdm):
            try:
                return kind(total)
            except ImportError:
                continue
    return Progress()
