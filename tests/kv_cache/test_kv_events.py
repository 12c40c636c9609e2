"""KV cache events: what entered and left the prefix cache, in order."""

from __future__ import annotations

from pagedkv.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored
from tests.kv_cache.helpers import Req, free_ids, make_hasher, make_manager, prefill

BS = 16


def test_events_follow_the_prefix_cache():
    mgr = make_manager(enable_kv_cache_events=True)
    hasher = make_hasher(mgr)
    p = [0] * BS + [1] * BS + [2] * 8
    prefill(mgr, req_p := Req("p", p, hasher))
    h0, h1 = req_p.block_hashes
    assert mgr.take_events() == [BlockStored((h0, h1), None, tuple(p[:32]), BS, 0)]
    assert mgr.take_events() == []

    # A hit stores nothing; the newly full block is stored with its parent's hash.
    q = p[:32] + [3] * 20
    prefill(mgr, req_q := Req("q", q, hasher))
    assert req_q.block_hashes[:2] == [h0, h1]
    q2 = req_q.block_hashes[2]
    assert mgr.take_events() == [BlockStored((q2,), h1, tuple(q[32:48]), BS, 0)]

    mgr.free(req_p)
    mgr.free(req_q)
    assert free_ids(mgr) == [5, 3, 6, 7, 8, 9, 10, 4, 2, 1]
    assert mgr.take_events() == []  # freeing evicts nothing (lazy eviction)

    # Reusing cached blocks 4 and 2 removes their hashes, in the order they are reused.
    r = list(range(100, 244))
    prefill(mgr, req_r := Req("r", r, hasher))
    assert mgr.get_block_ids("r") == ([5, 3, 6, 7, 8, 9, 10, 4, 2],)
    assert mgr.take_events() == [
        BlockRemoved((q2,), 0),
        BlockRemoved((h1,), 0),
        BlockStored(tuple(req_r.block_hashes), None, tuple(r), BS, 0),
    ]

    # evict_blocks reports what it removed, and nothing for uncached blocks.
    mgr.evict_blocks({1, 5})
    assert mgr.take_events() == [BlockRemoved((h0,), 0), BlockRemoved((req_r.block_hashes[0],), 0)]

    assert mgr.reset_prefix_cache() is False
    assert mgr.take_events() == []
    mgr.free(req_r)
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == [AllBlocksCleared()]


def test_no_events_when_disabled():
    mgr = make_manager()
    hasher = make_hasher(mgr)
    prefill(mgr, req := Req("p", list(range(40)), hasher))
    mgr.evict_blocks({1})
    mgr.free(req)
    assert mgr.reset_prefix_cache()
    assert mgr.block_pool.kv_event_queue == []
    assert mgr.take_events() == []
