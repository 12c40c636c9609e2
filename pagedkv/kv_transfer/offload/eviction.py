"""Eviction policies of an offload tier: which resident key a full tier gives up next.

A policy tracks residency order only; the tier owns capacity, pins and bytes. The tier's
protocol, all calls O(1) amortized (``victim`` also steps over the pinned keys it meets)::

    on a hit:   policy.touch(key)
    on a store: while the tier is full: key_out = policy.victim(can_evict); drop key_out's
                bytes; policy.remove(key_out)          # no victim: the store is dropped
                policy.insert(key)
    on a bad entry (corrupt, vanished): policy.remove(key, evicted=False)

Residents never exceed ``capacity``: ``insert`` into a full policy raises ``ValueError``.

``ARCPolicy`` is the Adaptive Replacement Cache of Megiddo & Modha (FAST 2003): T1 holds keys
seen once recently, T2 keys seen at least twice; the ghost lists B1 / B2 remember keys evicted
from T1 / T2 (keys only, no bytes). A store of a key found in B1 grows the target size ``p`` of
T1 (recency was under-served), one found in B2 shrinks it; either way the key goes to T2.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


def _first_evictable(keys: Iterable[K], can_evict: Callable[[K], bool]) -> K | None:
    """The first key of ``keys`` (least recent first) that ``can_evict`` allows."""
    for key in keys:
        if can_evict(key):
            return key
    return None


class EvictionPolicy(ABC, Generic[K]):
    """Which resident key a full tier gives up next. Tracks residency order only; capacity is
    the tier's."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"an eviction policy needs a capacity >= 1 entry, got {capacity!r}")
        #: Entries the tier holds at most (ARC's c).
        self.capacity = capacity

    def insert(self, key: K) -> None:
        """``key`` became resident (it was not)."""
        if key in self:
            raise ValueError(f"{key!r} is already resident")
        if len(self) >= self.capacity:
            raise ValueError(
                f"{self.capacity} entries resident: evict (victim, remove) before inserting"
            )
        self._insert(key)

    @abstractmethod
    def _insert(self, key: K) -> None: ...

    @abstractmethod
    def touch(self, key: K) -> None:
        """Resident ``key`` was hit (read). ``KeyError`` if it is not resident."""

    @abstractmethod
    def remove(self, key: K, evicted: bool = True) -> None:
        """Resident ``key`` left the tier; a no-op if it is not resident. ``evicted``: the tier
        gave it up to make room (ARC remembers it in a ghost list); False when it was found bad
        and dropped (no ghost)."""

    @abstractmethod
    def victim(self, can_evict: Callable[[K], bool]) -> K | None:
        """The resident key to evict next among those ``can_evict`` allows (pinned ones are
        skipped), without removing it; None if every resident key is pinned (or none)."""

    @abstractmethod
    def __len__(self) -> int:
        """Resident keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """``key`` is resident."""


class LRUPolicy(EvictionPolicy[K]):
    """Least recently used: the victim is the unpinned key inserted or touched longest ago."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        #: Resident keys, least recent first.
        self._keys: OrderedDict[K, None] = OrderedDict()

    def _insert(self, key: K) -> None:
        self._keys[key] = None

    def touch(self, key: K) -> None:
        self._keys.move_to_end(key)

    def remove(self, key: K, evicted: bool = True) -> None:
        self._keys.pop(key, None)

    def victim(self, can_evict: Callable[[K], bool]) -> K | None:
        return _first_evictable(self._keys, can_evict)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


class ARCPolicy(EvictionPolicy[K]):
    """Adaptive Replacement Cache. Invariants (c = capacity): |T1| + |T2| = residents <= c,
    |T1| + |B1| <= c, |T1| + |T2| + |B1| + |B2| <= 2c, 0 <= p <= c.

    ARC's REPLACE runs when a miss is being stored, knowing the incoming key; here the tier asks
    for a victim before it inserts, so two choices differ from the paper:

    - ``victim`` takes T1's least recent evictable key when |T1| >= p (the paper evicts from T1
      on |T1| = p only when the incoming key is in B2). Ties thus go against keys seen once,
      which keeps the frequently reused set through a scan.
    - ``insert`` adapts ``p`` after that eviction, not before it: the new target steers the
      next victim.

    When the preferred list has no evictable key, the other list gives one (pinned keys stay).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Each list least recent first.
        self.t1: OrderedDict[K, None] = OrderedDict()
        self.t2: OrderedDict[K, None] = OrderedDict()
        self.b1: OrderedDict[K, None] = OrderedDict()
        self.b2: OrderedDict[K, None] = OrderedDict()
        #: Target size of T1, in entries.
        self.p = 0.0

    def _insert(self, key: K) -> None:
        c = self.capacity
        if key in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self._make_room_for_new_ghost()
            self.t1[key] = None

    def _make_room_for_new_ghost(self) -> None:
        """Before a new key enters T1: keep |T1| + |B1| <= c and the total <= 2c. A resident
        slot is free (``insert`` checked), so a full L1 = T1 + B1 has a ghost in B1 to drop and
        a full total has one in B2."""
        c = self.capacity
        if len(self.t1) + len(self.b1) >= c:
            self.b1.popitem(last=False)
        elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c:
            self.b2.popitem(last=False)

    def touch(self, key: K) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        else:
            self.t2.move_to_end(key)

    def remove(self, key: K, evicted: bool = True) -> None:
        if key in self.t1:
            del self.t1[key]
            if evicted:
                self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            if evicted:
                self.b2[key] = None

    def victim(self, can_evict: Callable[[K], bool]) -> K | None:
        if self.t1 and len(self.t1) >= self.p:
            first, second = self.t1, self.t2
        else:
            first, second = self.t2, self.t1
        key = _first_evictable(first, can_evict)
        return key if key is not None else _first_evictable(second, can_evict)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}
