"""An instance's tensor-parallel ranks as the KV connectors see them, without engines: the
checkpoint's KV cache (random), each rank's share of its KV heads, and each rank's worker half
run on a thread of its own."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from pagedkv.distributed.shard import TPLayout
from pagedkv.kv_cache.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from pagedkv.kv_cache.kv_cache_spec import FullAttentionSpec

NUM_BLOCKS, BLOCK_SIZE, HEAD_SIZE, NUM_LAYERS = 12, 4, 8, 2
T = TypeVar("T")


def full_caches(num_kv_heads: int, seed: int) -> list[torch.Tensor]:
    """Every KV head's cache (what one rank holds at TP 1), random."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_SIZE)
    return [torch.randn(shape, generator=gen) for _ in range(NUM_LAYERS)]


def rank_caches(full: list[torch.Tensor], tp: TPLayout) -> list[torch.Tensor]:
    """Rank ``tp``'s caches: its KV heads of ``full`` (a copy)."""
    heads = tp.kv_heads()
    return [cache[:, :, :, heads.start : heads.end].clone() for cache in full]


def layouts(num_kv_heads: int, tp_size: int) -> list[TPLayout]:
    return [TPLayout(rank, tp_size, num_kv_heads) for rank in range(tp_size)]


def kv_cache_config(tp: TPLayout) -> KVCacheConfig:
    """A rank's KV cache config: its local heads."""
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=tp.kv_heads().size, head_size=HEAD_SIZE, dtype="float32"
    )
    names = tuple(f"layers.{i}" for i in range(NUM_LAYERS))
    return KVCacheConfig(NUM_BLOCKS, (KVCacheGroupSpec(names, spec),))


def on_each_rank(fn: Callable[[int], T], tp_size: int) -> list[T]:
    """``fn(rank)`` for every rank, each on its own thread (as ranks run at once)."""
    with ThreadPoolExecutor(tp_size) as pool:
        return list(pool.map(fn, range(tp_size)))
