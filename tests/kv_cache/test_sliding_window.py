"""Exact-state tests for sliding-window and chunked-local attention: skipped blocks become the
null block and are freed; prefix hits need only the blocks the next token can see."""

from __future__ import annotations

import pytest

from tests.kv_cache.helpers import (
    Req,
    cached_ids,
    chunked_spec,
    decode,
    free_ids,
    make_hasher,
    make_manager,
    prefill,
    ref_cnts,
    snapshot,
    swa_spec,
)

BS = 16
PROMPT = [t for t in range(5) for _ in range(BS)]  # 80 tokens, 5 distinct full blocks


def test_swa_get_num_skipped_tokens():
    mgr = make_manager(swa_spec(4))
    manager = mgr.coordinator.single_type_managers[0]
    # window 4, 7 computed: the next token (7) sees 4..7, tokens 0..3 are skipped.
    assert [manager.get_num_skipped_tokens(n) for n in (0, 3, 4, 7, 100)] == [0, 0, 1, 4, 97]


def test_swa_remove_skipped_blocks():
    mgr = make_manager(swa_spec(32))
    hasher = make_hasher(mgr)
    req = Req("0", PROMPT, hasher)
    # The whole prompt is computed in one step: nothing is skipped before it runs.
    assert prefill(mgr, req) == (0, ([1, 2, 3, 4, 5],))
    assert cached_ids(mgr) == {1, 2, 3, 4, 5}
    assert free_ids(mgr) == [6, 7, 8, 9, 10]

    # Token 80 sees tokens 49..80: tokens 0..48 are skipped, so blocks 0..2 go (block 3 holds
    # token 49). They are freed last block first, and stay cached (lazy eviction).
    assert decode(mgr, req, 9) == ([6],)
    assert mgr.get_block_ids("0") == ([0, 0, 0, 4, 5, 6],)
    assert ref_cnts(mgr, [1, 2, 3]) == [0, 0, 0]
    assert free_ids(mgr) == [7, 8, 9, 10, 3, 2, 1]
    assert cached_ids(mgr) == {1, 2, 3, 4, 5}

    # Tokens 81..94 keep block 3 in the window; computing token 95 drops it.
    for num_tokens in range(82, 96):
        assert decode(mgr, req, 9) == ([],)
        assert mgr.get_block_ids("0") == ([0, 0, 0, 4, 5, 6],), num_tokens
    assert decode(mgr, req, 9) == ([],)
    assert req.num_tokens == 96
    assert mgr.get_block_ids("0") == ([0, 0, 0, 0, 5, 6],)
    assert free_ids(mgr) == [7, 8, 9, 10, 3, 2, 1, 4]
    assert decode(mgr, req, 9) == ([7],)
    assert mgr.get_block_ids("0") == ([0, 0, 0, 0, 5, 6, 7],)

    # Free: the null head is skipped, the rest freed tail first; 7 (unhashed) to the front.
    mgr.free(req)
    assert free_ids(mgr) == [7, 8, 9, 10, 3, 2, 1, 4, 6, 5]
    assert mgr.block_pool.null_block.ref_cnt == 0
    mgr.check_integrity()


def test_swa_remove_skipped_blocks_frees_even_when_allocation_fails():
    mgr = make_manager(swa_spec(32), num_blocks=7)
    hasher = make_hasher(mgr)
    prefill(mgr, req := Req("0", PROMPT, hasher))
    prefill(mgr, Req("1", [7] * 16, hasher))
    assert free_ids(mgr) == []
    # 60 more tokens (140) need 9 table entries, 4 more than the 5 held. Token 80's window
    # releases positions 0..2, which frees only 3 blocks.
    req.append_output_token_ids([9] * 60)
    assert mgr.allocate_slots(req, 60) is None
    # As in vLLM, blocks outside the window are released even though the allocation failed.
    assert mgr.get_block_ids("0") == ([0, 0, 0, 4, 5],)
    assert free_ids(mgr) == [3, 2, 1]
    after_skip = snapshot(mgr)
    assert mgr.allocate_slots(req, 60) is None
    assert snapshot(mgr) == after_skip
    mgr.check_integrity()


def test_swa_hit_needs_only_the_window():
    mgr = make_manager(swa_spec(32))
    hasher = make_hasher(mgr)
    prefill(mgr, req0 := Req("0", PROMPT, hasher))
    mgr.free(req0)
    assert free_ids(mgr) == [6, 7, 8, 9, 10, 5, 4, 3, 2, 1]

    # ceil((32 - 1) / 16) = 2 blocks before the boundary suffice; the rest is null.
    req = Req("1", PROMPT + [9], hasher)
    blocks, num_hit = mgr.get_computed_blocks(req)
    assert (blocks.get_block_ids(), num_hit) == (([0, 0, 0, 4, 5],), 80)
    new = mgr.allocate_slots(req, 1, num_hit, blocks)
    assert new.get_block_ids() == ([6],)
    assert mgr.get_block_ids("1") == ([0, 0, 0, 4, 5, 6],)
    # Only the two blocks in the window are touched: 1..3 stay free and cached.
    assert ref_cnts(mgr, [1, 2, 3, 4, 5, 6]) == [0, 0, 0, 1, 1, 1]
    assert free_ids(mgr) == [7, 8, 9, 10, 3, 2, 1]
    assert cached_ids(mgr) == {1, 2, 3, 4, 5}
    mgr.check_integrity()


@pytest.mark.parametrize(
    ("window", "num_hit"),
    [
        (16, 80),  # needs ceil(15/16) = 1 block: block 4 alone serves a hit of 80
        (17, 80),  # ceil(16/16) = 1
        (18, 48),  # ceil(17/16) = 2: blocks 1, 2 are the rightmost contiguous pair
        (33, 48),  # ceil(32/16) = 2
        (34, 0),  # ceil(33/16) = 3: no 3 contiguous blocks, no run touching block 0
    ],
)
def test_swa_right_to_left_hit_search(window, num_hit):
    mgr = make_manager(swa_spec(window))
    hasher = make_hasher(mgr)
    prefill(mgr, req0 := Req("0", PROMPT, hasher))
    mgr.free(req0)
    # Blocks at positions 1, 2 and 4 stay cached; positions 0 and 3 are evicted.
    mgr.evict_blocks({1, 4})
    blocks, hit = mgr.get_computed_blocks(Req("1", PROMPT + [9], hasher))
    assert hit == num_hit
    expected = {80: [0, 0, 0, 0, 5], 48: [0, 2, 3], 0: []}[num_hit]
    assert blocks.get_block_ids() == (expected,)


def test_swa_run_touching_block_zero_counts():
    mgr = make_manager(swa_spec(64))  # needs ceil(63/16) = 4 contiguous blocks
    hasher = make_hasher(mgr)
    prefill(mgr, req0 := Req("0", PROMPT, hasher))
    mgr.free(req0)
    mgr.evict_blocks({4})
    # Positions 0..2 cached, 3 evicted, 4 cached: no run of 4, but the prefix 0..2 is shorter
    # than the window and needs nothing before it.
    blocks, num_hit = mgr.get_computed_blocks(Req("1", PROMPT + [9], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1, 2, 3],), 48)
    mgr.evict_blocks({1})
    blocks, num_hit = mgr.get_computed_blocks(Req("2", PROMPT + [9], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([],), 0)


def test_swa_chunked_prefill_keeps_only_the_window():
    mgr = make_manager(swa_spec(32), num_blocks=8)
    hasher = make_hasher(mgr)
    req0 = Req("0", PROMPT, hasher)
    # Chunked prefill of 80 tokens in 16-token chunks: before each chunk, the blocks its first
    # token cannot see are released (cached, so to the back), and new blocks come from the front.
    tables = []
    for _ in range(5):
        assert mgr.allocate_slots(req0, 16) is not None
        req0.num_computed_tokens += 16
        tables.append(mgr.get_block_ids("0")[0])
        mgr.check_integrity()
    assert tables == [[1], [1, 2], [1, 2, 3], [0, 2, 3, 4], [0, 0, 3, 4, 5]]
    assert free_ids(mgr) == [6, 7, 1, 2]
    # Every prompt block was cached when its chunk was scheduled.
    assert cached_ids(mgr) == {1, 2, 3, 4, 5}
    mgr.free(req0)
    assert free_ids(mgr) == [6, 7, 1, 2, 5, 4, 3]
    blocks, num_hit = mgr.get_computed_blocks(Req("1", PROMPT + [1], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([0, 0, 0, 4, 5],), 80)


def test_chunked_local_skips_earlier_chunks():
    mgr = make_manager(chunked_spec(32))
    manager = mgr.coordinator.single_type_managers[0]
    assert [manager.get_num_skipped_tokens(n) for n in (0, 31, 32, 33, 80)] == [0, 0, 32, 32, 64]
    hasher = make_hasher(mgr)
    req = Req("0", PROMPT, hasher)
    assert mgr.allocate_slots(req, 80).get_block_ids() == ([1, 2, 3, 4, 5],)
    req.num_computed_tokens = 80
    # Token 80 starts chunk 2 (64..95): blocks of chunks 0 and 1 are released.
    assert decode(mgr, req, 9) == ([6],)
    assert mgr.get_block_ids("0") == ([0, 0, 0, 0, 5, 6],)
    assert free_ids(mgr) == [7, 8, 9, 10, 4, 3, 2, 1]
    mgr.check_integrity()

    # A hit: chunks before the next token's chunk are null ("computed" by definition), then
    # left to right within the chunk.
    blocks, num_hit = mgr.get_computed_blocks(Req("1", PROMPT + [9], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([0, 0, 0, 0, 5],), 80)
    blocks, num_hit = mgr.get_computed_blocks(Req("2", PROMPT[:70] + [9], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([0, 0, 0, 0],), 64)
    blocks, num_hit = mgr.get_computed_blocks(Req("3", [7] * 20, hasher))
    assert (blocks.get_block_ids(), num_hit) == (([],), 0)

    # As in vLLM, a prompt reaching into a later chunk "hits" its earlier chunks even with
    # nothing cached: this layer type never reads them. Adopting that all-null hit takes no
    # block; the new tokens get fresh ones, and the full one is cached at its position.
    req4 = Req("4", [7] * 50, hasher)
    blocks, num_hit = mgr.get_computed_blocks(req4)
    assert (blocks.get_block_ids(), num_hit) == (([0, 0],), 32)
    new = mgr.allocate_slots(req4, 18, num_hit, blocks)
    assert new.get_block_ids() == ([7, 8],)
    assert mgr.get_block_ids("4") == ([0, 0, 7, 8],)
    assert mgr.block_pool.blocks[7].block_hash == req4.block_hashes[2]
    assert mgr.block_pool.blocks[8].block_hash is None
    mgr.free(req4)
    mgr.free(req)
    mgr.check_integrity()
    assert mgr.block_pool.get_num_free_blocks() == 10
