"""BlockPool: owns every block, the free queue (eviction order) and the prefix-cache index.

Invariants (``check_integrity`` verifies all of them):
  * block ``NULL_BLOCK_ID`` (0) is the null block: never in the free queue, never
    ref-counted, never cached;
  * every other block is either in the free queue with ``ref_cnt == 0`` or out of it with
    ``ref_cnt > 0``; so ``num_free + num_used + 1 == num_blocks``;
  * a block has ``block_hash`` set iff the index maps (its group, that hash) to it.
Eviction is lazy: a freed cached block keeps its hash, and stays findable, until
``get_new_blocks`` hands it out again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagedkv.kv_cache.block_hash import BlockHash
from pagedkv.kv_cache.free_block_queue import FreeKVCacheBlockQueue
from pagedkv.kv_cache.kv_cache_block import NULL_BLOCK_ID, KVCacheBlock
from pagedkv.kv_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from pagedkv.kv_cache.request import KVCacheRequest

# A hash usually maps to one block; identical blocks computed concurrently are all kept (block
# tables are append-only, so a running request's block is never swapped for a twin), then the
# value is {block_id: block} and the first inserted block answers lookups.
CachedBlocks = KVCacheBlock | dict[int, KVCacheBlock]


class BlockHashListWithBlockSize(Sequence[BlockHash]):
    """View of fine-grained hashes at a coarser block size ``k · hash_block_size``.

    Element ``i`` is fine hash ``(i + 1) · k - 1``: the last fine hash chains the whole prefix.
    """

    def __init__(self, block_hashes: Sequence[BlockHash], scale: int) -> None:
        self._hashes = block_hashes
        self._scale = scale

    def __len__(self) -> int:
        return len(self._hashes) // self._scale

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._hashes[(i + 1) * self._scale - 1]


def resolve_block_hashes(
    block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> Sequence[BlockHash]:
    if block_size == hash_block_size:
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, block_size // hash_block_size)


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        num_groups: int = 1,
        hash_block_size: int | None = None,
        enable_kv_cache_events: bool = False,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an integer >= 2, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()  # the first block: NULL_BLOCK_ID
        self.null_block.is_null = True
        # One index per KV cache group: hash -> cached block(s) of that group.
        self.cached_block_hash_to_block: list[dict[BlockHash, CachedBlocks]] = [
            {} for _ in range(num_groups)
        ]
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []

    # ---------------------------------------------------------------- prefix-cache index
    def get_cached_block(
        self, block_hash: BlockHash, group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses."""
        out = []
        for gid in group_ids:
            block = self.cached_block_hash_to_block[gid].get(block_hash)
            if block is None:
                return None
            if block.__class__ is dict:
                block = next(iter(block.values()))  # type: ignore[union-attr]
            out.append(block)
        return out

    def cache_full_blocks(
        self,
        request: KVCacheRequest,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` (now full) under their hashes."""
        if num_cached_blocks >= num_full_blocks:
            return
        assert self.hash_block_size is not None
        block_hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        index = self.cached_block_hash_to_block[group_id]
        stored = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            block.group_id = group_id
            current = index.get(block_hash)
            if current is None:
                index[block_hash] = block
            elif current.__class__ is dict:
                current[block.block_id] = block  # type: ignore[index]
            else:
                index[block_hash] = {current.block_id: current, block.block_id: block}  # type: ignore[union-attr]
            stored.append(block_hash)
        if self.enable_kv_cache_events and stored:
            parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks else None
            tokens = request.all_token_ids[
                num_cached_blocks * block_size : num_full_blocks * block_size
            ]
            self.kv_event_queue.append(
                BlockStored(tuple(stored), parent, tuple(tokens), block_size, group_id)
            )

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        """Drop ``block`` from the prefix-cache index (its KV may then be overwritten)."""
        block_hash = block.block_hash
        assert block_hash is not None
        index = self.cached_block_hash_to_block[block.group_id]
        current = index[block_hash]
        if current is block:
            del index[block_hash]
        else:
            del current[block.block_id]  # type: ignore[union-attr]
            if len(current) == 1:  # type: ignore[arg-type]
                index[block_hash] = next(iter(current.values()))  # type: ignore[union-attr]
        block.block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockRemoved((block_hash,), block.group_id))

    # ---------------------------------------------------------------- allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the front of the free queue, evicting their old hashes."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only "
                f"{self.free_block_queue.num_free_blocks} are free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving free ones out of the free queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, given in eviction order (first = evicted first).

        Blocks that reach ``ref_cnt == 0`` without a hash can never be hit: they go to the
        front (reused first). Cached ones go to the back, keeping LRU order.
        """
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than held"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not caching:
                    evict_first.append(block)
                else:
                    evict_last.append(block)
        self.free_block_queue.prepend_n(evict_first)
        if evict_last:
            self.free_block_queue.append_n(evict_last)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Remove blocks from the prefix cache only (e.g. a connector reported their KV bad);
        holders keep them. Every id is checked before any block is evicted."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            if not self.is_usable_block_id(block_id):
                raise ValueError(f"block id {block_id!r} is not a block of this pool")
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict_cached_block(block)

    def is_usable_block_id(self, block_id: object) -> bool:
        """``block_id`` names a block of this pool that requests can hold (not the null one)."""
        return (
            isinstance(block_id, int)
            and 0 <= block_id < self.num_blocks
            and block_id != NULL_BLOCK_ID
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds blocks."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for index in self.cached_block_hash_to_block:
            index.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # ---------------------------------------------------------------- accounting
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) that requests hold."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        """Number of distinct (group, hash) entries in the prefix cache."""
        return sum(len(index) for index in self.cached_block_hash_to_block)

    def take_events(self) -> list[KVCacheEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def cached_block_hashes(self) -> list[list[BlockHash]]:
        """Per group, the hash of every cached block (twice for two blocks under one hash):
        the state that the events taken so far lead to (one pass over the index)."""
        return [
            [
                h
                for h, cached in index.items()
                for _ in (cached if cached.__class__ is dict else (cached,))
            ]
            for index in self.cached_block_hash_to_block
        ]

    def check_integrity(self) -> None:
        """Assert every invariant in the module docstring (O(num_blocks), for tests)."""
        null = self.null_block
        assert null.block_id == NULL_BLOCK_ID and null.is_null and null.ref_cnt == 0
        assert null.block_hash is None and null.prev_free_block is None
        free = self.free_block_queue.get_all_free_blocks()
        assert len(free) == self.free_block_queue.num_free_blocks, "free count out of sync"
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block is twice in the free queue"
        for block in self.blocks[1:]:
            assert not block.is_null
            if block.block_id in free_ids:
                assert block.ref_cnt == 0, (
                    f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
                )
            else:
                assert block.ref_cnt > 0, f"block {block.block_id} is neither free nor held"
        num_used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert len(free) + num_used + 1 == self.num_blocks
        indexed: set[int] = set()
        for gid, index in enumerate(self.cached_block_hash_to_block):
            for block_hash, cached in index.items():
                members = list(cached.values()) if isinstance(cached, dict) else [cached]
                assert members, "empty duplicate set in the prefix-cache index"
                for block in members:
                    assert block.block_hash == block_hash and block.group_id == gid
                    assert block.block_id not in indexed
                    indexed.add(block.block_id)
        hashed = {b.block_id for b in self.blocks if b.block_hash is not None}
        assert hashed == indexed, "block hashes and prefix-cache index disagree"
        if not self.enable_caching:
            assert not hashed
