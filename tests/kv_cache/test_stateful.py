"""Property-based (stateful) tests of the KV cache manager.

A scheduler-like driver runs random sequences of arrive / lookup / admit (whole prompt, a
chunk, or with connector-loaded tokens, sync or async) / step (prefill chunk or decode) /
finish / evict / reset_prefix_cache against tiny pools, so allocation failures, evictions and
prefix hits are frequent. A shadow model records which token prefix each written block holds.
After every step:

* ``check_integrity`` passes; a block is free iff its ref_cnt is 0; free + used = total;
* every prefix-cache entry names a block whose content is exactly the hashed prefix;
* every full block a running request has computed is cached (unless evicted on purpose);
* with events on, replaying them reproduces the index;
and every lookup returns exactly the request's own prefix, of the longest length that the
index allows (checked against a reference of each attention type's rule). Teardown frees
everything and checks that nothing leaked.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedkv.kv_cache import (
    NULL_BLOCK_ID,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.utils import cdiv
from tests.kv_cache.helpers import (
    Req,
    chunked_spec,
    free_ids,
    full_spec,
    make_hasher,
    make_manager,
    snapshot,
    swa_spec,
)

BS = 4
VOCAB = 4
MAX_TOKENS = 64
MAX_MODEL_LEN = 128
MAX_REQS = 6
# A few shared stems over a tiny vocabulary, so that prompts share prefixes and hits happen.
_rng = random.Random(0)
STEMS = [[_rng.randrange(VOCAB) for _ in range(48)] for _ in range(2)]

WAITING, LOADING, RUNNING = "waiting", "loading", "running"


@st.composite
def _prompts(draw):
    """A stem's prefix plus a short random suffix; rarely a cache salt or an adapter."""
    stem = draw(st.sampled_from(STEMS))
    token_ids = stem[: draw(st.integers(0, 48))]
    token_ids += draw(st.lists(st.integers(0, VOCAB - 1), max_size=8))
    cache_salt = draw(st.sampled_from([None, None, None, "t1"]))
    adapter_id = draw(st.sampled_from([None, None, None, "lora"]))
    return token_ids or [0], cache_salt, adapter_id


PROMPTS = _prompts()


def prefix_key(req: Req, num_tokens: int) -> tuple:
    return (req.cache_salt, req.adapter_id, tuple(req.all_token_ids[:num_tokens]))


class KVCacheMachine(RuleBasedStateMachine):
    """Subclasses pick the attention layout in ``make_specs``."""

    def make_specs(self, data) -> list:
        raise NotImplementedError

    # ------------------------------------------------------------------ setup
    @initialize(
        data=st.data(),
        num_blocks=st.integers(6, 28),
        events=st.booleans(),
        prompts=st.lists(PROMPTS, min_size=2, max_size=4),
    )
    def setup(self, data, num_blocks, events, prompts):
        self.specs = self.make_specs(data)
        num_blocks *= len(self.specs)  # groups share the pool
        self.mgr = make_manager(
            *self.specs,
            num_blocks=num_blocks,
            max_model_len=MAX_MODEL_LEN,
            enable_kv_cache_events=events,
        )
        self.num_blocks = num_blocks
        self.hasher = make_hasher(self.mgr)
        self.reqs: dict[str, Req] = {}
        self.status: dict[str, str] = {}
        self.next_id = 0
        # Shadow model: block id -> the prefix whose last block it holds (once written).
        self.content: dict[int, tuple] = {}
        # Held blocks dropped from the index by evict_blocks (their holders never re-cache).
        self.evicted_held: set[int] = set()
        # Mirror of the prefix-cache index rebuilt from events: (group, hash) -> #blocks.
        self.event_index: Counter = Counter()
        self.history: list[tuple] = []
        # Start with a few requests: swarm testing may switch ``arrive`` off.
        for prompt in prompts:
            self.arrive(prompt)

    # ------------------------------------------------------------------ helpers
    def _pick(self, data, *statuses: str) -> Req:
        ids = sorted(rid for rid, s in self.status.items() if s in statuses)
        return self.reqs[data.draw(st.sampled_from(ids))]

    def _has(self, *statuses: str) -> bool:
        return any(s in statuses for s in self.status.values())

    def _tables(self, req: Req) -> tuple[list[int], ...]:
        return self.mgr.get_block_ids(req.request_id)

    def _record_written(self, req: Req, before: tuple[list[int], ...], written: int) -> None:
        """After an allocation. ``before``: per group, the table (block ids by position) the
        request already held or adopted as a hit; any other block at a position is fresh and
        loses its old content (a block released by the window may come back at a new
        position in the same call). Blocks holding tokens computed by now record the prefix
        they hold."""
        for g, table in enumerate(self._tables(req)):
            for i, bid in enumerate(table):
                if bid == NULL_BLOCK_ID:
                    continue
                kept = i < len(before[g]) and before[g][i] == bid
                if not kept:
                    self.content.pop(bid, None)
                    self.evicted_held.discard(bid)
                if (i + 1) * BS <= written:
                    key = prefix_key(req, (i + 1) * BS)
                    # A block already held or adopted keeps what it held.
                    assert not kept or self.content.get(bid, key) == key
                    self.content[bid] = key

    def _expected_hit(self, req: Req) -> int:
        """The longest hit, in blocks, that each group's rule allows given the index."""
        max_len = req.num_tokens - 1
        hashes = req.block_hashes
        max_blocks = min(max_len // BS, len(hashes))
        indexes = self.mgr.block_pool.cached_block_hash_to_block

        def cached(g, i):
            return hashes[i] in indexes[g]

        limit = max_blocks
        result = None
        for g, spec in enumerate(self.specs):
            if isinstance(spec, FullAttentionSpec):
                n = 0
                while n < limit and cached(g, n):
                    n += 1
            elif isinstance(spec, SlidingWindowSpec):
                need = cdiv(spec.sliding_window - 1, BS)
                n = next(
                    (
                        n
                        for n in range(limit, 0, -1)
                        if all(cached(g, i) for i in range(max(0, n - need), n))
                    ),
                    0,
                )
            else:
                assert isinstance(spec, ChunkedLocalAttentionSpec)
                chunk = spec.attention_chunk_size
                n = (max_len // chunk * chunk) // BS if max_len > 0 else 0
                while n < limit and cached(g, n):
                    n += 1
            # Groups are listed full attention first, so later groups search below its hit.
            limit = n if result is None else min(limit, n)
            result = n if result is None else min(result, n)
        return result

    def _check_hit(self, req: Req, blocks, num_hit: int) -> None:
        event("lookup: hit" if num_hit else "lookup: miss")
        assert num_hit % BS == 0
        assert num_hit == 0 or num_hit < req.num_tokens
        assert num_hit // BS == self._expected_hit(req)
        pool = self.mgr.block_pool
        for g, table in enumerate(blocks.blocks):
            assert len(table) == num_hit // BS
            for i, block in enumerate(table):
                if block.is_null:
                    continue
                # Exactly the block holding this request's own prefix up to block i.
                assert self.content[block.block_id] == prefix_key(req, (i + 1) * BS)
                assert block.block_hash == req.block_hashes[i]
                assert pool.cached_block_hash_to_block[g].get(req.block_hashes[i]) is not None

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.reqs) < MAX_REQS)
    @rule(prompt=PROMPTS)
    def arrive(self, prompt):
        token_ids, cache_salt, adapter_id = prompt
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.reqs[rid] = Req(rid, token_ids, self.hasher, cache_salt, adapter_id)
        self.status[rid] = WAITING
        self.history.append(prompt)

    @precondition(lambda self: len(self.reqs) < MAX_REQS)
    @rule(
        data=st.data(),
        keep=st.none() | st.integers(1, 64),
        more=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    )
    def arrive_again(self, data, keep, more):
        """An earlier prompt (or a request's text so far) comes back, whole or cut, maybe
        extended: a chat turn."""
        token_ids, cache_salt, adapter_id = data.draw(st.sampled_from(self.history))
        for req in self.reqs.values():
            if req.all_token_ids[: len(token_ids)] == token_ids and data.draw(st.booleans()):
                token_ids = req.all_token_ids
        self.arrive((token_ids[:keep] + more, cache_salt, adapter_id))

    @precondition(lambda self: self._has(WAITING))
    @rule(data=st.data())
    def lookup(self, data):
        """A lookup alone changes nothing (the hit is adopted only by allocate_slots)."""
        req = self._pick(data, WAITING)
        before = snapshot(self.mgr)
        blocks, num_hit = self.mgr.get_computed_blocks(req)
        self._check_hit(req, blocks, num_hit)
        assert snapshot(self.mgr) == before

    @precondition(lambda self: self._has(WAITING))
    @rule(
        data=st.data(),
        mode=st.sampled_from(["all", "chunk", "external", "external_async"]),
        full_sequence_must_fit=st.booleans(),
    )
    def admit(self, data, mode, full_sequence_must_fit):
        req = self._pick(data, WAITING)
        mgr = self.mgr
        blocks, num_hit = mgr.get_computed_blocks(req)
        self._check_hit(req, blocks, num_hit)
        remaining = req.num_tokens - num_hit
        num_external = 0
        if mode.startswith("external") and remaining > 1:
            num_external = data.draw(st.integers(1, remaining - 1), label="num_external")
        remaining -= num_external
        if mode == "external_async" and num_external:
            num_new = 0
        elif mode == "chunk":
            num_new = data.draw(st.integers(1, remaining), label="chunk")
        else:
            num_new = remaining
        hit_tables = blocks.get_block_ids()
        before_state = snapshot(mgr)
        new = mgr.allocate_slots(
            req,
            num_new,
            num_hit,
            blocks,
            num_external_computed_tokens=num_external,
            delay_cache_blocks=num_new == 0,
            full_sequence_must_fit=full_sequence_must_fit,
        )
        if new is None:
            event("admit: no room")
            assert snapshot(mgr) == before_state
            return
        event(f"admit: {mode}")
        req.num_computed_tokens = num_hit + num_external + num_new
        self.status[req.request_id] = RUNNING if num_new else LOADING
        # Until an async load lands, only the hit's blocks hold known tokens.
        self._record_written(req, hit_tables, req.num_computed_tokens if num_new else num_hit)

    @precondition(lambda self: self._has(LOADING))
    @rule(data=st.data())
    def finish_loading(self, data):
        req = self._pick(data, LOADING)
        self._record_written(req, self._tables(req), req.num_computed_tokens)
        self.mgr.cache_blocks(req, req.num_computed_tokens)
        self.status[req.request_id] = RUNNING

    @precondition(lambda self: self._has(RUNNING))
    @rule(
        data=st.data(),
        token=st.integers(0, VOCAB - 1),
        num_lookahead_tokens=st.sampled_from([0, 0, 0, 3]),
        skip_first=st.booleans(),
        preempt_on_failure=st.booleans(),
    )
    def step(self, data, token, num_lookahead_tokens, skip_first, preempt_on_failure):
        """One scheduler step of a running request: a prefill chunk, or a decode token."""
        req = self._pick(data, RUNNING)
        mgr = self.mgr
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens >= MAX_TOKENS:
                return
            req.append_output_token_ids([token])
        remaining = req.num_tokens - req.num_computed_tokens
        num_new = data.draw(st.integers(1, remaining), label="num_new")
        if skip_first:
            # What allocate_slots does first anyway; it is the one change a failure keeps.
            mgr.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        before_state = snapshot(mgr)
        before = self._tables(req)
        new = mgr.allocate_slots(req, num_new, num_lookahead_tokens=num_lookahead_tokens)
        event("step: no room" if new is None else "step: allocated")
        if new is None:
            if skip_first:
                assert snapshot(mgr) == before_state
            if preempt_on_failure:
                # Preemption by recompute: free everything, back to waiting.
                mgr.free(req)
                req.num_computed_tokens = 0
                self.status[req.request_id] = WAITING
            return
        req.num_computed_tokens += num_new
        self._record_written(req, before, min(req.num_computed_tokens, req.num_tokens))

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def finish(self, data):
        req = self._pick(data, WAITING, LOADING, RUNNING)
        mgr = self.mgr
        if mgr.is_allocated(req.request_id):
            mgr.free(req)
        before = snapshot(mgr)
        with pytest.raises(ValueError, match="holds no KV cache blocks"):
            mgr.free(req)
        assert snapshot(mgr) == before
        del self.reqs[req.request_id]
        del self.status[req.request_id]

    @rule(data=st.data())
    def evict(self, data):
        pool = self.mgr.block_pool
        block_ids = data.draw(st.sets(st.integers(1, self.num_blocks - 1), max_size=3))
        for bid in block_ids:
            if pool.blocks[bid].ref_cnt > 0 and pool.blocks[bid].block_hash is not None:
                self.evicted_held.add(bid)
        self.mgr.evict_blocks(block_ids)
        assert all(pool.blocks[bid].block_hash is None for bid in block_ids)

    @precondition(lambda self: self._has(LOADING, RUNNING))
    @rule(data=st.data())
    def report_bad_kv(self, data):
        """A connector reports some of a request's blocks bad, plus ids of no block: the
        scheduler finds the first bad token and uncaches the request's blocks from there on."""
        req = self._pick(data, LOADING, RUNNING)
        mgr, pool = self.mgr, self.mgr.block_pool
        tables = self._tables(req)
        held = sorted({bid for table in tables for bid in table if bid != NULL_BLOCK_ID})
        if not held:
            return
        bad = data.draw(st.sets(st.sampled_from(held), min_size=1, max_size=2), label="bad")
        first = mgr.first_token_in_blocks(req.request_id, bad)
        assert first == min(i * BS for table in tables for i, bid in enumerate(table) if bid in bad)
        from_first = {bid for table in tables for bid in table[first // BS :]}
        dropped = bad | (from_first - {NULL_BLOCK_ID})
        self.evicted_held |= {bid for bid in dropped if pool.blocks[bid].block_hash is not None}
        mgr.evict_invalid_blocks([*bad, NULL_BLOCK_ID, -1, self.num_blocks])
        mgr.evict_blocks_from(req.request_id, first)
        assert all(pool.blocks[bid].block_hash is None for bid in dropped)

    @rule()
    def reset_prefix_cache(self):
        pool = self.mgr.block_pool
        idle = pool.get_num_free_blocks() == self.num_blocks - 1
        before = snapshot(self.mgr)
        assert self.mgr.reset_prefix_cache() is idle
        if idle:
            assert pool.num_cached_blocks == 0
            assert all(b.block_hash is None for b in pool.blocks)
            assert free_ids(self.mgr) == before["free"]
        else:
            assert snapshot(self.mgr) == before

    # ------------------------------------------------------------------ invariants
    @invariant()
    def integrity(self):
        mgr = self.mgr
        mgr.check_integrity()
        pool = mgr.block_pool
        free = set(free_ids(mgr))
        assert free == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
        num_used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert len(free) + num_used == self.num_blocks - 1 == pool.get_num_free_blocks() + num_used
        assert 0.0 <= mgr.usage <= 1.0

    @invariant()
    def index_holds_true_prefixes(self):
        pool = self.mgr.block_pool
        for g, index in enumerate(pool.cached_block_hash_to_block):
            for block_hash, cached in index.items():
                members = list(cached.values()) if isinstance(cached, dict) else [cached]
                for block in members:
                    assert block.group_id == g
                    salt, adapter, tokens = self.content[block.block_id]
                    assert tokens and len(tokens) % BS == 0
                    hashes = self.hasher.hash_token_ids(list(tokens), salt, adapter)
                    assert hashes[-1] == block_hash

    @invariant()
    def computed_blocks_are_cached(self):
        """Caching happens at schedule time: every full block a running request has computed
        is findable (requests loading from a connector are cached when the load lands)."""
        pool = self.mgr.block_pool
        for rid, status in self.status.items():
            if status != RUNNING:
                continue
            req = self.reqs[rid]
            num_full = min(req.num_computed_tokens, req.num_tokens) // BS
            for table in self.mgr.get_block_ids(rid):
                for bid in table[:num_full]:
                    if bid != 0:
                        assert pool.blocks[bid].block_hash is not None or bid in self.evicted_held

    @invariant()
    def events_replay_to_the_index(self):
        pool = self.mgr.block_pool
        if not pool.enable_kv_cache_events:
            assert pool.kv_event_queue == []
            return
        for kv_event in self.mgr.take_events():
            if isinstance(kv_event, BlockStored):
                assert len(kv_event.token_ids) % kv_event.block_size == 0
                assert len(kv_event.token_ids) // kv_event.block_size >= len(kv_event.block_hashes)
                for h in kv_event.block_hashes:
                    self.event_index[kv_event.group_id, h] += 1
            elif isinstance(kv_event, BlockRemoved):
                for h in kv_event.block_hashes:
                    assert self.event_index[kv_event.group_id, h] > 0
                    self.event_index[kv_event.group_id, h] -= 1
            else:
                assert isinstance(kv_event, AllBlocksCleared)
                self.event_index.clear()
        actual = Counter(
            (b.group_id, b.block_hash) for b in pool.blocks if b.block_hash is not None
        )
        assert +self.event_index == actual

    def teardown(self):
        mgr = getattr(self, "mgr", None)
        if mgr is None:
            return
        for rid in list(self.reqs):
            if mgr.is_allocated(rid):
                mgr.free(self.reqs[rid])
        mgr.check_integrity()
        pool = mgr.block_pool
        assert pool.get_num_free_blocks() == self.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        for manager in mgr.coordinator.single_type_managers:
            assert manager.req_to_blocks == {}
            assert manager.num_cached_block == {}


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class FullAttentionMachine(KVCacheMachine):
    def make_specs(self, data):
        return [full_spec(BS)]


class SlidingWindowMachine(KVCacheMachine):
    def make_specs(self, data):
        return [swa_spec(data.draw(st.sampled_from([4, 7, 10]), label="window"), BS)]


class ChunkedLocalMachine(KVCacheMachine):
    def make_specs(self, data):
        # Chunks of several blocks, so that hits inside the current chunk happen (6: a chunk
        # that does not end on a block boundary).
        return [chunked_spec(data.draw(st.sampled_from([6, 24, 40]), label="chunk"), BS)]


class HybridMachine(KVCacheMachine):
    def make_specs(self, data):
        window = data.draw(st.sampled_from([4, 7, 10]), label="window")
        return [full_spec(BS), swa_spec(window, BS)]


TestFullAttention = FullAttentionMachine.TestCase
TestFullAttention.settings = SETTINGS
TestSlidingWindow = SlidingWindowMachine.TestCase
TestSlidingWindow.settings = SETTINGS
TestChunkedLocal = ChunkedLocalMachine.TestCase
TestChunkedLocal.settings = SETTINGS
TestHybrid = HybridMachine.TestCase
TestHybrid.settings = SETTINGS
