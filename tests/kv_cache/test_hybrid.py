"""Hybrid models (full attention + sliding window): one shared pool, one block table per group,
and a prefix hit that every group can serve."""

from __future__ import annotations

from pagedkv.kv_cache import BlockStored, FullAttentionSpec, SlidingWindowSpec
from pagedkv.kv_cache.kv_cache_coordinator import HybridKVCacheCoordinator
from tests.kv_cache.helpers import (
    Req,
    cached_ids,
    free_ids,
    full_spec,
    make_hasher,
    make_manager,
    prefill,
    ref_cnts,
    snapshot,
    swa_spec,
)

BS = 16
PROMPT = [t for t in range(5) for _ in range(BS)]  # 80 tokens, 5 distinct full blocks


def hybrid_after_one_prompt(*specs, num_blocks=21):
    """Prefill PROMPT and free it: group g held blocks 5g+1 .. 5g+5."""
    mgr = make_manager(*specs, num_blocks=num_blocks)
    hasher = make_hasher(mgr)
    req = Req("p", PROMPT, hasher)
    tables = tuple(list(range(5 * g + 1, 5 * g + 6)) for g in range(len(specs)))
    assert prefill(mgr, req) == (0, tables)
    mgr.free(req)
    return mgr, hasher


def test_hybrid_prefill_free_and_full_hit():
    mgr, hasher = hybrid_after_one_prompt(full_spec(), swa_spec(32))
    assert isinstance(mgr.coordinator, HybridKVCacheCoordinator)
    assert cached_ids(mgr) == set(range(1, 11))
    # Each group frees its own table tail first, group by group.
    assert free_ids(mgr) == [*range(11, 21), 5, 4, 3, 2, 1, 10, 9, 8, 7, 6]

    req = Req("q", PROMPT + [9], hasher)
    blocks, num_hit = mgr.get_computed_blocks(req)
    assert (blocks.get_block_ids(), num_hit) == (([1, 2, 3, 4, 5], [0, 0, 0, 9, 10]), 80)
    new = mgr.allocate_slots(req, 1, num_hit, blocks)
    assert new.get_block_ids() == ([11], [12])
    assert mgr.get_block_ids("q") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    assert ref_cnts(mgr, range(1, 13)) == [1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    assert free_ids(mgr) == [*range(13, 21), 8, 7, 6]
    mgr.check_integrity()
    mgr.free(req)
    mgr.check_integrity()
    assert mgr.block_pool.get_num_free_blocks() == 20


def test_hybrid_full_attention_hit_truncated_to_what_swa_serves():
    mgr, hasher = hybrid_after_one_prompt(full_spec(), swa_spec(32))
    mgr.evict_blocks({9})  # the SWA block at position 3
    blocks, num_hit = mgr.get_computed_blocks(Req("q", PROMPT + [9], hasher))
    # Full attention alone would hit 80; SWA's rightmost pair within 80 ends at 48.
    assert (blocks.get_block_ids(), num_hit) == (([1, 2, 3], [0, 7, 8]), 48)


def test_hybrid_swa_search_bounded_by_full_attention_hit():
    mgr, hasher = hybrid_after_one_prompt(full_spec(), swa_spec(32))
    mgr.evict_blocks({3})  # the full-attention block at position 2
    blocks, num_hit = mgr.get_computed_blocks(Req("q", PROMPT + [9], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1, 2], [6, 7]), 32)
    mgr.evict_blocks({1})
    blocks, num_hit = mgr.get_computed_blocks(Req("r", PROMPT + [9], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([], []), 0)


def test_hybrid_fixed_point_with_two_window_sizes():
    """full + SWA(32) + SWA(64): not a "simple" hybrid, so a shrink by the last group makes
    every group re-check the shorter length."""
    mgr, hasher = hybrid_after_one_prompt(full_spec(), swa_spec(32), swa_spec(64), num_blocks=31)
    assert mgr.get_block_ids("p") == ([], [], [])
    # Group 2 (SWA 64, needs 4 contiguous blocks) holds 11..15; lose its position 1.
    mgr.evict_blocks({12})
    blocks, num_hit = mgr.get_computed_blocks(Req("q", PROMPT + [9], hasher))
    # SWA 64 can only serve its run touching block 0: 16 tokens; all groups agree on it.
    assert (blocks.get_block_ids(), num_hit) == (([1], [6], [11]), 16)
    # Now SWA 32 loses position 0: it served 80 in the first round, but not 16.
    mgr.evict_blocks({6})
    blocks, num_hit = mgr.get_computed_blocks(Req("r", PROMPT + [9], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([], [], []), 0)


def test_hybrid_allocation_failure_changes_nothing():
    mgr, hasher = hybrid_after_one_prompt(full_spec(), swa_spec(32), num_blocks=16)
    assert free_ids(mgr) == [11, 12, 13, 14, 15, 5, 4, 3, 2, 1, 10, 9, 8, 7, 6]
    # 4 blocks per group: the unhashed 11..15, then full attention's 5, 4, 3 are evicted.
    prefill(mgr, Req("other", [7] * 64, hasher))
    assert free_ids(mgr) == [2, 1, 10, 9, 8, 7, 6]
    req = Req("q", PROMPT + [9] * 30, hasher)
    blocks, num_hit = mgr.get_computed_blocks(req)
    assert (blocks.get_block_ids(), num_hit) == (([1, 2], [6, 7]), 32)
    # Per group 5 new blocks + 2 free hit blocks to revive: 14 needed, 7 free.
    before = snapshot(mgr)
    assert mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks) is None
    assert snapshot(mgr) == before
    mgr.check_integrity()


def test_hybrid_events_per_group():
    mgr = make_manager(full_spec(), swa_spec(32), num_blocks=21, enable_kv_cache_events=True)
    hasher = make_hasher(mgr)
    req = Req("p", PROMPT[:40], hasher)
    prefill(mgr, req)
    hashes = tuple(req.block_hashes)
    tokens = tuple(PROMPT[:32])
    assert mgr.take_events() == [
        BlockStored(hashes, None, tokens, BS, 0),
        BlockStored(hashes, None, tokens, BS, 1),
    ]


def test_hybrid_with_different_block_sizes():
    """Full attention with 32-token blocks next to SWA with 16-token blocks (equal pages):
    hashes are kept per 16 tokens, hits and caching are aligned to 32."""
    full32 = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=8)
    swa16 = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, sliding_window=32)
    assert full32.page_size_bytes == swa16.page_size_bytes
    mgr = make_manager(full32, swa16, num_blocks=21)
    cfg = mgr.kv_cache_config
    assert (cfg.scheduler_block_size, cfg.hash_block_size) == (32, 16)
    hasher = make_hasher(mgr)
    req = Req("p", PROMPT, hasher)
    assert len(req.block_hashes) == 5
    assert prefill(mgr, req) == (0, ([1, 2, 3], [4, 5, 6, 7, 8]))
    pool = mgr.block_pool
    # Only the 64 tokens on a 32-token boundary are cached, in both groups; a 32-token block
    # is indexed under the fine hash of its last 16 tokens (which chains the whole prefix).
    assert cached_ids(mgr) == {1, 2, 4, 5, 6, 7}
    assert [pool.blocks[i].block_hash for i in (1, 2)] == req.block_hashes[1:4:2]
    blocks, num_hit = mgr.get_computed_blocks(Req("q", PROMPT + [9], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1, 2], [0, 0, 6, 7]), 64)
    # A 48-token prefix is a whole SWA hit but not 32-aligned: it rounds down to 32.
    mgr.evict_blocks({7})
    blocks, num_hit = mgr.get_computed_blocks(Req("r", PROMPT + [9], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1], [4, 5]), 32)


def test_an_empty_or_one_token_request_looks_up_nothing():
    """Nothing can be hit below two tokens (the last is always computed): once the hybrid
    lookup asked for -1 tokens and answered a hit of -1."""
    mgr, hasher = hybrid_after_one_prompt(full_spec(), swa_spec(32))
    for tokens in ([], [0]):
        blocks, num_hit = mgr.get_computed_blocks(Req("e", tokens, hasher))
        assert num_hit == 0 and blocks.get_block_ids() == ([], [])


def test_a_bad_load_found_and_evicted_through_the_managers_api():
    """What the scheduler does with a connector's invalid block ids: find the request's first
    bad token over every group, drop its blocks from there on from the prefix cache."""
    mgr, hasher = hybrid_after_one_prompt(full_spec(), swa_spec(32))
    req = Req("q", PROMPT + [9], hasher)
    blocks, num_hit = mgr.get_computed_blocks(req)
    mgr.allocate_slots(req, 1, num_hit, blocks)
    assert mgr.get_block_ids("q") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    assert mgr.first_token_in_blocks("q", {10}) == 4 * BS  # the SWA group's 5th block
    assert mgr.first_token_in_blocks("q", {10, 3}) == 2 * BS  # the earliest over both groups
    assert mgr.first_token_in_blocks("q", {7, 99}) is None
    assert mgr.first_token_in_blocks("nobody", {1}) is None

    mgr.evict_blocks_from("q", 3 * BS)
    assert cached_ids(mgr) == {1, 2, 3, 6, 7, 8}
    assert ref_cnts(mgr, range(1, 13)) == [1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    # A connector's report may name the null block or ids beyond the pool: skipped.
    mgr.evict_invalid_blocks([0, 2, 21, -1, 99])
    assert cached_ids(mgr) == {1, 3, 6, 7, 8}
    mgr.check_integrity()
    mgr.free(req)
    mgr.check_integrity()
