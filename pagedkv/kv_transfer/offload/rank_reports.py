"""RankReports: the offloading connector's scheduler half counting its ranks' reports.

Under tensor parallelism each rank stores and loads its own KV heads of a block, and reports
each store (``OffloadReport.stores``) and each load's time on its own, possibly in different
steps. A block is in a tier only once every rank stored its part: a store ends when the last
rank reports it, stored if every rank stored it. A load ends when the executor reports it in
``finished_recving`` (once every rank has); its time is the longest rank's.
"""

from __future__ import annotations

from collections.abc import Iterable


class RankReports:
    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        #: (tier, key) -> (ranks that reported its store so far, whether each stored it).
        self._stores: dict[tuple[str, str], tuple[int, bool]] = {}
        #: Request id -> the longest time a rank's load took, until the load ends.
        self._load_seconds: dict[str, float] = {}

    def stores_ended(self, stores: Iterable[tuple[str, str, bool]]) -> list[tuple[str, str, bool]]:
        """The stores that every rank has now reported: ``(tier, key, stored everywhere)``."""
        ended = []
        for tier, key, ok in stores:
            count, all_ok = self._stores.pop((tier, key), (0, True))
            count, all_ok = count + 1, all_ok and ok
            if count == self.num_ranks:
                ended.append((tier, key, all_ok))
            else:
                self._stores[tier, key] = (count, all_ok)
        return ended

    def loads_ended(self, load_seconds: dict[str, float], finished: Iterable[str]) -> list[float]:
        """Record this step's load times; the longest time of each load in ``finished``."""
        for req_id, seconds in load_seconds.items():
            self._load_seconds[req_id] = max(seconds, self._load_seconds.get(req_id, 0.0))
        return [s for req_id in finished if (s := self._load_seconds.pop(req_id, None)) is not None]
