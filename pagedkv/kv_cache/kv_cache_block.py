"""KVCacheBlock: one physical block's bookkeeping (the KV bytes live in the worker's tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.kv_cache.block_hash import BlockHash

#: The null block, block 0 of every pool: it stands for positions a sliding window skipped.
#: Never freed, cached, sent or loaded into.
NULL_BLOCK_ID = 0


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """A block of the pool.

    ``ref_cnt`` counts the requests holding the block. ``block_hash`` is set while the block is
    full and findable in the prefix cache of group ``group_id``; a free block keeps its hash
    (evicted lazily, when it is handed out again). ``prev_free_block``/``next_free_block`` are
    the links of the free queue, None while the block is not in it.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    group_id: int = 0
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)
    is_null: bool = False
