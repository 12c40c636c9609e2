"""RecentKeys: keys this instance stored or loaded lately, so it does not write them again."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable


class RecentKeys:
    """A bounded LRU of keys known to be in the store, each trusted for ``max_age_s`` (the store
    may evict or expire a key at any time; after that it is checked again)."""

    def __init__(self, capacity: int = 1 << 16, max_age_s: float = 60.0) -> None:
        self.capacity = capacity
        self.max_age_s = max_age_s
        self._added_at: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            added_at = self._added_at.get(key)
            if added_at is None:
                return False
            if time.monotonic() - added_at > self.max_age_s:
                del self._added_at[key]
                return False
            return True

    def add_many(self, keys: Iterable[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._added_at[key] = now
                self._added_at.move_to_end(key)
            while len(self._added_at) > self.capacity:
                self._added_at.popitem(last=False)

    def discard_many(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._added_at.pop(key, None)
