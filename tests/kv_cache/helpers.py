"""Shared helpers for the kv_cache tests: a minimal request, spec/config/manager builders, and
snapshots of the manager's whole observable state."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.kv_cache import (
    BlockHasher,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    SlidingWindowSpec,
)

# Same geometry for every layer type, so hybrid configs have equal page sizes.
SPEC_KW = dict(num_kv_heads=2, head_size=8, dtype="float16")


def full_spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, **SPEC_KW)


def swa_spec(sliding_window: int, block_size: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, sliding_window=sliding_window, **SPEC_KW)


def chunked_spec(attention_chunk_size: int, block_size: int = 16) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size, attention_chunk_size=attention_chunk_size, **SPEC_KW
    )


def make_config(*specs: KVCacheSpec, num_blocks: int = 11) -> KVCacheConfig:
    """One group (of one layer) per spec, in order."""
    groups = tuple(KVCacheGroupSpec((f"layer.{i}",), spec) for i, spec in enumerate(specs))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)


def make_manager(
    *specs: KVCacheSpec,
    num_blocks: int = 11,
    max_model_len: int = 8192,
    enable_caching: bool = True,
    enable_kv_cache_events: bool = False,
) -> KVCacheManager:
    specs = specs or (full_spec(),)
    return KVCacheManager(
        make_config(*specs, num_blocks=num_blocks),
        max_model_len,
        enable_caching=enable_caching,
        enable_kv_cache_events=enable_kv_cache_events,
    )


def make_hasher(mgr: KVCacheManager, algo: str = "xxh3_128") -> BlockHasher:
    return BlockHasher(mgr.kv_cache_config.hash_block_size, algo)


class Req:
    """The few request fields the KV cache manager reads (``KVCacheRequest``); block hashes are
    kept up to date as tokens are appended, as the engine's Request does."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hasher: BlockHasher,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.adapter_id = adapter_id
        self.block_hashes: list[bytes] = []
        self._hasher = hasher
        hasher.update(self.block_hashes, self.all_token_ids, cache_salt, adapter_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        self.all_token_ids.extend(token_ids)
        self._hasher.update(self.block_hashes, self.all_token_ids, self.cache_salt, self.adapter_id)

    def __repr__(self) -> str:
        return f"Req({self.request_id!r}, {self.num_tokens} tokens)"


def free_ids(mgr: KVCacheManager) -> list[int]:
    """Free queue, front (evicted first) to back."""
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(mgr: KVCacheManager, block_ids: Sequence[int]) -> list[int]:
    return [mgr.block_pool.blocks[i].ref_cnt for i in block_ids]


def cached_ids(mgr: KVCacheManager) -> set[int]:
    """Blocks findable in the prefix cache (any group)."""
    return {b.block_id for b in mgr.block_pool.blocks if b.block_hash is not None}


def snapshot(mgr: KVCacheManager) -> dict:
    """Everything an allocation may change: ref counts, hashes, the free queue (in order), the
    prefix-cache index and every manager's per-request bookkeeping."""
    pool = mgr.block_pool
    index = [
        {h: sorted(v) if isinstance(v, dict) else [v.block_id] for h, v in group_index.items()}
        for group_index in pool.cached_block_hash_to_block
    ]
    managers = [
        (
            {rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()},
            dict(m.num_cached_block),
        )
        for m in mgr.coordinator.single_type_managers
    ]
    return dict(
        ref_cnt=[b.ref_cnt for b in pool.blocks],
        block_hash=[b.block_hash for b in pool.blocks],
        free=free_ids(mgr),
        num_free=pool.get_num_free_blocks(),
        index=index,
        managers=managers,
        events=len(pool.kv_event_queue),
    )


def prefill(mgr: KVCacheManager, req: Req, **kwargs) -> tuple[int, tuple[list[int], ...]]:
    """Schedule a new request's whole prompt the way the scheduler does: look up its prefix hit,
    allocate the rest, count it all as computed. Returns (num_hit_tokens, new block ids)."""
    blocks, num_hit = mgr.get_computed_blocks(req)
    num_new = req.num_tokens - req.num_computed_tokens - num_hit
    new = mgr.allocate_slots(req, num_new, num_hit, blocks, **kwargs)
    assert new is not None, f"allocation failed for {req}"
    req.num_computed_tokens += num_hit + num_new
    mgr.check_integrity()
    return num_hit, new.get_block_ids()


def decode(mgr: KVCacheManager, req: Req, token_id: int) -> tuple[list[int], ...] | None:
    """One decode step: the sampled token is appended, then gets a slot."""
    req.append_output_token_ids([token_id])
    new = mgr.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    if new is None:
        return None
    req.num_computed_tokens = req.num_tokens
    mgr.check_integrity()
    return new.get_block_ids()
