"""Rows the model runner samples by one argmax (``plain``), beside rows that need the full
sampler, in the same steps; the full sampler's penalties read each row's tokens from the
persistent batch, checked against transformers' logits penalised step by step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.sampling_params import StructuredOutputsParams
from pagedkv.worker.input_batch import CachedRequestState, InputBatch
from tests.engine.conftest import run
from tests.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(
    "change, plain",
    [
        (dict(), True),
        (dict(stop_token_ids=[3], seed=7, max_tokens=3, stop=["x"]), True),
        (dict(temperature=0.5), False),
        (dict(repetition_penalty=1.2), False),
        (dict(presence_penalty=0.5), False),
        (dict(frequency_penalty=-0.5), False),
        (dict(logprobs=0), False),
        (dict(prompt_logprobs=1), False),
        (dict(min_tokens=2), False),
        (dict(structured_outputs=StructuredOutputsParams(regex="a+")), False),
    ],
)
def test_plain_means_greedy_with_nothing_else_on_the_logits(change, plain) -> None:
    params = dataclasses.replace(GREEDY, **change)
    assert CachedRequestState("r", 4, params, None).plain is plain


def penalised_reference(hf, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy tokens from transformers' logits with vLLM's penalties applied by hand."""
    ids = list(prompt)
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        output = ids[len(prompt) :]
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=len(logits))
        seen = counts > 0
        seen[torch.tensor(prompt)] = True
        p = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_penalised_rows_beside_plain_rows_match_transformers(make_llm, hf_model) -> None:
    llm = make_llm("llama")
    hf = hf_model("llama")
    prompts = [random_prompt(n, seed=n) for n in (9, 21, 14, 30)]
    penalised = [
        dataclasses.replace(GREEDY, repetition_penalty=1.6, presence_penalty=1.5),
        dataclasses.replace(GREEDY, frequency_penalty=2.0),
    ]
    params = [GREEDY, penalised[0], GREEDY, penalised[1]]
    outs = run(llm.llm_engine, [(p, sp, None) for p, sp in zip(prompts, params)])
    alone = run(llm.llm_engine, [(p, GREEDY, None) for p in prompts])  # every row plain
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == alone[2].outputs[0].token_ids
    for i in (1, 3):
        tokens = outs[i].outputs[0].token_ids
        assert tokens == penalised_reference(hf, prompts[i], params[i])
        assert tokens != alone[i].outputs[0].token_ids  # the penalties did act


def test_min_tokens_counts_outputs_from_the_batch_after_rows_move(make_llm) -> None:
    """A stop token is masked until ``min_tokens`` outputs exist, counted from the persistent
    batch, whose rows move when requests before them finish."""
    llm = make_llm("llama")
    prompt = random_prompt(11, seed=3)
    free = run(llm.llm_engine, [(prompt, GREEDY, None)])[0].outputs[0].token_ids
    stop_at = free[1]
    min_tokens = 5
    short = dataclasses.replace(GREEDY, max_tokens=2)
    masked = dataclasses.replace(GREEDY, stop_token_ids=[stop_at], min_tokens=min_tokens)
    requests = [(random_prompt(5, seed=s), short, None) for s in range(3)]
    outs = run(llm.llm_engine, [*requests, (prompt, masked, None)])
    tokens = outs[-1].outputs[0].token_ids
    assert len(tokens) >= min_tokens and stop_at not in tokens[:min_tokens]
    assert tokens[:2] == free[:1] + [tokens[1]] and tokens[1] != stop_at


def test_append_tokens_and_output_views_follow_moved_rows() -> None:
    batch = InputBatch(max_num_reqs=4, max_model_len=8, block_sizes=[4], max_num_blocks_per_req=[2])
    for i, (prompt, params) in enumerate(
        [([1, 2, 3], GREEDY), ([4] * 7, GREEDY), ([5, 6], GREEDY)]
    ):
        state = CachedRequestState(f"r{i}", len(prompt), params, None)
        batch.add_request(state, prompt, len(prompt), ([],))
    batch.append_tokens(np.array([0, 1, 2]), [10, 11, 12])
    batch.append_tokens(np.array([2, 1]), [22, 21])  # row 1 is now full: its token is dropped
    assert batch.output_token_ids(0).tolist() == [10]
    assert batch.output_token_ids(1).tolist() == [11]
    assert batch.output_token_ids(2).tolist() == [12, 22]
    batch.remove_request("r0")  # r2 moves into row 0
    assert batch.req_ids == ["r2", "r1"]
    assert batch.output_token_ids(0).tolist() == [12, 22]
    assert batch.token_ids_cpu[0, : batch.num_tokens[0]].tolist() == [5, 6, 12, 22]
    assert batch.plain[:2].tolist() == [True, True]
