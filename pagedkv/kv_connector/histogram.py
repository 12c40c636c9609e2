"""HistogramStat: a histogram among a connector's stats (exported as a Prometheus histogram)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HistogramStat:
    #: Bucket upper bounds, ascending; a last bucket (+Inf) follows them.
    bounds: tuple[float, ...]
    #: Observations per bucket (not cumulative): ``len(bounds) + 1`` of them.
    counts: tuple[int, ...]
    total: float

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' ``le`` buckets: (bound, observations at or below it), +Inf last."""
        buckets, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return buckets


class Histogram:
    """Observations into fixed buckets; one writer thread, read by ``snapshot`` from any."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._total = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._total += value

    def snapshot(self) -> HistogramStat:
        return HistogramStat(self.bounds, tuple(self._counts), self._total)
