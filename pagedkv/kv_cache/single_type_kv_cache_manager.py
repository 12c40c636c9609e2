"""Single-type managers: one per KV cache group, each knowing how its attention type reaches back.

A new attention type is a subclass with two methods: ``get_num_skipped_tokens`` (which leading
tokens its next token no longer reads, so their blocks can be freed) and
``find_longest_cache_hit`` (which cached blocks a prefix hit needs).

Each manager keeps ``req_to_blocks`` (the request's block table for this group; skipped
positions hold the null block) and ``num_cached_block`` (how many of those are indexed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pagedkv.kv_cache.block_hash import BlockHash
from pagedkv.kv_cache.block_pool import BlockPool, resolve_block_hashes
from pagedkv.kv_cache.kv_cache_block import KVCacheBlock
from pagedkv.kv_cache.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from pagedkv.kv_cache.request import KVCacheRequest
from pagedkv.utils import cdiv

HitBlocks = tuple[list[KVCacheBlock], ...]


def _trim_null_head(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
    for i, block in enumerate(blocks):
        if not block.is_null:
            return blocks[i:] if i else blocks
    return []


class SingleTypeKVCacheManager(ABC):
    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        group_id: int,
        enable_caching: bool,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Free blocks that giving the request ``num_tokens`` slots would consume, counting the
        prefix-hit blocks that touching would pull out of the free queue."""
        num_required = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is not None:
            return max(num_required - len(req_blocks), 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped_blocks, len(new_computed_blocks)), 0)
        num_evictable = sum(
            1 for b in new_computed_blocks[num_skipped_blocks:] if b.ref_cnt == 0 and not b.is_null
        )
        return num_new + num_evictable

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
    ) -> None:
        """Start the request's table with its prefix hit: skipped positions get the null block,
        the rest are touched (ref-counted) so they can no longer be evicted."""
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        kept = new_computed_blocks[num_skipped_blocks:]
        self.block_pool.touch(kept)
        req_blocks = [self._null_block] * num_skipped_blocks
        req_blocks.extend(kept)
        self.req_to_blocks[request_id] = req_blocks
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> None:
        """Blocks for tokens a KV connector will load (only the in-window part for windows)."""
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(total)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(
                total - num_skipped_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = max(0, cdiv(total, self.block_size) - len(req_blocks))
        req_blocks.extend(self.block_pool.get_new_blocks(num_new))

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's table to hold ``num_tokens`` tokens; returns the new blocks."""
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Index the request's blocks that are full within its first ``num_tokens`` tokens."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_hashed_tokens = len(request.block_hashes) * self.block_pool.hash_block_size  # type: ignore[operator]
        num_full = min(num_tokens, num_hashed_tokens) // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request_id],
            num_cached,
            num_full,
            self.block_size,
            self.group_id,
        )
        self.num_cached_block[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first: a prompt's tail is evicted before its head,
        since a later request is likelier to share the head."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        blocks = _trim_null_head(blocks)
        blocks.reverse()
        self.block_pool.free_blocks(blocks)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Swap blocks that the next token can no longer attend to for the null block, and free
        them. Walks backwards from the last skipped block and stops at the first null one, since
        earlier calls already removed everything before it."""
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped_blocks = min(num_skipped_tokens // self.block_size, len(blocks))
        null = self._null_block
        removed = []
        for i in range(num_skipped_blocks - 1, -1, -1):
            if blocks[i] is null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that the next token (at position ``num_computed_tokens``) cannot see."""
        return 0

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
    ) -> tuple[HitBlocks, int]:
        """The longest prefix of at most ``max_length`` tokens, a multiple of
        ``alignment_tokens``, that every group in ``group_ids`` can serve from cached blocks.
        Returns one block list per group (skipped positions hold the null block) and its
        length in tokens."""


class FullAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
    ) -> tuple[HitBlocks, int]:
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)  # type: ignore[arg-type]
        # Scan left to right until the first miss: hashes are chained, so all later ones miss too.
        candidates = hashes[: max_length // block_size]
        if len(group_ids) == 1:
            get = block_pool.cached_block_hash_to_block[group_ids[0]].get
            hit: list[KVCacheBlock] = []
            append = hit.append
            for block_hash in candidates:
                block = get(block_hash)
                if block is None:
                    break
                if block.__class__ is dict:
                    block = next(iter(block.values()))  # type: ignore[union-attr]
                append(block)  # type: ignore[arg-type]
            computed: HitBlocks = (hit,)
        else:
            computed = tuple([] for _ in group_ids)
            for block_hash in candidates:
                cached = block_pool.get_cached_block(block_hash, group_ids)
                if cached is None:
                    break
                for blocks, block in zip(computed, cached):
                    blocks.append(block)
        hit_length = len(computed[0]) * block_size
        if hit_length % alignment_tokens:
            hit_length -= hit_length % alignment_tokens
            num_blocks = cdiv(hit_length, block_size)
            for blocks in computed:
                del blocks[num_blocks:]
        return computed, hit_length


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: SlidingWindowSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
    ) -> tuple[HitBlocks, int]:
        """A hit ending at block ``i`` needs only the ``ceil((window - 1) / block_size)`` blocks
        before the boundary, so search from the right for that many contiguous cached blocks;
        everything before them is the null block. A run touching block 0 also counts: a prefix
        shorter than the window needs no earlier tokens."""
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)  # type: ignore[arg-type]
        num_needed = cdiv(kv_cache_spec.sliding_window - 1, block_size)
        max_num_blocks = min(max_length // block_size, len(hashes))
        null = block_pool.null_block
        computed: HitBlocks = tuple([null] * max_num_blocks for _ in group_ids)
        num_contiguous = 0
        match_found = False
        for i in range(max_num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(hashes[i], group_ids)
            if cached is None:
                num_contiguous = 0
                continue
            # A run's last block must end on an alignment boundary.
            if num_contiguous == 0 and ((i + 1) * block_size) % alignment_tokens:
                continue
            for blocks, block in zip(computed, cached):
                blocks[i] = block
            num_contiguous += 1
            if num_contiguous >= num_needed:
                for blocks in computed:
                    del blocks[i + num_contiguous :]
                match_found = True
                break
        if not match_found:
            for blocks in computed:
                del blocks[num_contiguous:]
            while (
                block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens
            ):
                for blocks in computed:
                    blocks.pop()
        return computed, len(computed[0]) * block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token::

        sliding_window=4, num_computed_tokens=7
        Tokens:   [ 0  1  2  3  4  5  6  7 ]
                  | ---- computed -----|
                                         ^ next token to be computed
                               |-----------| window for the next token
                  |--skipped---|               -> 4
        """
        return max(0, num_computed_tokens - self.sliding_window + 1)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: ChunkedLocalAttentionSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
    ) -> tuple[HitBlocks, int]:
        """Blocks of chunks before the one holding the next token are computed by definition
        (null); within the current chunk, scan left to right until the first miss.
        E.g. chunk 8, block 4, max_length 15: [null, null, hit?]; max_length 16: 4 nulls."""
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        if kv_cache_spec.block_size != alignment_tokens:
            raise ValueError("chunked local attention needs every group to share one block size")
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)  # type: ignore[arg-type]
        chunk = kv_cache_spec.attention_chunk_size
        max_num_blocks = min(max_length // block_size, len(hashes))
        local_start_block = (max_length // chunk * chunk) // block_size
        null = block_pool.null_block
        computed: HitBlocks = tuple([null] * local_start_block for _ in group_ids)
        for i in range(local_start_block, max_num_blocks):
            cached = block_pool.get_cached_block(hashes[i], group_ids)
            if cached is None:
                break
            for blocks, block in zip(computed, cached):
                blocks.append(block)
        return computed, len(computed[0]) * block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of the chunks before the next token's chunk::

        chunk=8, num_computed_tokens=13
        Tokens:  [ 0 1 2 3 4 5 6 7 | 8 9 10 11 12 13 14 15 ]
                 | ----- computed ---------------|
                                                  ^^ next token
                 |--- skipped -----|                  -> 8
        """
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size


_MANAGER_FOR_SPEC: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
}


def get_manager_class(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    try:
        return _MANAGER_FOR_SPEC[type(kv_cache_spec)]
    except KeyError:
        raise ValueError(
            f"no KV cache manager for {type(kv_cache_spec).__name__}; known specs: "
            f"{[t.__name__ for t in _MANAGER_FOR_SPEC]}"
        ) from None
