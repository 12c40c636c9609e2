"""KV cache coordinators: one single-type manager per KV cache group, one shared BlockPool.

``NoPrefixCache`` (caching off), ``Unitary`` (one group) and ``Hybrid`` (several groups, e.g. full
attention + sliding window) differ only in how they find a prefix hit that every group can serve.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pagedkv.kv_cache.block_hash import BlockHash
from pagedkv.kv_cache.block_pool import BlockPool
from pagedkv.kv_cache.kv_cache_block import KVCacheBlock
from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
from pagedkv.kv_cache.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from pagedkv.kv_cache.request import KVCacheRequest
from pagedkv.kv_cache.single_type_kv_cache_manager import (
    HitBlocks,
    SingleTypeKVCacheManager,
    get_manager_class,
)
from pagedkv.utils import cdiv, round_down


class KVCacheCoordinator:
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.scheduler_block_size = kv_cache_config.scheduler_block_size
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching=enable_caching,
            num_groups=len(kv_cache_config.kv_cache_groups),
            hash_block_size=kv_cache_config.hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_class(group.kv_cache_spec)(
                group.kv_cache_spec,
                self.block_pool,
                gid,
                enable_caching,
                group.kv_cache_spec.max_admission_blocks_per_request(
                    max_in_flight_tokens, max_model_len
                ),
            )
            for gid, group in enumerate(kv_cache_config.kv_cache_groups)
        )
        self.enable_caching = enable_caching

    def is_allocated(self, request_id: str) -> bool:
        return request_id in self.single_type_managers[0].req_to_blocks

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        return sum(
            manager.get_num_blocks_to_allocate(
                request_id, num_tokens, blocks, total_computed_tokens, apply_admission_cap
            )
            for manager, blocks in zip(self.single_type_managers, new_computed_blocks)
        )

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Adopt a new request's prefix hit, then allocate blocks for connector-loaded tokens.

        Two phases: every group touches its hit blocks before any group allocates, so one
        group's allocation cannot evict another group's not-yet-touched hit."""
        if self.is_allocated(request_id):
            return
        total = num_local_computed_tokens + num_external_computed_tokens
        for manager, blocks in zip(self.single_type_managers, new_computed_blocks):
            manager.add_local_computed_blocks(request_id, blocks, total)
        if num_external_computed_tokens > 0:
            for manager in self.single_type_managers:
                manager.allocate_external_computed_blocks(
                    request_id, num_local_computed_tokens, num_external_computed_tokens
                )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers
        )

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[HitBlocks, int]:
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: never a hit, never an indexed block."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[HitBlocks, int]:
        return tuple([] for _ in self.single_type_managers), 0

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        return None


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV cache group: the group's own manager finds the hit."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._manager = self.single_type_managers[0]
        self._spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[HitBlocks, int]:
        return type(self._manager).find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            (0,),
            self.block_pool,
            self._spec,
            self._spec.block_size,
        )


class _SpecGroup(NamedTuple):
    """KV cache groups with equal specs, looked up together."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups: the hit is the longest prefix that every group can serve."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        spec_groups: list[_SpecGroup] = []
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            manager_cls = type(self.single_type_managers[gid])
            for sg in spec_groups:
                if sg.spec == group.kv_cache_spec and sg.manager_cls is manager_cls:
                    sg.group_ids.append(gid)
                    break
            else:
                spec_groups.append(_SpecGroup(group.kv_cache_spec, [gid], manager_cls))
        # Full attention first: its hit is downward-closed, so it bounds everyone else cheaply.
        spec_groups.sort(key=lambda sg: not isinstance(sg.spec, FullAttentionSpec))
        self.spec_groups = spec_groups
        self._is_simple_hybrid = len(spec_groups) == 2 and isinstance(
            spec_groups[0].spec, FullAttentionSpec
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[HitBlocks, int]:
        """Fixed point: each spec group confirms the candidate length or shrinks it; any shrink
        restarts the round. The candidate only decreases, so this terminates. With exactly full
        attention + one other type, one round suffices (full attention is looked up first)."""
        num_groups = len(self.single_type_managers)
        hit_blocks: list[list[KVCacheBlock] | None] = [None] * num_groups
        hit_lengths = [0] * num_groups
        alignment = self.scheduler_block_size
        hit_length = max_cache_hit_length
        while True:
            curr = hit_length
            for spec, group_ids, manager_cls in self.spec_groups:
                first = group_ids[0]
                if isinstance(spec, FullAttentionSpec) and hit_blocks[first] is not None:
                    curr = min(curr, hit_lengths[first])
                    continue
                blocks, curr = manager_cls.find_longest_cache_hit(
                    block_hashes, curr, group_ids, self.block_pool, spec, alignment
                )
                for gid, group_blocks in zip(group_ids, blocks):
                    hit_blocks[gid] = group_blocks
                    hit_lengths[gid] = curr
            if curr >= hit_length:
                break
            hit_length = curr
            if self._is_simple_hybrid:
                break
        for spec, group_ids, _ in self.spec_groups:
            if isinstance(spec, FullAttentionSpec):
                num_blocks = cdiv(hit_length, spec.block_size)
                for gid in group_ids:
                    del hit_blocks[gid][num_blocks:]  # type: ignore[index]
        return tuple(b if b is not None else [] for b in hit_blocks), hit_length

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        # Only prefixes on a scheduler-block boundary can ever be hit by every group.
        super().cache_blocks(request, round_down(num_computed_tokens, self.scheduler_block_size))


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_in_flight_tokens: int,
    enable_caching: bool,
    enable_kv_cache_events: bool = False,
) -> KVCacheCoordinator:
    if not enable_caching:
        cls: type[KVCacheCoordinator] = KVCacheCoordinatorNoPrefixCache
    elif len(kv_cache_config.kv_cache_groups) == 1:
        cls = UnitaryKVCacheCoordinator
    else:
        cls = HybridKVCacheCoordinator
    return cls(
        kv_cache_config, max_model_len, max_in_flight_tokens, enable_caching, enable_kv_cache_events
    )
