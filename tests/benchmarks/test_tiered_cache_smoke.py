"""``benchmarks/tiered_cache.py``'s trace side: the Mooncake-format reader and writer (bad
lines named), the generator, the hash id -> block mapping and the infinite-cache oracle,
checked against a hand-computed example and against a real engine's prefix cache."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.mooncake_trace import (
    TRACE_BLOCK,
    BlockTokens,
    TraceRequest,
    TraceShape,
    full_block_chains,
    make_trace,
    oracle_hit_tokens,
    prompt_length,
    read_trace,
    working_set_blocks,
    write_trace,
)
from tests.tiny_models import CONFIGS, TINY, build_checkpoint

#: Hand-computed, 4 tokens a hash id: (input_length, hash_ids) -> hit tokens in order.
EXAMPLE = [
    (1024, [1, 2], 0),  # 8 tokens, 2 full blocks: nothing seen yet
    (1536, [1, 2, 3], 8),  # (1,) and (1, 2) seen
    (1024, [1, 2], 4),  # both seen, but a hit never covers the last prompt token
    (700, [1, 5], 4),  # 4 + ceil(188 * 4 / 512) = 6 tokens: one full block, seen
    (1536, [9, 2, 3], 0),  # id 2 after 9 is another chain than after 1
    (1100, [1, 5, 6], 4),  # (1, 5) was partial in the 700-token prompt: never cached
]


def example_requests() -> list[TraceRequest]:
    return [TraceRequest(10.0 * i, n, 3, tuple(ids)) for i, (n, ids, _) in enumerate(EXAMPLE)]


def test_oracle_matches_the_hand_computed_example():
    requests = example_requests()
    assert [prompt_length(r, 4) for r in requests] == [8, 12, 8, 6, 12, 9]
    assert oracle_hit_tokens(requests, 4) == [hit for _, _, hit in EXAMPLE]
    # (1,) (1,2) (1,2,3) (1,5) (9,) (9,2) (9,2,3)
    assert working_set_blocks(requests, 4) == 7


def test_blocks_are_deterministic_and_prompts_share_exactly_the_trace_prefixes():
    a, b = BlockTokens(4, 256, seed=0), BlockTokens(4, 256, seed=0)
    first, second, third = (a.prompt(r) for r in example_requests()[:3])
    assert second[:8] == first and third == first
    assert b.prompt(example_requests()[4])[4:] == second[4:]  # ids 2 and 3 map to equal blocks
    assert b.prompt(example_requests()[4])[:4] != second[:4]
    assert len(a.prompt(example_requests()[3])) == 6
    assert BlockTokens(4, 256, seed=1).block(1) != a.block(1)
    assert all(3 <= t < 256 for t in first)


def test_write_then_read_round_trips(tmp_path):
    path = tmp_path / "trace.jsonl"
    requests = make_trace(TraceShape(conversations=3, turns=3, seed=7))
    write_trace(path, requests)
    first = json.loads(path.read_text().splitlines()[0])
    assert sorted(first) == ["hash_ids", "input_length", "output_length", "timestamp"]
    assert read_trace(path) == requests


def test_generated_conversations_resend_their_history():
    shape = TraceShape(conversations=4, turns=3, system_blocks=2, seed=3)
    requests = make_trace(shape)
    assert requests == make_trace(shape)  # deterministic from the seed
    assert make_trace(TraceShape(conversations=4, turns=3, system_blocks=2, seed=4)) != requests
    assert len(requests) == 12
    assert [r.timestamp for r in requests] == sorted(r.timestamp for r in requests)
    seen: list[int] = []
    for r in requests:
        assert r.hash_ids[:2] == (0, 1)  # the shared system prompt
        assert len(r.hash_ids) == math.ceil(r.input_length / TRACE_BLOCK)
        seen.extend(h for h in r.hash_ids if h not in seen)
    assert seen == list(range(len(seen)))  # ids numbered by first appearance
    # A first turn hits the system prompt at most; every later one its history too.
    hits = oracle_hit_tokens(requests, 16)
    assert sum(hit > 2 * 16 for hit in hits) == 4 * (3 - 1)


GOOD = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]}


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not a JSON object"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), "'hash_ids' is missing"),
        (json.dumps({**GOOD, "timestamp": -1}), "'timestamp' must be a number >= 0"),
        (json.dumps({**GOOD, "timestamp": "0"}), "'timestamp' must be a number >= 0"),
        (json.dumps({**GOOD, "input_length": 0}), "'input_length' must be an integer >= 1"),
        (json.dumps({**GOOD, "input_length": "5"}), "'input_length' must be an integer >= 1"),
        (json.dumps({**GOOD, "output_length": True}), "'output_length' must be an integer >= 0"),
        (json.dumps({**GOOD, "hash_ids": []}), "'hash_ids' must be a non-empty list"),
        (json.dumps({**GOOD, "hash_ids": [1, -1]}), "'hash_ids' must be a non-empty list"),
    ],
)  # fmt: skip
def test_a_bad_line_is_named_with_its_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{json.dumps(GOOD)}\n\n{line}\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{message}"):
        read_trace(path)


def test_an_empty_trace_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        read_trace(path)


@settings(max_examples=30, deadline=None)
@given(
    conversations=st.integers(1, 4),
    turns=st.integers(1, 4),
    system_blocks=st.integers(0, 3),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 1000),
)
def test_oracle_invariants(conversations, turns, system_blocks, block_size, seed):
    """Hits are whole blocks short of the last token; replayed twice, the second pass hits
    every full block it may; the working set is what the oracle holds."""
    shape = TraceShape(conversations, turns, system_blocks, 1500, 300, seed=seed)
    requests = make_trace(shape)
    hits = oracle_hit_tokens(requests + requests, block_size)
    for r, hit in zip(requests + requests, hits):
        assert hit % block_size == 0 and hit <= prompt_length(r, block_size) - 1
    for r, hit in zip(requests, hits[len(requests) :]):
        usable = (prompt_length(r, block_size) - 1) // block_size
        assert hit == min(usable, len(full_block_chains(r, block_size))) * block_size
    assert working_set_blocks(requests, block_size) == len(
        {c for r in requests for c in full_block_chains(r, block_size)}
    )


def test_an_unbounded_pool_hits_exactly_what_the_oracle_does(tmp_path, monkeypatch):
    """The trace replayed one request at a time on a real engine whose pool holds the whole
    working set: every request's hit tokens are the oracle's."""
    # The benchmark's modules import each other by their names, as when run as a script.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from trace_replay import run_together

    from pagedkv import LLM

    build_checkpoint(tmp_path, CONFIGS["llama"]())
    shape = TraceShape(
        conversations=3, turns=3, system_blocks=2, user_tokens=1024, output_tokens=256, seed=1
    )
    requests = make_trace(shape)
    tokens = BlockTokens(16, TINY["vocab_size"])
    assert max(prompt_length(r, 16) for r in requests) < TINY["max_position_embeddings"]
    engine = LLM(str(tmp_path), device="cpu", num_gpu_blocks_override=256).llm_engine
    hits = [run_together(engine, [tokens.prompt(r)])[0].num_cached_tokens for r in requests]
    assert hits == oracle_hit_tokens(requests, 16)
    assert sum(hits) > 0
