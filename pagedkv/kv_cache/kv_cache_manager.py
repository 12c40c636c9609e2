"""KVCacheManager: the scheduler's only door to the KV cache.

Per request, a step's allocation lays tokens out as::

    | computed | new computed (prefix hit) | external (connector) | new | lookahead |
    |<- request.num_computed_tokens ->|
               |<- num_new_computed ---->|<- num_external ---->|<- num_new_tokens ->|

and gives the request enough blocks, in every group, to hold all of them.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

from pagedkv.kv_cache.block_hash import BlockHash
from pagedkv.kv_cache.kv_cache_block import KVCacheBlock
from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
from pagedkv.kv_cache.kv_cache_coordinator import get_kv_cache_coordinator
from pagedkv.kv_cache.kv_events import KVCacheEvent
from pagedkv.kv_cache.request import KVCacheRequest
from pagedkv.utils import cdiv


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """Blocks of one request, one sequence per KV cache group."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Block ids of group 0 not (yet) in the prefix cache: the targets of a KV load."""
        return [b.block_id for b in self.blocks[0] if b.block_hash is None and not b.is_null]

    @property
    def num_blocks(self) -> int:
        return sum(len(group) for group in self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache lookups: ``queries`` prompt tokens looked up, ``hits`` found."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        max_in_flight_tokens: int | None = None,
        enable_kv_cache_events: bool = False,
    ) -> None:
        if not isinstance(max_model_len, int) or max_model_len <= 0:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        if max_in_flight_tokens is None:
            max_in_flight_tokens = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            enable_caching,
            enable_kv_cache_events,
        )
        self.block_pool = self.coordinator.block_pool
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        self.prefix_cache_stats = PrefixCacheStats()

    def check_one_request_fits(self) -> None:
        """Refuse a KV cache that cannot hold one request of ``max_model_len`` tokens (as vLLM
        does): such a request could never be admitted, or would preempt itself forever."""
        groups = self.kv_cache_config.kv_cache_groups

        def blocks_for(num_tokens: int) -> int:
            total = 0
            for group in groups:
                spec = group.kv_cache_spec
                num_blocks = cdiv(num_tokens, spec.block_size)
                cap = spec.max_admission_blocks_per_request(self.max_in_flight_tokens, num_tokens)
                total += num_blocks if cap is None else min(cap, num_blocks)
            return total

        usable = self.kv_cache_config.num_blocks - 1  # block 0 is the null block
        if blocks_for(self.max_model_len) <= usable:
            return
        lo, hi = 0, self.max_model_len  # the longest length that fits is in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if blocks_for(mid) <= usable else (lo, mid)
        raise ValueError(
            f"the KV cache ({usable} blocks of {self.kv_cache_config.scheduler_block_size} "
            f"tokens) cannot hold one request of max_model_len={self.max_model_len} tokens "
            f"({blocks_for(self.max_model_len)} blocks): raise --kv-cache-memory or "
            f"--num-gpu-blocks-override, or set --max-model-len {lo} or less"
        )

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """The request's longest cached prefix: ``(blocks per group, num_computed_tokens)``.

        Never the whole prompt: the last token is always recomputed, to get its logits (this
        can cost a whole block, since hits are block-aligned). Reference counts are untouched
        until ``allocate_slots`` adopts the blocks, which must happen in the same step.
        """
        if not self.enable_caching or request.num_tokens <= 1:
            return self.empty_kv_cache_blocks, 0
        blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        if not num_hit_tokens:
            return self.empty_kv_cache_blocks, 0
        return KVCacheBlocks(blocks), num_hit_tokens

    def record_prefix_cache_stats(self, request: KVCacheRequest, num_hit_tokens: int) -> None:
        """Called by the scheduler once per admitted request."""
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None:
        """Give the request slots for its new tokens; returns the newly allocated blocks.

        Returns None, changing nothing except freeing blocks that fell out of a sliding window,
        when the pool lacks free blocks. ``full_sequence_must_fit`` (new admissions) also
        requires room for the whole current sequence. ``delay_cache_blocks`` (KV arriving from
        a connector) leaves the new blocks out of the prefix cache until the KV has landed.
        """
        hit_blocks = (new_computed_blocks or self.empty_kv_cache_blocks).blocks
        self._check_allocation(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            hit_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
        )
        coordinator = self.coordinator
        request_id = request.request_id
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed + num_external_computed_tokens, self.max_model_len)
        if full_sequence_must_fit and not self._full_sequence_fits(
            request, hit_blocks, total_computed
        ):
            return None
        num_tokens_need_slot = min(
            total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        # Free out-of-window blocks before counting: they make room for this allocation.
        coordinator.remove_skipped_blocks(request_id, total_computed)
        num_needed = coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hit_blocks, total_computed
        )
        if num_needed > self.block_pool.get_num_free_blocks():
            return None
        if new_computed_blocks is not None or num_external_computed_tokens:
            coordinator.allocate_new_computed_blocks(
                request_id, hit_blocks, num_local_computed, num_external_computed_tokens
            )
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        if not delay_cache_blocks:
            # Safe at schedule time: a block's KV is written in this step's forward pass, before
            # any later step can read it through a prefix hit.
            coordinator.cache_blocks(
                request, min(total_computed + num_new_tokens, request.num_tokens)
            )
        return KVCacheBlocks(new_blocks)

    def _full_sequence_fits(
        self,
        request: KVCacheRequest,
        hit_blocks: Sequence[Sequence[KVCacheBlock]],
        total_computed: int,
    ) -> bool:
        """Whether the pool has room for the request's whole current sequence (an admission)."""
        num_needed = self.coordinator.get_num_blocks_to_allocate(
            request.request_id,
            min(request.num_tokens, self.max_model_len),
            hit_blocks,
            total_computed,
            apply_admission_cap=True,
        )
        return num_needed <= self.block_pool.get_num_free_blocks()

    def _check_allocation(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        hit_blocks: Sequence[Sequence[KVCacheBlock]],
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """``allocate_slots``'s arguments, checked (ValueError naming the field).

        A prefix hit is adopted once, on admission, and its tokens are exactly its blocks'
        (``get_computed_blocks`` returns ``num_hit // block_size`` blocks per group, null ones
        included). Otherwise never-computed blocks would be cached under the hit's hashes.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_external_computed_tokens < 0:
            raise ValueError(
                "token counts must be >= 0, got num_new_tokens="
                f"{num_new_tokens}, num_new_computed_tokens={num_new_computed_tokens}, "
                f"num_external_computed_tokens={num_external_computed_tokens}"
            )
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        if not (num_new_tokens or num_new_computed_tokens or num_external_computed_tokens):
            raise ValueError("allocate_slots needs new tokens or computed tokens to adopt")
        request_id = request.request_id
        if request.num_computed_tokens and not self.coordinator.is_allocated(request_id):
            raise ValueError(
                f"request {request_id!r} is unknown to the KV cache manager: it claims "
                f"{request.num_computed_tokens} computed tokens but holds no blocks"
            )
        if self.coordinator.is_allocated(request_id):
            if num_new_computed_tokens or any(hit_blocks):
                raise ValueError(
                    f"request {request_id!r} already holds blocks: a prefix hit is only adopted "
                    f"on admission, got num_new_computed_tokens={num_new_computed_tokens}"
                )
            return
        for manager, blocks in zip(self.coordinator.single_type_managers, hit_blocks):
            if len(blocks) * manager.block_size != num_new_computed_tokens:
                raise ValueError(
                    f"num_new_computed_tokens={num_new_computed_tokens} does not match the "
                    f"prefix hit of KV cache group {manager.group_id}: {len(blocks)} blocks of "
                    f"{manager.block_size} tokens"
                )

    def free(self, request: KVCacheRequest) -> None:
        """Release the request's blocks (cached ones stay findable until reused)."""
        if not self.coordinator.is_allocated(request.request_id):
            raise ValueError(
                f"request {request.request_id!r} holds no KV cache blocks (freed twice?)"
            )
        self.coordinator.free(request.request_id)

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """Index the request's full blocks among its first ``num_computed_tokens`` tokens (used
        after a delayed, connector-loaded allocation has landed)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        self.coordinator.remove_skipped_blocks(request_id, num_computed_tokens)

    def is_allocated(self, request_id: str) -> bool:
        return self.coordinator.is_allocated(request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def evict_invalid_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the blocks whose KV a connector reported bad from the prefix cache (holders
        keep them). Ids of no block a request can hold (the null block, out of range) are
        skipped: the report is the connector's, not the pool's."""
        pool = self.block_pool
        pool.evict_blocks([b for b in block_ids if pool.is_usable_block_id(b)])

    def first_token_in_blocks(self, request_id: str, block_ids: Container[int]) -> int | None:
        """The request's first token whose block, in any KV cache group, is in ``block_ids``
        (None: it holds none of them)::

            block_size 4, the request's blocks [7, 3, 9], block_ids {9, 3}  ->  token 4
        """
        first = None
        for manager, blocks in zip(
            self.coordinator.single_type_managers, self.coordinator.get_blocks(request_id)
        ):
            for i, block in enumerate(blocks):
                if block.block_id in block_ids:
                    token = i * manager.block_size
                    first = token if first is None else min(first, token)
                    break
        return first

    def evict_blocks_from(self, request_id: str, first_token: int) -> None:
        """Drop the request's blocks that hold its tokens from ``first_token`` on from the
        prefix cache, in every KV cache group (it keeps them; the null block is never cached)."""
        managers = self.coordinator.single_type_managers
        self.block_pool.evict_blocks(
            {
                block.block_id
                for manager, blocks in zip(managers, self.coordinator.get_blocks(request_id))
                for block in blocks[first_token // manager.block_size :]
                if not block.is_null
            }
        )

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def cached_block_hashes(self) -> list[list[BlockHash]]:
        return self.block_pool.cached_block_hashes()

    def check_integrity(self) -> None:
        """The pool's invariants, plus: each block's ``ref_cnt`` equals the number of request
        block tables (over all groups) that hold it."""
        self.block_pool.check_integrity()
        holders = [0] * self.block_pool.num_blocks
        for manager in self.coordinator.single_type_managers:
            for request_id, blocks in manager.req_to_blocks.items():
                assert manager.num_cached_block.get(request_id, 0) <= len(blocks)
                for block in blocks:
                    if not block.is_null:
                        holders[block.block_id] += 1
        for block in self.block_pool.blocks[1:]:
            num_holders = holders[block.block_id]
            assert block.ref_cnt == num_holders, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {num_holders} holders"
            )
