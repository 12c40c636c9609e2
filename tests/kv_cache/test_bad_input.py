"""Bad input is a ValueError that names the problem, and leaves the manager as it was."""

from __future__ import annotations

import pytest

from pagedkv.kv_cache import (
    BlockHasher,
    BlockPool,
    BlockTable,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    MultiGroupBlockTable,
    SlidingWindowSpec,
)
from tests.kv_cache.helpers import (
    SPEC_KW,
    Req,
    full_spec,
    make_config,
    make_hasher,
    make_manager,
    prefill,
    snapshot,
    swa_spec,
)


@pytest.fixture
def busy():
    """A manager with one running request, one freed (cached) request, and a hasher."""
    mgr = make_manager(full_spec(), swa_spec(32), num_blocks=21)
    hasher = make_hasher(mgr)
    prefill(mgr, Req("running", list(range(40)), hasher))
    prefill(mgr, done := Req("done", list(range(100, 150)), hasher))
    mgr.free(done)
    return mgr, hasher


def assert_rejected(mgr, match, fn, *args, **kwargs):
    before = snapshot(mgr)
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)
    assert snapshot(mgr) == before
    mgr.check_integrity()


def test_allocate_for_unknown_request(busy):
    mgr, hasher = busy
    ghost = Req("ghost", list(range(40)), hasher)
    ghost.num_computed_tokens = 16  # claims computed tokens, holds no blocks
    assert_rejected(mgr, "'ghost' is unknown.*16 computed tokens", mgr.allocate_slots, ghost, 8)


def test_free_twice_or_never_allocated(busy):
    mgr, hasher = busy
    done = Req("done", list(range(100, 150)), hasher)
    assert_rejected(mgr, "'done' holds no KV cache blocks", mgr.free, done)
    assert_rejected(mgr, "'new' holds no KV cache blocks", mgr.free, Req("new", [1], hasher))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_new_tokens=-1), "num_new_tokens=-1"),
        (dict(num_new_tokens=4, num_new_computed_tokens=-16), "num_new_computed_tokens=-16"),
        (
            dict(num_new_tokens=4, num_external_computed_tokens=-2),
            "num_external_computed_tokens=-2",
        ),
        (dict(num_new_tokens=4, num_lookahead_tokens=-1), "num_lookahead_tokens"),
        (dict(num_new_tokens=0), "needs new tokens or computed tokens"),
    ],
)
def test_bad_token_counts(busy, kwargs, match):
    mgr, hasher = busy
    req = Req("new", list(range(200, 240)), hasher)
    assert_rejected(mgr, match, mgr.allocate_slots, req, **kwargs)


def test_zero_tokens_for_a_running_request(busy):
    mgr, hasher = busy
    req = Req("running", list(range(40)), hasher)
    req.num_computed_tokens = 40
    assert_rejected(mgr, "needs new tokens", mgr.allocate_slots, req, 0)


def test_computed_tokens_must_match_the_hit_blocks(busy):
    """Claiming a hit without its blocks would cache never-computed blocks under its hashes."""
    mgr, hasher = busy
    req = Req("new", list(range(100, 150)), hasher)
    blocks, num_hit = mgr.get_computed_blocks(req)
    assert num_hit == 48
    assert_rejected(mgr, "num_new_computed_tokens=48", mgr.allocate_slots, req, 2, num_hit)
    assert_rejected(mgr, "num_new_computed_tokens=32", mgr.allocate_slots, req, 2, 32, blocks)
    # A running request has no new hit to adopt.
    running = Req("running", list(range(40)) + [1], hasher)
    running.num_computed_tokens = 40
    assert_rejected(
        mgr, "num_new_computed_tokens=48", mgr.allocate_slots, running, 1, num_hit, blocks
    )
    # The matching hit is accepted.
    assert mgr.allocate_slots(req, 2, num_hit, blocks) is not None
    mgr.check_integrity()


@pytest.mark.parametrize("block_ids", [{0}, {21}, {-1}, {2, 99}, {"3"}])
def test_evict_blocks_outside_the_pool(busy, block_ids):
    mgr, _ = busy
    assert_rejected(mgr, "not a block of this pool", mgr.evict_blocks, block_ids)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SlidingWindowSpec(block_size=16, sliding_window=0, **SPEC_KW), "sliding_window"),
        (lambda: SlidingWindowSpec(block_size=16, sliding_window=-4, **SPEC_KW), "sliding_window"),
        (
            lambda: ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=0, **SPEC_KW),
            "attention_chunk_size",
        ),
        (lambda: FullAttentionSpec(block_size=0, **SPEC_KW), "block_size"),
        (lambda: FullAttentionSpec(block_size=16.0, **SPEC_KW), "block_size"),  # type: ignore[arg-type]
        (lambda: FullAttentionSpec(block_size=True, **SPEC_KW), "block_size"),
        (lambda: FullAttentionSpec(block_size=16, num_kv_heads=0, head_size=8), "num_kv_heads"),
        (lambda: FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=-8), "head_size"),
        (
            lambda: FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="fp16"),
            "dtype must be one of",
        ),
        (
            lambda: FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="float64"),
            "dtype must be one of",
        ),
        (lambda: make_config(full_spec(), num_blocks=1), "num_blocks must be an integer >= 2"),
        (lambda: make_config(full_spec(), num_blocks=0), "num_blocks"),
        (lambda: KVCacheConfig(num_blocks=10, kv_cache_groups=()), "kv_cache_groups"),
        (lambda: BlockPool(1), "num_blocks must be an integer >= 2"),
        (lambda: KVCacheManager(make_config(full_spec()), max_model_len=0), "max_model_len"),
        (lambda: BlockHasher(0), "block_size"),
        (lambda: BlockHasher(16, "sha1"), "'sha1'"),
        (lambda: BlockHasher(4).hash_token_ids([1, -2, 3, 4]), "token ids"),
        (lambda: BlockHasher(4).hash_token_ids([1, 2**32, 3, 4]), "token ids"),
        (lambda: BlockTable(0, 4, 4), "block_size"),
        (lambda: BlockTable(16, 0, 4), "max_num_reqs"),
        (lambda: BlockTable(16, 4, -1), "max_num_blocks_per_req"),
        (lambda: MultiGroupBlockTable([16, 32], 4, [4]), "one max_num_blocks per block size"),
    ],
)
def test_bad_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_block_table_rejects_overflow_and_group_mismatch():
    table = BlockTable(4, max_num_reqs=2, max_num_blocks_per_req=3)
    table.add_row([5, 6], 0)
    with pytest.raises(ValueError, match="max_num_blocks_per_req=3"):
        table.append_row([7, 8], 0)
    assert table.get_row(0).tolist() == [5, 6]
    multi = MultiGroupBlockTable([4, 8], max_num_reqs=2, max_num_blocks=[3, 3])
    with pytest.raises(ValueError, match="2 KV cache groups, got 1"):
        multi.append_row(([1, 2],), 0)
    with pytest.raises(ValueError, match="2 KV cache groups, got 3"):
        multi.add_row(([1], [2], [3]), 1)
    assert multi[0].get_row(0).tolist() == [] and multi[1].get_row(1).tolist() == []
    # A row is written in every group or in none.
    uneven = MultiGroupBlockTable([4, 8], max_num_reqs=1, max_num_blocks=[3, 1])
    uneven.add_row(([1], [2]), 0)
    with pytest.raises(ValueError, match="row 0 would hold 2 blocks"):
        uneven.append_row(([3], [4]), 0)
    with pytest.raises(ValueError, match="row 0 would hold 2 blocks"):
        uneven.add_row(([5, 6], [7, 8]), 0)
    assert [uneven[0].get_row(0).tolist(), uneven[1].get_row(0).tolist()] == [[1], [2]]
