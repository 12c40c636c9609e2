"""KV cache events: what entered and left the prefix cache, collected for publishing.

A router (or a KV-aware load balancer) can mirror an instance's prefix cache from these.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.kv_cache.block_hash import BlockHash

#: The tier an event is about, in vLLM's vocabulary: the instance's own KV cache pool ("GPU",
#: whatever its device), host memory ("CPU"), a local directory ("DISK"), a shared store
#: ("REMOTE").
GPU, CPU, DISK, REMOTE = "GPU", "CPU", "DISK", "REMOTE"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became cached; ``token_ids`` are their tokens, in order."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    group_id: int
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    group_id: int
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
