"""The packer's line (rule 1's order), with requests taken out lazily: a removed entry stays,
skipped, until the head passes it or removed ones outnumber live ones plus :data:`SLACK`.
Which sequences are live is the packer's mapping to say."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection, Iterator

Entry = tuple[float, int]
"""(virtual arrival, sequence): the line's order; sequences are unique."""
SLACK = 64
"""Removed entries tolerated beyond the live count before the list is rebuilt."""


class ArrivalLine:
    """Live sequences in line order; ``live`` says which sequences are still buffered."""

    def __init__(self, live: Collection[int]) -> None:
        self._live = live
        self._entries: list[Entry] = []
        """Ascending; entries whose sequence is not in ``live`` are removed ones."""
        self._start = 0
        """Every entry before this index is a removed one."""
        self._removed = 0
        """How many removed entries the list still holds."""

    def add(self, entries: list[Entry]) -> None:
        """Put requests in line (their sequences must already be live)."""
        line = self._entries
        if len(entries) == 1:  # one: a bisection, not a pass over the line
            position = bisect.bisect_left(line, entries[0])
            line.insert(position, entries[0])
            self._start = min(self._start, position)
        else:  # appended, then one sort: about one pass over an already sorted line
            line += entries
            line.sort()
            self._start = 0

    def removed(self, count: int) -> None:
        """``count`` requests left the buffer; rebuild when removed ones are too many."""
        self._removed += count
        if self._removed > len(self._live) + SLACK:
            live = self._live
            self._entries = [entry for entry in self._entries if entry[1] in live]
            self._start = self._removed = 0

    def head(self) -> int | None:
        """The first live sequence in line, or None when nothing is buffered."""
        line, live, start = self._entries, self._live, self._start
        end = len(line)
        while start < end and line[start][1] not in live:
            start += 1
        self._start = start
        return line[start][1] if start < end else None

    def seqs(self) -> Iterator[int]:
        """Live sequences in line order, from the head."""
        self.head()  # moves the start past removed entries at the front
        live = self._live
        return (seq for _, seq in itertools.islice(self._entries, self._start, None)
                if seq in live)

    def entries(self) -> list[Entry]:
        """The live entries, in order (a copy: for views and tests)."""
        live = self._live
        return [entry for entry in self._entries if entry[1] in live]

    def held(self) -> int:
        """Entries the list holds, removed ones included (the bound tests check)."""
        return len(self._entries)
