"""The paged KV cache core: specs, block hashing, the block pool, single-type managers,
coordinators, the KVCacheManager and worker-side block tables. Pure Python + numpy (no torch)."""

from pagedkv.kv_cache.block_hash import BlockHash, BlockHasher
from pagedkv.kv_cache.block_pool import BlockPool
from pagedkv.kv_cache.block_table import BlockTable, MultiGroupBlockTable
from pagedkv.kv_cache.free_block_queue import FreeKVCacheBlockQueue
from pagedkv.kv_cache.kv_cache_block import NULL_BLOCK_ID, KVCacheBlock
from pagedkv.kv_cache.kv_cache_config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    get_kv_cache_config,
    get_kv_cache_groups,
)
from pagedkv.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from pagedkv.kv_cache.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from pagedkv.kv_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "BlockTable",
    "ChunkedLocalAttentionSpec",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "MultiGroupBlockTable",
    "NULL_BLOCK_ID",
    "PrefixCacheStats",
    "SlidingWindowSpec",
    "get_kv_cache_config",
    "get_kv_cache_groups",
]
