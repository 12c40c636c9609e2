"""KV cache groups and the pool size: which layers share a block table, and how many blocks fit.

A hybrid model (full + sliding-window layers) gets one group per attention type, split so that
every group has the same number of layers. All groups draw block ids from one shared pool, and
layer ``j`` of every group aliases the same memory (``KVCacheTensor.shared_by``): a block id
belongs to one group at a time, so the aliasing is safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.kv_cache.kv_cache_spec import KVCacheSpec
from pagedkv.utils import cdiv


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table (and so one spec)."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheTensor:
    """One allocation of ``size`` bytes, used by one layer of each group."""

    size: int
    shared_by: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    kv_cache_tensors: tuple[KVCacheTensor, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an integer >= 2 (block 0 is the null block), "
                f"got {self.num_blocks!r}"
            )
        if not self.kv_cache_groups:
            raise ValueError("kv_cache_groups must not be empty")

    @property
    def block_sizes(self) -> list[int]:
        return [g.kv_cache_spec.block_size for g in self.kv_cache_groups]

    @property
    def scheduler_block_size(self) -> int:
        """Scheduling granularity: a prefix hit must end on a boundary of every group."""
        return math.lcm(*self.block_sizes)

    @property
    def hash_block_size(self) -> int:
        """Block hashes are computed at the finest granularity that every group can use."""
        return math.gcd(*self.block_sizes)


def get_kv_cache_groups(layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Group layers by spec. Equal specs form one group; a hybrid model is split so every group
    has ``group_size`` layers (padding the last group of a type when the counts don't divide)."""
    if not layer_specs:
        raise ValueError("a model needs at least one layer with a KV cache")
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        buckets.setdefault(spec, []).append(name)
    if len(buckets) == 1:
        ((spec, names),) = buckets.items()
        return [KVCacheGroupSpec(tuple(names), spec)]
    page_sizes = {spec.page_size_bytes for spec in buckets}
    if len(page_sizes) != 1:
        raise ValueError(
            "hybrid models need the same page size (bytes per block per layer) for every layer "
            f"type, got {sorted(page_sizes)}"
        )
    sizes = [len(names) for names in buckets.values()]
    group_size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    groups = []
    for spec, names in buckets.items():
        num_groups = cdiv(len(names), group_size)
        groups.extend(
            KVCacheGroupSpec(tuple(names[i::num_groups]), spec) for i in range(num_groups)
        )
    return groups


def get_kv_cache_config(
    layer_specs: dict[str, KVCacheSpec],
    *,
    kv_cache_memory_bytes: int | None = None,
    num_gpu_blocks_override: int | None = None,
) -> KVCacheConfig:
    """Size the shared pool from a byte budget (or take an explicit block count).

    ``bytes_per_block`` is the largest group's sum of layer pages; groups alias the same memory.
    """
    groups = get_kv_cache_groups(layer_specs)
    group_size = max(len(g.layer_names) for g in groups)
    page_size = groups[0].kv_cache_spec.page_size_bytes
    bytes_per_block = group_size * page_size
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
    elif kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes < 0:
            raise ValueError(f"kv_cache_memory_bytes must be >= 0, got {kv_cache_memory_bytes}")
        num_blocks = kv_cache_memory_bytes // bytes_per_block
    else:
        raise ValueError("give kv_cache_memory_bytes or num_gpu_blocks_override")
    if not isinstance(num_blocks, int) or num_blocks < 2:
        raise ValueError(
            f"the KV cache budget gives {num_blocks} blocks of {bytes_per_block} bytes; at least 2 "
            "are needed (block 0 is the null block): raise the KV cache memory or block count"
        )
    tensors = tuple(
        KVCacheTensor(
            size=num_blocks * page_size,
            shared_by=tuple(g.layer_names[j] for g in groups if j < len(g.layer_names)),
        )
        for j in range(group_size)
    )
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_groups=tuple(groups), kv_cache_tensors=tensors
    )
