"""SendPool: GET mode's copies of finished requests' KV on P, bounded by ``kv_buffer_size``.

When a producer request finishes, P copies its prompt blocks out of the paged cache into the
pool and frees the blocks at once; D pulls the copy later. When the copy does not fit, the pool
refuses it: the transfer is NACKed and D's ``kv_load_failure_policy`` applies. The pool never
evicts another request's KV to make room (the P2pNcclConnector's FIFO eviction silently lost
KV that D was about to pull). Entries leave on DONE, CANCEL or lease expiry.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PoolEntry:
    #: Per layer ``[2, num_blocks, block_size, heads, head_size]``: the request's blocks in
    #: block-table order (positions where P held the null block are zeros, never sent).
    layers: list[torch.Tensor]
    num_bytes: int


class SendPool:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: dict[str, PoolEntry] = {}
        self._lock = threading.Lock()

    def reserve(self, key: str, num_bytes: int) -> bool:
        """Claim room for ``key``'s copy; False (nothing changes) when it does not fit."""
        with self._lock:
            if key in self._entries or self.used_bytes + num_bytes > self.capacity_bytes:
                return False
            self.used_bytes += num_bytes
            self._entries[key] = PoolEntry([], num_bytes)
            return True

    def fill(self, key: str, layers: list[torch.Tensor]) -> bool:
        """Store ``key``'s copy in its reserved room; False if the entry is gone meanwhile
        (the transfer ended: popped by DONE, CANCEL or lease expiry)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.layers = layers
            return True

    def get(self, key: str) -> PoolEntry | None:
        with self._lock:
            return self._entries.get(key)

    def pop(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.used_bytes -= entry.num_bytes
