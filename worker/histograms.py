"""A Prometheus histogram that takes a whole batch of observations in one call."""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any


class BatchHistogram:
    """A histogram series fed in bulk; register it on a ``CollectorRegistry``."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float],
        labels: dict[str, str], registry: Any,
    ) -> None:
        bounds = sorted(float(b) for b in buckets if not math.isinf(b))
        if not bounds:
            raise ValueError(f"{name}: a histogram needs at least one finite bucket")
        self.name = name
        self._doc = documentation
        self._bounds = bounds
        self._labels = dict(labels)
        self._counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: Iterable[float]) -> None:
        """Add every value (scraped from another thread: one lock for the whole call)."""
        bounds, place = self._bounds, bisect.bisect_left
        with self._lock:
            counts = self._counts
            total = 0.0
            for value in values:
                counts[place(bounds, value)] += 1  # first bound >= value: Prometheus's le
                total += value
            self._sum += total

    def describe(self) -> list[Any]:
        """The family without samples, so the registry can refuse a duplicate name."""
        from prometheus_client.core import HistogramMetricFamily

        return [HistogramMetricFamily(self.name, self._doc, labels=list(self._labels))]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip([*self._bounds, math.inf], counts, strict=True):
            running += count
            cumulative.append((floatToGoString(bound), running))
        family = HistogramMetricFamily(self.name, self._doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), cumulative, total)
        yield family
