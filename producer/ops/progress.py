"""``tokenq embed``'s progress bar, on stderr (stdout stays free for pipes): rich if
installed, else tqdm, else none."""

from __future__ import annotations

import sys
from collections.abc import Callable


def _draw_nothing(*_: object) -> None:
    """No bar (``--no-progress``, or neither rich nor tqdm installed)."""


class Progress:
    """Counts inputs done into a bar's ``update``; without one it draws nothing."""

    def __init__(self, update: Callable[[int], object] = _draw_nothing,
                 close: Callable[[], object] = _draw_nothing) -> None:
        self._update, self.close = update, close

    def advance(self, n: int) -> None:
        if n:
            self._update(n)


def progress_bar(total: int | None, enabled: bool) -> Progress:
    """A bar over ``total`` inputs (None: unknown, as for stdin); ``--no-progress``: none."""
    if not enabled:
        return Progress()
    try:
        import rich.console
        import rich.progress as rp
    except ImportError:
        try:
            from tqdm import tqdm
        except ImportError:
            return Progress()
        bar = tqdm(total=total, unit="input", desc="embed", file=sys.stderr)
        return Progress(bar.update, bar.close)
    rich_bar = rp.Progress(rp.TextColumn("embed"), rp.BarColumn(), rp.MofNCompleteColumn(),
                           rp.TimeElapsedColumn(), rp.TimeRemainingColumn(), transient=False,
                           console=rich.console.Console(stderr=True))
    task = rich_bar.add_task("embed", total=total)
    rich_bar.start()
    return Progress(lambda n: rich_bar.advance(task, n), rich_bar.stop)
