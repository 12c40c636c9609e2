"""How big one tier entry is, and so how many blocks a tier of ``size_gib`` holds.

Both halves compute these from the KV cache config (a rank's: its local KV heads) and the
checkpoint's KV heads alone, so they agree on the host buffer's slots without talking:

- a host slot is one rank's part of a block (the host tier is per rank, in each rank's memory:
  its ``size_gib`` holds that rank's heads): the largest group's payload, all of its layers' K
  and V for one block;
- a disk entry is every KV head's value of a block (each a header and one head's payload),
  whichever ranks wrote them: the disk tier's ``size_gib`` is the instance's.
"""

from __future__ import annotations

from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
from pagedkv.kv_transfer.offload.config import TierConfig
from pagedkv.kv_transfer.store.block_codec import HEADER_SIZE


def payload_bytes(kv_cache_config: KVCacheConfig) -> int:
    """The largest group's block payload on one rank: ``layers x page size``."""
    return max(
        len(group.layer_names) * group.kv_cache_spec.page_size_bytes
        for group in kv_cache_config.kv_cache_groups
    )


def slot_bytes(medium: str, kv_cache_config: KVCacheConfig, num_kv_heads: int) -> int:
    """Bytes one entry takes in the tier (a host slot, or a disk block's files);
    ``num_kv_heads``: the checkpoint's."""
    if medium == "cpu":
        return payload_bytes(kv_cache_config)
    local_heads = max(g.kv_cache_spec.num_kv_heads for g in kv_cache_config.kv_cache_groups)
    return num_kv_heads * (HEADER_SIZE + payload_bytes(kv_cache_config) // local_heads)


def tier_capacity_blocks(
    tier: TierConfig, kv_cache_config: KVCacheConfig, num_kv_heads: int
) -> int:
    capacity = tier.capacity_bytes
    assert capacity is not None, f"the {tier.medium} tier has no size"
    return capacity // slot_bytes(tier.medium, kv_cache_config, num_kv_heads)
