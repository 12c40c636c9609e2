"""How big one tier entry is, and so how many blocks a tier of ``size_gib`` holds.

Both halves compute these from the KV cache config alone, so they agree on the host buffer's
slots without talking. A slot holds one block of any KV cache group (the largest group's
payload: all of its layers' K and V for one block); a disk entry adds the value header.
"""

from __future__ import annotations

from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
from pagedkv.kv_transfer.offload.config import TierConfig
from pagedkv.kv_transfer.store.block_codec import HEADER_SIZE


def payload_bytes(kv_cache_config: KVCacheConfig) -> int:
    """The largest group's block payload: ``layers x page size``."""
    return max(
        len(group.layer_names) * group.kv_cache_spec.page_size_bytes
        for group in kv_cache_config.kv_cache_groups
    )


def slot_bytes(medium: str, kv_cache_config: KVCacheConfig) -> int:
    """Bytes one entry takes in the tier (a host slot, or a disk file)."""
    header = HEADER_SIZE if medium != "cpu" else 0
    return header + payload_bytes(kv_cache_config)


def tier_capacity_blocks(tier: TierConfig, kv_cache_config: KVCacheConfig) -> int:
    capacity = tier.capacity_bytes
    assert capacity is not None, f"the {tier.medium} tier has no size"
    return capacity // slot_bytes(tier.medium, kv_cache_config)
