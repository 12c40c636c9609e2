"""Parallel sampling (``n > 1``): children share the prompt's blocks, seeds derive as in vLLM."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.engine.request_input import RequestInput
from tests.tiny_models import random_prompt


def test_children_share_the_prompt_blocks(make_llm) -> None:
    """One prefill's blocks serve all n children: after the first step each full prompt block is
    held by every child (ref_cnt n), and each child owns only its last, partial block."""
    llm = make_llm("llama")
    engine = llm.llm_engine
    prompt = random_prompt(40, seed=11)  # two full 16-token blocks, then 8 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6)
    parent = engine.add_request(RequestInput(prompt, params))
    engine.step()
    kv = engine.kv_cache_manager
    tables = [kv.get_block_ids(f"{i}_{parent}")[0] for i in range(4)]
    shared = tables[0][:2]
    assert all(table[:2] == shared for table in tables)
    assert [kv.block_pool.blocks[b].ref_cnt for b in shared] == [4, 4]
    assert len({table[2] for table in tables}) == 4  # the partial block is each child's own
    kv.check_integrity()
    stats = engine.get_stats()
    assert stats.prefix_cache_hits == 3 * 32  # children 1..3 hit both full blocks
    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished]
    (out,) = finished
    assert out.request_id == parent and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)


def test_same_seed_same_n_outputs_and_child_seeds_as_vllm(make_llm) -> None:
    llm = make_llm("llama")
    prompt = random_prompt(12, seed=4)
    params = SamplingParams(n=3, temperature=1.0, seed=100, max_tokens=10)
    first = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) == 3  # different children sample differently
    # Child i samples as a lone request seeded with seed + i (vLLM's ParentRequest).
    alone = [
        llm.generate(
            [prompt], SamplingParams(temperature=1.0, seed=100 + i, max_tokens=10), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
        for i in range(3)
    ]
    assert first == alone


def test_n_with_stop_strings_finishes_children_apart(make_llm) -> None:
    llm = make_llm("llama")
    prompt = random_prompt(8, seed=9)
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=12)
    free = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    stop = free[0].text.split()[2]
    stopped = llm.generate(
        [prompt], SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=12, stop=[stop]),
        use_tqdm=False,
    )[0].outputs  # fmt: skip
    assert stopped[0].finish_reason == "stop"
    for before, after in zip(free, stopped):  # each child stops (or not) on its own text
        if stop in before.text:
            assert after.finish_reason == "stop"
            assert after.text == before.text[: before.text.index(stop)]
        else:
            assert after.text == before.text and after.finish_reason == "length"


def test_abort_ends_every_child(make_llm) -> None:
    llm = make_llm("llama")
    engine = llm.llm_engine
    parent = engine.add_request(
        RequestInput(random_prompt(20, seed=2), SamplingParams(n=3, max_tokens=50))
    )
    engine.step()
    (out,) = engine.abort_request(parent)
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("n", [0, -1, 1.5, 257, 2**70])
def test_bad_n_is_refused(n) -> None:
    with pytest.raises(ValueError, match=r"^n must be an integer in \[1, 256\]"):
        SamplingParams(n=n)
