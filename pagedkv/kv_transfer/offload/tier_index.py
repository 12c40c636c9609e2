"""TierIndex: the scheduler half's record of one tier (host memory or a local directory).

Each entry is one block's KV under its store key (``store/block_codec.py``). An entry is
*pending* from the step that plans its store until the worker reports it stored (then *ready*:
loadable, and known to the eviction policy) or not (then gone). A ready entry with loads in
flight is *pinned*: it is never evicted, so a load never reads a slot or file being replaced.

Capacity counts pending and ready entries alike, so a tier never holds more than it may::

    reserve(k)  ->  pending  --complete(ok)-->  ready  --evict (policy's victim, unpinned)--> gone
                       |                          |
                       +--complete(not ok)--> gone +--discard (found bad at load)---------> gone

The host tier gives each entry a slot of its buffer; a disk entry is a file named by its key.
Events (``BlockStored`` / ``BlockRemoved`` with the tier's medium) follow ready entries only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.kv_cache.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.kv_transfer.offload.eviction import EVICTION_POLICIES


@dataclass(slots=True)
class TierEntry:
    group_id: int
    block_hash: bytes
    #: The host buffer's row (None on disk).
    slot: int | None
    ready: bool = False
    pins: int = 0
    #: The BlockStored to publish once ready (None once published).
    stored_event: BlockStored | None = None


class TierIndex:
    def __init__(
        self,
        name: str,
        medium: str,
        capacity_blocks: int,
        eviction: str,
        with_slots: bool,
        on_evict: Callable[[str, TierEntry], None] = lambda key, entry: None,
    ) -> None:
        self.name = name
        self.medium = medium
        self.capacity_blocks = capacity_blocks
        self.policy = EVICTION_POLICIES[eviction](capacity_blocks)
        self.entries: dict[str, TierEntry] = {}
        self._free_slots = list(range(capacity_blocks - 1, -1, -1)) if with_slots else None
        #: Called for each evicted entry (the disk tier deletes its file).
        self.on_evict = on_evict
        self.events: list[KVCacheEvent] = []
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def ready(self, key: str) -> TierEntry | None:
        entry = self.entries.get(key)
        return entry if entry is not None and entry.ready else None

    def reserve(
        self, key: str, group_id: int, block_hash: bytes, event: BlockStored
    ) -> TierEntry | None:
        """A pending entry for ``key`` (absent now), evicting if the tier is full; None when
        every entry is pending or pinned (the store is dropped)."""
        assert key not in self.entries, key
        if len(self.entries) >= self.capacity_blocks and not self._evict_one():
            return None
        slot = self._free_slots.pop() if self._free_slots is not None else None
        entry = TierEntry(group_id, block_hash, slot, stored_event=event)
        self.entries[key] = entry
        return entry

    def complete(self, key: str, ok: bool) -> None:
        """The worker reports the store of pending ``key``: ready, or gone."""
        entry = self.entries.get(key)
        if entry is None or entry.ready:
            return
        if not ok:
            self._drop(key, entry)
            return
        entry.ready = True
        self.policy.insert(key)
        if entry.stored_event is not None:
            self.events.append(entry.stored_event)
            entry.stored_event = None

    def add_ready(self, key: str, group_id: int, block_hash: bytes) -> bool:
        """An entry found already stored (the disk tier's files after a restart)."""
        if key in self.entries or (
            len(self.entries) >= self.capacity_blocks and not self._evict_one()
        ):
            return False
        self.entries[key] = TierEntry(group_id, block_hash, None)
        self.complete(key, True)  # no event stored: published below, as a plain hash
        self.events.append(BlockStored((block_hash,), None, (), 0, group_id, self.medium))
        return True

    def touch(self, key: str) -> None:
        self.policy.touch(key)

    def pin(self, key: str) -> None:
        self.entries[key].pins += 1

    def unpin(self, key: str) -> None:
        entry = self.entries.get(key)
        if entry is not None:
            entry.pins -= 1

    def discard(self, key: str) -> None:
        """``key`` was found bad (missing, corrupt, unreadable) at load: gone, no ghost."""
        entry = self.entries.get(key)
        if entry is None or entry.pins > 0:
            return
        if entry.ready:
            self.policy.remove(key, evicted=False)
            self.events.append(BlockRemoved((entry.block_hash,), entry.group_id, self.medium))
        self._drop(key, entry)

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def block_hashes(self, num_groups: int) -> list[list[bytes]]:
        """Ready entries' hashes per KV cache group (the KV-events snapshot)."""
        hashes: list[list[bytes]] = [[] for _ in range(num_groups)]
        for entry in self.entries.values():
            if entry.ready:
                hashes[entry.group_id].append(entry.block_hash)
        return hashes

    def _evict_one(self) -> bool:
        key = self.policy.victim(lambda k: self.entries[k].pins == 0)
        if key is None:
            return False
        entry = self.entries[key]
        self.policy.remove(key, evicted=True)
        self.events.append(BlockRemoved((entry.block_hash,), entry.group_id, self.medium))
        self._drop(key, entry)
        self.num_evictions += 1
        self.on_evict(key, entry)
        return True

    def _drop(self, key: str, entry: TierEntry) -> None:
        del self.entries[key]
        if entry.slot is not None:
            assert self._free_slots is not None
            self._free_slots.append(entry.slot)
