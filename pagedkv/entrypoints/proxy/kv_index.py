"""KVIndex: which instances' prefix caches hold which blocks, mirrored from their KV events.

Block hashes are chained (a block's hash covers its whole prefix) and equal across processes,
so a map ``block hash -> instances`` is enough: an instance's cached prefix of a prompt is the
run of the prompt's block hashes, from the first, that it holds::

    prompt hashes   h0   h1   h2   h3
    instance A      ✓    ✓    ✓    ·      -> 3 blocks cached
    instance B      ✓    ·    ✓    ✓      -> 1 (h2 alone is useless: its prefix is gone)

An instance holds a hash when every one of its KV cache groups does (``num_groups``, from its
registration), as the instance's own lookup requires. Per instance the index keeps how many
blocks of each (group, hash) are cached (an instance may cache two blocks under one hash), so
the mirror is exact: ``cached(name)`` equals the pool's ``cached_block_hashes()``.

Blocks on their way: once the router sends a prompt to an instance, the prompt's full blocks
will be cached there within a step or so, but their event comes only then. ``expect`` counts
them as held meanwhile (until their ``BlockStored``, a ``BlockRemoved``, or ``EXPECT_TTL_S``),
so requests that share a prefix and arrive together go where it is being computed, as a
text-based router's would. Written by the subscriber thread and the event loop: one lock, held
for short operations only.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence

from pagedkv.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, WireEvent

BlockKey = tuple[int, bytes]  # (group, hash)
#: How long a block the router sent somewhere counts as held there without its event.
EXPECT_TTL_S = 10.0


class KVIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: hash -> instance -> number of its groups that hold the hash
        self._holders: dict[bytes, dict[str, int]] = {}
        #: instance -> (group, hash) -> number of its blocks cached under that key
        self._blocks: dict[str, Counter[BlockKey]] = {}
        self._num_groups: dict[str, int] = {}
        #: instance -> hash -> until when it counts as held (expected, no event yet)
        self._expected: dict[str, dict[bytes, float]] = {}
        self._expiry: deque[tuple[float, str, bytes]] = deque()

    def set_num_groups(self, name: str, num_groups: int) -> None:
        with self._lock:
            self._num_groups[name] = num_groups

    def expect(self, name: str, block_hashes: Sequence[bytes]) -> None:
        """``name`` was sent a prompt with these full blocks: count them as held there."""
        now = time.monotonic()
        until = now + EXPECT_TTL_S
        with self._lock:
            while self._expiry and self._expiry[0][0] <= now:
                _, stale_name, block_hash = self._expiry.popleft()
                expected = self._expected.get(stale_name)
                if expected is not None and expected.get(block_hash, until) <= now:
                    del expected[block_hash]
            expected = self._expected.setdefault(name, {})
            for block_hash in block_hashes:
                expected[block_hash] = until
                self._expiry.append((until, name, block_hash))

    # ------------------------------------------------------------------ the sink
    def apply(self, name: str, events: list[WireEvent]) -> None:
        with self._lock:
            blocks = self._blocks.setdefault(name, Counter())
            for event in events:
                if isinstance(event, BlockStored | BlockRemoved):
                    stored = isinstance(event, BlockStored)
                    change = self._add_locked if stored else self._remove_locked
                    expected = self._expected.get(name, {})
                    for block_hash in event.block_hashes:
                        expected.pop(block_hash, None)  # known now: no guess left
                        change(name, blocks, (event.group_idx or 0, block_hash))
                elif isinstance(event, AllBlocksCleared):
                    self._clear_locked(name)
                    blocks = self._blocks.setdefault(name, Counter())

    def load_snapshot(self, name: str, block_hashes: list[list[bytes]]) -> None:
        with self._lock:
            self._clear_locked(name)
            blocks = self._blocks.setdefault(name, Counter())
            for group, hashes in enumerate(block_hashes):
                for block_hash in hashes:
                    self._add_locked(name, blocks, (group, block_hash))

    def clear(self, name: str) -> None:
        with self._lock:
            self._clear_locked(name)

    def _add_locked(self, name: str, blocks: Counter[BlockKey], key: BlockKey) -> None:
        blocks[key] += 1
        if blocks[key] == 1:
            holders = self._holders.setdefault(key[1], {})
            holders[name] = holders.get(name, 0) + 1

    def _remove_locked(self, name: str, blocks: Counter[BlockKey], key: BlockKey) -> None:
        count = blocks.get(key, 0)
        if count == 0:
            return  # stored before this index knew the instance (a partial feed)
        if count > 1:
            blocks[key] = count - 1
            return
        del blocks[key]
        holders = self._holders[key[1]]
        if holders[name] > 1:
            holders[name] -= 1
        else:
            del holders[name]
            if not holders:
                del self._holders[key[1]]

    def _clear_locked(self, name: str) -> None:
        self._expected.pop(name, None)
        blocks = self._blocks.pop(name, None)
        if not blocks:
            return
        for _, block_hash in {key for key in blocks}:
            holders = self._holders.get(block_hash)
            if holders is not None and holders.pop(name, None) is not None and not holders:
                del self._holders[block_hash]

    # ------------------------------------------------------------------ queries
    def overlap(self, block_hashes: Sequence[bytes], names: Iterable[str]) -> dict[str, int]:
        """Per instance, how many of ``block_hashes`` it holds (or is expected to) from the
        first on."""
        now = time.monotonic()
        with self._lock:
            remaining = {name: self._num_groups.get(name, 1) for name in names}
            found = dict.fromkeys(remaining, 0)
            for i, block_hash in enumerate(block_hashes):
                holders = self._holders.get(block_hash, {})
                for name in [n for n, g in remaining.items() if holders.get(n, 0) < g]:
                    if self._expected.get(name, {}).get(block_hash, 0.0) <= now:
                        del remaining[name]
                if not remaining:
                    break
                for name in remaining:
                    found[name] = i + 1
            return found

    def num_cached_blocks(self, name: str) -> int:
        """Distinct (group, hash) entries cached at ``name`` (the pool's ``num_cached_blocks``)."""
        with self._lock:
            return len(self._blocks.get(name, ()))

    def cached(self, name: str) -> Counter[BlockKey]:
        """A copy of ``name``'s mirrored prefix cache: (group, hash) -> number of blocks."""
        with self._lock:
            return Counter(self._blocks.get(name, Counter()))
