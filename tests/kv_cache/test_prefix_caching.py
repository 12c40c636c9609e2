"""Exact-state tests of prefix caching on full attention, in the style of vLLM's
test_prefix_caching.py: 11 blocks of 16 tokens (block 0 is the null block, so blocks 1..10 are
usable), asserting block ids, ref counts, the free queue and the prefix-cache index after each
call."""

from __future__ import annotations

import pytest

from pagedkv.kv_cache.block_hash import token_ids_to_bytes
from tests.kv_cache.helpers import (
    Req,
    cached_ids,
    decode,
    free_ids,
    make_hasher,
    make_manager,
    prefill,
    ref_cnts,
    snapshot,
)

BS = 16


def blocks_of(*token_ids: int) -> list[int]:
    """One full block per id: ``blocks_of(0, 1)`` is 16 zeros then 16 ones."""
    return [t for t in token_ids for _ in range(BS)]


@pytest.fixture
def mgr():
    return make_manager()


@pytest.fixture
def hasher(mgr):
    return make_hasher(mgr)


def test_fresh_pool(mgr):
    pool = mgr.block_pool
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert free_ids(mgr) == list(range(1, 11))
    assert pool.get_num_free_blocks() == 10
    assert mgr.usage == 0.0
    assert pool.num_cached_blocks == 0
    mgr.check_integrity()


def test_prefill_then_shared_prefix(mgr, hasher):
    common = blocks_of(0, 1, 2)
    req0 = Req("0", common + [3] * 7, hasher)
    blocks, num_hit = mgr.get_computed_blocks(req0)
    assert (blocks.get_block_ids(), num_hit) == (([],), 0)
    new = mgr.allocate_slots(req0, 55, num_hit, blocks)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    req0.num_computed_tokens = 55
    assert ref_cnts(mgr, [1, 2, 3, 4]) == [1, 1, 1, 1]
    assert free_ids(mgr) == [5, 6, 7, 8, 9, 10]
    # The three full blocks are cached under the request's own hashes; the partial one is not.
    pool = mgr.block_pool
    assert [pool.blocks[i].block_hash for i in (1, 2, 3)] == req0.block_hashes
    assert pool.blocks[4].block_hash is None
    assert pool.num_cached_blocks == 3
    assert mgr.usage == pytest.approx(0.4)
    mgr.check_integrity()

    # Same three blocks, different tail: a 48-token hit on blocks 1..3 and one new block.
    req1 = Req("1", common + [5] * 5, hasher)
    blocks, num_hit = mgr.get_computed_blocks(req1)
    assert (blocks.get_block_ids(), num_hit) == (([1, 2, 3],), 48)
    # The lookup takes no reference: only allocate_slots adopts the hit.
    assert ref_cnts(mgr, [1, 2, 3]) == [1, 1, 1]
    new = mgr.allocate_slots(req1, 5, num_hit, blocks)
    assert new.get_block_ids() == ([5],)
    assert mgr.get_block_ids("1") == ([1, 2, 3, 5],)
    assert ref_cnts(mgr, [1, 2, 3, 4, 5]) == [2, 2, 2, 1, 1]
    assert free_ids(mgr) == [6, 7, 8, 9, 10]
    mgr.check_integrity()

    # Freeing req0 only drops references: its unhashed tail block 4 goes to the FRONT.
    mgr.free(req0)
    assert ref_cnts(mgr, [1, 2, 3, 4]) == [1, 1, 1, 0]
    assert free_ids(mgr) == [4, 6, 7, 8, 9, 10]
    # req1's blocks are freed tail first: unhashed 5 to the front, cached 3, 2, 1 to the back
    # in that order, so the prefix's tail is evicted before its head.
    mgr.free(req1)
    assert ref_cnts(mgr, [1, 2, 3, 4, 5]) == [0, 0, 0, 0, 0]
    assert free_ids(mgr) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert cached_ids(mgr) == {1, 2, 3}
    mgr.check_integrity()


def test_hit_on_free_blocks_needs_them_counted(mgr, hasher):
    """A hit on cached blocks sitting in the free queue consumes free blocks when touched; an
    allocation that cannot cover them plus its new blocks fails and changes nothing."""
    common = blocks_of(0, 1, 2)
    prefill(mgr, req0 := Req("0", common + [3], hasher))
    mgr.free(req0)
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    # 7 unhashed blocks for an unrelated request: the free queue front is used, no eviction.
    prefill(mgr, req1 := Req("1", blocks_of(*range(10, 16)) + [9] * 7, hasher))
    assert mgr.get_block_ids("1") == ([4, 5, 6, 7, 8, 9, 10],)
    assert free_ids(mgr) == [3, 2, 1]
    assert cached_ids(mgr) == {1, 2, 3, 4, 5, 6, 7, 8, 9}

    req2 = Req("2", common + [4], hasher)
    blocks, num_hit = mgr.get_computed_blocks(req2)
    assert (blocks.get_block_ids(), num_hit) == (([1, 2, 3],), 48)
    before = snapshot(mgr)
    # Touching 1..3 takes 3 of the 3 free blocks; the 49th token needs a 4th.
    assert mgr.allocate_slots(req2, 1, num_hit, blocks) is None
    assert snapshot(mgr) == before
    mgr.check_integrity()

    # req1 ends: its unhashed tail 10 goes to the front, its cached blocks to the back.
    mgr.free(req1)
    assert free_ids(mgr) == [10, 3, 2, 1, 9, 8, 7, 6, 5, 4]
    new = mgr.allocate_slots(req2, 1, num_hit, blocks)
    assert new.get_block_ids() == ([10],)
    assert mgr.get_block_ids("2") == ([1, 2, 3, 10],)
    assert free_ids(mgr) == [9, 8, 7, 6, 5, 4]
    mgr.check_integrity()


def test_hit_is_block_aligned_and_never_the_whole_prompt(mgr, hasher):
    prompt = blocks_of(0, 1, 2)
    num_hit, new = prefill(mgr, Req("0", prompt, hasher))
    assert (num_hit, new) == (0, ([1, 2, 3],))
    assert cached_ids(mgr) == {1, 2, 3}

    # Exactly the 3 cached blocks: the last token must be recomputed, so only 2 blocks hit.
    req1 = Req("1", prompt, hasher)
    blocks, num_hit = mgr.get_computed_blocks(req1)
    assert (blocks.get_block_ids(), num_hit) == (([1, 2],), 32)
    new = mgr.allocate_slots(req1, 16, num_hit, blocks)
    assert new.get_block_ids() == ([4],)
    # Block 4 holds the same prefix as block 3: both stay indexed under the one hash (no
    # de-duplication: a running request's block table never changes).
    pool = mgr.block_pool
    assert pool.blocks[4].block_hash == pool.blocks[3].block_hash == req1.block_hashes[2]
    assert sorted(pool.cached_block_hash_to_block[0][req1.block_hashes[2]]) == [3, 4]
    assert pool.get_cached_block(req1.block_hashes[2], [0])[0].block_id == 3
    mgr.check_integrity()

    # One token more and all three blocks hit.
    blocks, num_hit = mgr.get_computed_blocks(Req("2", prompt + [7], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1, 2, 3],), 48)
    # A partial match of block 1 hits only block 0.
    blocks, num_hit = mgr.get_computed_blocks(Req("3", prompt[:24] + [9] * 30, hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1],), 16)
    # A different first block misses everything after it (hashes are chained).
    blocks, num_hit = mgr.get_computed_blocks(Req("4", blocks_of(5) + prompt[16:] + [1], hasher))
    assert (blocks.get_block_ids(), num_hit) == (([],), 0)
    # Fewer than 16 tokens: no full block, no hash, no hit.
    short = Req("5", prompt[:15], hasher)
    assert short.block_hashes == []
    assert mgr.get_computed_blocks(short)[1] == 0


def test_decode_gets_a_new_block_every_16_tokens(mgr, hasher):
    req = Req("0", blocks_of(0) + [1], hasher)
    assert prefill(mgr, req) == (0, ([1, 2],))
    pool = mgr.block_pool
    assert cached_ids(mgr) == {1}
    for num_tokens in range(18, 33):
        assert decode(mgr, req, 5) == ([],)
        assert req.num_tokens == num_tokens
        # Block 2 is cached in the step that fills it (its 32nd token gets a slot).
        assert (pool.blocks[2].block_hash is not None) == (num_tokens == 32)
    assert pool.blocks[2].block_hash == req.block_hashes[1]
    assert decode(mgr, req, 5) == ([3],)
    assert req.num_tokens == 33
    for _ in range(34, 49):
        assert decode(mgr, req, 6) == ([],)
    assert decode(mgr, req, 6) == ([4],)
    assert mgr.get_block_ids("0") == ([1, 2, 3, 4],)
    assert cached_ids(mgr) == {1, 2, 3}
    assert free_ids(mgr) == [5, 6, 7, 8, 9, 10]
    # A later request with the generated text as its prompt hits all of it.
    blocks, num_hit = mgr.get_computed_blocks(Req("1", req.all_token_ids, hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1, 2, 3],), 48)


def test_lookahead_tokens_get_slots_but_are_not_cached(mgr, hasher):
    req = Req("0", blocks_of(0) + [1], hasher)
    new = mgr.allocate_slots(req, 17, num_lookahead_tokens=20)
    # 17 + 20 lookahead slots need 3 blocks; only the one full block of real tokens is cached.
    assert new.get_block_ids() == ([1, 2, 3],)
    assert cached_ids(mgr) == {1}
    mgr.check_integrity()


def test_eviction_is_lru_with_a_prompts_tail_first(mgr, hasher):
    a = blocks_of(0, 1, 2) + [3]
    b = blocks_of(4, 5, 6) + [7]
    prefill(mgr, req_a := Req("a", a, hasher))
    prefill(mgr, req_b := Req("b", b, hasher))
    assert mgr.get_block_ids("a") == ([1, 2, 3, 4],)
    assert mgr.get_block_ids("b") == ([5, 6, 7, 8],)
    assert free_ids(mgr) == [9, 10]
    mgr.free(req_a)
    assert free_ids(mgr) == [4, 9, 10, 3, 2, 1]
    mgr.free(req_b)
    assert free_ids(mgr) == [8, 4, 9, 10, 3, 2, 1, 7, 6, 5]

    # 81 tokens need 6 blocks: the 4 unhashed ones, then a's tail 3 and 2 (freed earlier than
    # b's blocks, and tail first), so a keeps only its head block 1.
    prefill(mgr, Req("c", blocks_of(*range(20, 25)) + [9], hasher))
    assert mgr.get_block_ids("c") == ([8, 4, 9, 10, 3, 2],)
    assert free_ids(mgr) == [1, 7, 6, 5]
    assert cached_ids(mgr) == {1, 5, 6, 7} | {8, 4, 9, 10, 3}
    blocks, num_hit = mgr.get_computed_blocks(Req("a2", a, hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1],), 16)
    blocks, num_hit = mgr.get_computed_blocks(Req("b2", b, hasher))
    assert (blocks.get_block_ids(), num_hit) == (([5, 6, 7],), 48)
    mgr.check_integrity()


def test_lazy_eviction_keeps_freed_blocks_hittable_until_reused(mgr, hasher):
    prompt = blocks_of(0, 1) + [2]
    prefill(mgr, req0 := Req("0", prompt, hasher))
    mgr.free(req0)
    assert free_ids(mgr) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert cached_ids(mgr) == {1, 2}

    # Still hittable while free: the hit pulls 1 and 2 out of the middle of the queue.
    num_hit, new = prefill(mgr, req1 := Req("1", prompt, hasher))
    assert (num_hit, new) == (32, ([3],))
    assert mgr.get_block_ids("1") == ([1, 2, 3],)
    assert ref_cnts(mgr, [1, 2, 3]) == [1, 1, 1]
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9, 10]
    mgr.free(req1)
    assert free_ids(mgr) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]

    # 9 blocks: 8 unhashed ones, then block 2 is reused and only then loses its hash.
    prefill(mgr, Req("2", blocks_of(*range(10, 18)) + [5], hasher))
    assert mgr.get_block_ids("2")[0][-1] == 2
    assert cached_ids(mgr) == {1, 3, 4, 5, 6, 7, 8, 9, 10}
    assert mgr.block_pool.get_cached_block(req1.block_hashes[1], [0]) is None
    blocks, num_hit = mgr.get_computed_blocks(Req("3", prompt, hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1],), 16)
    mgr.check_integrity()


def test_cache_salt_isolates_tenants(mgr, hasher):
    prompt = blocks_of(0, 1, 2) + [3]
    plain = Req("plain", prompt, hasher)
    salted = Req("salted", prompt, hasher, cache_salt="tenant-b")
    # The salt enters block 0 only, but chaining carries it into every later hash.
    assert all(x != y for x, y in zip(plain.block_hashes, salted.block_hashes))
    for req in (plain, salted):
        for i in (1, 2):
            data = token_ids_to_bytes(prompt[i * BS : (i + 1) * BS])
            assert req.block_hashes[i] == hasher.hash_fn(req.block_hashes[i - 1] + data)

    prefill(mgr, plain)
    assert mgr.get_computed_blocks(salted)[1] == 0
    prefill(mgr, salted)
    assert mgr.get_block_ids("salted") == ([5, 6, 7, 8],)
    # Same salt: a hit on the salted copy; no salt: a hit on the plain copy.
    blocks, num_hit = mgr.get_computed_blocks(Req("s2", prompt, hasher, cache_salt="tenant-b"))
    assert (blocks.get_block_ids(), num_hit) == (([5, 6, 7],), 48)
    blocks, num_hit = mgr.get_computed_blocks(Req("p2", prompt, hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1, 2, 3],), 48)
    assert mgr.get_computed_blocks(Req("c", prompt, hasher, cache_salt="tenant-c"))[1] == 0


def test_adapter_id_isolates_every_block(mgr, hasher):
    prompt = blocks_of(0, 1, 2) + [3]
    base = Req("base", prompt, hasher)
    lora = Req("lora", prompt, hasher, adapter_id="lora-1")
    assert all(x != y for x, y in zip(base.block_hashes, lora.block_hashes))
    # Unlike the salt, the adapter id is part of every block's own hash input.
    data1 = token_ids_to_bytes(prompt[BS : 2 * BS])
    assert base.block_hashes[1] == hasher.hash_fn(base.block_hashes[0] + data1)
    assert lora.block_hashes[1] != hasher.hash_fn(lora.block_hashes[0] + data1)

    prefill(mgr, lora)
    assert mgr.get_computed_blocks(base)[1] == 0
    assert mgr.get_computed_blocks(Req("l2", prompt, hasher, adapter_id="lora-2"))[1] == 0
    blocks, num_hit = mgr.get_computed_blocks(Req("l1", prompt, hasher, adapter_id="lora-1"))
    assert (blocks.get_block_ids(), num_hit) == (([1, 2, 3],), 48)


def test_allocation_failure_changes_nothing(mgr, hasher):
    prefill(mgr, req0 := Req("0", blocks_of(0, 1, 2, 3, 4, 5) + [1], hasher))
    assert free_ids(mgr) == [8, 9, 10]
    before = snapshot(mgr)
    # A running request (97 tokens in 7 blocks) asking for 161 slots: 4 more blocks, 3 free.
    req0.append_output_token_ids([2] * 64)
    assert mgr.allocate_slots(req0, 64) is None
    assert snapshot(mgr) == before
    # A new request whose prompt does not fit.
    assert mgr.allocate_slots(Req("1", blocks_of(7, 8, 9, 10) + [2], hasher), 65) is None
    assert snapshot(mgr) == before
    mgr.check_integrity()
    # Exactly what is free (160 slots) succeeds.
    assert mgr.allocate_slots(req0, 63).get_block_ids() == ([8, 9, 10],)
    assert free_ids(mgr) == []
    assert mgr.usage == 1.0
    mgr.check_integrity()


def test_full_sequence_must_fit(mgr, hasher):
    long_req = Req("long", list(range(200)), hasher)
    before = snapshot(mgr)
    # The first 16-token chunk fits, but the 200-token prompt (13 blocks) never will.
    assert mgr.allocate_slots(long_req, 16, full_sequence_must_fit=True) is None
    assert snapshot(mgr) == before
    assert mgr.allocate_slots(long_req, 16).get_block_ids() == ([1],)
    mgr.free(long_req)

    # Block 1 was cached (its 16 tokens got a slot), so it went to the back.
    assert free_ids(mgr) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 1]
    # 160 tokens fill exactly the 10 free blocks.
    fits = Req("fits", list(range(300, 460)), hasher)
    new = mgr.allocate_slots(fits, 16, full_sequence_must_fit=True)
    assert new.get_block_ids() == ([2],)
    mgr.check_integrity()


def test_full_sequence_must_fit_counts_free_hit_blocks(mgr, hasher):
    prompt = blocks_of(0, 1, 2, 3) + [4]
    prefill(mgr, req0 := Req("0", prompt, hasher))
    mgr.free(req0)
    prefill(mgr, Req("other", blocks_of(9, 8, 9, 8) + [1], hasher))
    assert free_ids(mgr) == [10, 4, 3, 2, 1]
    req = Req("1", prompt + list(range(20, 36)), hasher)
    blocks, num_hit = mgr.get_computed_blocks(req)
    assert (blocks.get_block_ids(), num_hit) == (([1, 2, 3, 4],), 64)
    # The whole sequence needs 6 blocks: 4 hit blocks that are free now + 2 new, 5 are free.
    before = snapshot(mgr)
    assert mgr.allocate_slots(req, 1, num_hit, blocks, full_sequence_must_fit=True) is None
    assert snapshot(mgr) == before
    # Without the gate the first chunk fits.
    assert mgr.allocate_slots(req, 1, num_hit, blocks).get_block_ids() == ([10],)
    mgr.check_integrity()


def test_delay_cache_blocks_then_cache_blocks(mgr, hasher):
    prompt = blocks_of(0, 1, 2) + [3]
    req = Req("0", prompt, hasher)
    new = mgr.allocate_slots(req, 49, delay_cache_blocks=True)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    assert cached_ids(mgr) == set()
    assert new.get_unhashed_block_ids() == [1, 2, 3, 4]
    assert mgr.get_computed_blocks(Req("x", prompt, hasher))[1] == 0
    # The KV landed: index the full blocks among the first 32 tokens, then all.
    mgr.cache_blocks(req, 32)
    assert cached_ids(mgr) == {1, 2}
    mgr.cache_blocks(req, 49)
    assert cached_ids(mgr) == {1, 2, 3}
    assert mgr.get_blocks("0").get_unhashed_block_ids() == [4]
    blocks, num_hit = mgr.get_computed_blocks(Req("y", prompt, hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1, 2, 3],), 48)
    mgr.check_integrity()


@pytest.mark.parametrize("delay", [True, False])
def test_external_computed_tokens(mgr, hasher, delay):
    """| local hit 32 | external 48 (a connector loads them) | new 20 |"""
    prompt = list(range(100))
    prefill(mgr, req0 := Req("0", prompt[:33], hasher))
    mgr.free(req0)
    assert free_ids(mgr) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]

    req = Req("1", prompt, hasher)
    blocks, num_hit = mgr.get_computed_blocks(req)
    assert (blocks.get_block_ids(), num_hit) == (([1, 2],), 32)
    if delay:
        # Async load: no new tokens this step; the loaded blocks stay out of the index.
        new = mgr.allocate_slots(
            req, 0, num_hit, blocks, num_external_computed_tokens=48, delay_cache_blocks=True
        )
        assert new.get_block_ids() == ([],)
        assert mgr.get_block_ids("1") == ([1, 2, 3, 4, 5],)
        assert cached_ids(mgr) == {1, 2}
        req.num_computed_tokens = 80
        mgr.cache_blocks(req, 80)
        assert cached_ids(mgr) == {1, 2, 3, 4, 5}
        new = mgr.allocate_slots(req, 20)
    else:
        new = mgr.allocate_slots(req, 20, num_hit, blocks, num_external_computed_tokens=48)
    # Only the blocks for the new tokens are returned; the external ones came first.
    assert new.get_block_ids() == ([6, 7],)
    assert mgr.get_block_ids("1") == ([1, 2, 3, 4, 5, 6, 7],)
    assert ref_cnts(mgr, [1, 2, 3, 4, 5, 6, 7]) == [1] * 7
    assert cached_ids(mgr) == {1, 2, 3, 4, 5, 6}
    assert free_ids(mgr) == [8, 9, 10]
    mgr.check_integrity()


def test_evict_blocks(mgr, hasher):
    prompt = blocks_of(0, 1, 2) + [3]
    prefill(mgr, req0 := Req("0", prompt, hasher))
    # Evicting a held block drops it from the index only; the holder keeps it.
    mgr.evict_blocks({2})
    assert cached_ids(mgr) == {1, 3}
    assert ref_cnts(mgr, [2]) == [1]
    assert mgr.get_block_ids("0") == ([1, 2, 3, 4],)
    blocks, num_hit = mgr.get_computed_blocks(Req("1", prompt, hasher))
    assert (blocks.get_block_ids(), num_hit) == (([1],), 16)
    mgr.check_integrity()
    # Now unhashed, block 2 goes to the front when freed, next to the tail block 4.
    mgr.free(req0)
    assert free_ids(mgr) == [4, 2, 5, 6, 7, 8, 9, 10, 3, 1]
    # Evicting a free cached block (or an uncached one) keeps the free queue as it is.
    mgr.evict_blocks({1, 7})
    assert cached_ids(mgr) == {3}
    assert free_ids(mgr) == [4, 2, 5, 6, 7, 8, 9, 10, 3, 1]
    assert mgr.get_computed_blocks(Req("2", prompt, hasher))[1] == 0
    mgr.check_integrity()


def test_reset_prefix_cache(mgr, hasher):
    prompt = blocks_of(0, 1) + [3]
    prefill(mgr, req0 := Req("0", prompt, hasher))
    before = snapshot(mgr)
    assert mgr.reset_prefix_cache() is False  # refused while a request holds blocks
    assert snapshot(mgr) == before
    mgr.free(req0)
    order = free_ids(mgr)
    assert mgr.reset_prefix_cache() is True
    assert cached_ids(mgr) == set()
    assert mgr.block_pool.num_cached_blocks == 0
    assert free_ids(mgr) == order
    assert mgr.get_computed_blocks(Req("1", prompt, hasher))[1] == 0
    mgr.check_integrity()


def test_usage_and_prefix_cache_stats(mgr, hasher):
    assert mgr.usage == 0.0
    prompt = blocks_of(0, 1, 2) + [3]
    req0 = Req("0", prompt, hasher)
    num_hit, _ = prefill(mgr, req0)
    mgr.record_prefix_cache_stats(req0, num_hit)
    assert mgr.usage == pytest.approx(0.4)
    req1 = Req("1", prompt, hasher)
    num_hit, _ = prefill(mgr, req1)
    mgr.record_prefix_cache_stats(req1, num_hit)
    # The hit adds references, not blocks.
    assert mgr.usage == pytest.approx(0.5)
    stats = mgr.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 98, 48)
    assert stats.hit_rate == pytest.approx(48 / 98)
    mgr.free(req0)
    mgr.free(req1)
    assert mgr.usage == 0.0


def test_caching_disabled(hasher):
    mgr = make_manager(enable_caching=False)
    prompt = blocks_of(0, 1, 2) + [3]
    assert prefill(mgr, req0 := Req("0", prompt, hasher)) == (0, ([1, 2, 3, 4],))
    assert cached_ids(mgr) == set()
    assert mgr.get_computed_blocks(Req("1", prompt, hasher))[1] == 0
    mgr.free(req0)
    # Nothing is cached, so every freed block goes to the front, the tail first.
    assert free_ids(mgr) == [4, 3, 2, 1, 5, 6, 7, 8, 9, 10]
    mgr.check_integrity()
