"""Drives pagedkv's KVCacheManager with the neutral traces of the vLLM anchor (workloads.py).

Implements the anchor's ``KVCacheAdapter`` protocol. It emulates the few lines of scheduler
bookkeeping around the manager exactly as the vLLM adapter does for vLLM: after a successful
allocate the request's tokens count as computed; new admissions must fit whole.
"""

from __future__ import annotations

from pagedkv.kv_cache import (
    BlockHasher,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    SlidingWindowSpec,
)

ALL = -1  # the anchor's "every remaining uncomputed token"

# Same per-layer geometry as the vLLM adapter, so page sizes are equal across groups.
_SPEC_KW = dict(num_kv_heads=8, head_size=128, dtype="float16")
# The anchor's algorithm names, mapped to ours ("xxhash" is xxh3-128 in both).
_ALGOS = {"sha256": "sha256", "xxhash": "xxh3_128", "xxh3_128": "xxh3_128"}


class TraceRequest:
    """The request state a scheduler keeps, reduced to what the KV cache manager reads."""

    __slots__ = (
        "request_id",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_hashes",
        "_hasher",
        "is_new",
    )

    def __init__(self, request_id: str, token_ids: list[int], hasher: BlockHasher) -> None:
        self.request_id = request_id
        self.all_token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self._hasher = hasher
        self.is_new = True
        hasher.update(self.block_hashes, self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.all_token_ids.extend(token_ids)
        self._hasher.update(self.block_hashes, self.all_token_ids)


def make_kv_cache_config(cache: dict) -> KVCacheConfig:
    bs = cache["block_size"]
    groups = []
    for i, g in enumerate(cache["groups"]):
        if g["type"] == "full":
            spec = FullAttentionSpec(block_size=bs, **_SPEC_KW)
        elif g["type"] == "sliding_window":
            spec = SlidingWindowSpec(block_size=bs, sliding_window=g["window"], **_SPEC_KW)
        else:
            raise ValueError(f"unknown group type {g['type']!r}")
        groups.append(KVCacheGroupSpec((f"layer.{i}",), spec))
    return KVCacheConfig(num_blocks=cache["num_blocks"], kv_cache_groups=tuple(groups))


class PagedKVAdapter:
    name = "pagedkv"

    def __init__(self, hash_algo: str = "xxh3_128") -> None:
        self.hash_algo = hash_algo

    def setup(self, cache: dict) -> None:
        cfg = make_kv_cache_config(cache)
        self.mgr = KVCacheManager(
            cfg, cache["max_model_len"], enable_caching=cache.get("enable_caching", True)
        )
        self.hasher = BlockHasher(cfg.hash_block_size, self.hash_algo)
        self.reqs: dict[str, TraceRequest] = {}
        self.pending_hit: dict[str, tuple] = {}

    def arrive(self, req_id: str, token_ids: list[int]) -> None:
        self.reqs[req_id] = TraceRequest(req_id, token_ids, self.hasher)

    def lookup(self, req_id: str) -> int:
        blocks, num_hit = self.mgr.get_computed_blocks(self.reqs[req_id])
        self.pending_hit[req_id] = (blocks, num_hit)
        return num_hit

    def allocate(self, req_id: str, num_new_tokens: int) -> int:
        req = self.reqs[req_id]
        blocks, num_hit = self.pending_hit.pop(req_id, (None, 0))
        if num_new_tokens == ALL:
            num_new_tokens = req.num_tokens - req.num_computed_tokens - num_hit
        new = self.mgr.allocate_slots(
            req,
            num_new_tokens,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=blocks,
            full_sequence_must_fit=req.is_new,
        )
        if new is None:
            raise RuntimeError(f"allocate_slots failed for {req_id} (out of blocks)")
        req.is_new = False
        req.num_computed_tokens += num_hit + num_new_tokens
        return new.num_blocks

    def append(self, req_id: str, token_ids: list[int]) -> None:
        self.reqs[req_id].append_output_token_ids(token_ids)

    def free(self, req_id: str) -> None:
        self.pending_hit.pop(req_id, None)
        req = self.reqs.pop(req_id)
        # A request only looked up (never admitted) holds nothing: the scheduler knows not to
        # free it, and the manager treats a free without blocks as a double free.
        if self.mgr.is_allocated(req_id):
            self.mgr.free(req)

    def snapshot(self) -> dict:
        pool = self.mgr.block_pool
        return dict(free_blocks=pool.get_num_free_blocks(), cached_blocks=pool.num_cached_blocks)

    def hash_prepare(self, token_ids: list[int], algo: str, block_size: int):
        if algo not in _ALGOS:
            raise ValueError(f"pagedkv has no {algo!r} hash")
        return BlockHasher(block_size, _ALGOS[algo]), token_ids

    def hash_blocks(self, prepared) -> list[bytes]:
        hasher, token_ids = prepared
        return hasher.hash_token_ids(token_ids)
