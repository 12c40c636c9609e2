"""vLLM's ``RequestOutputKind``: cumulative outputs, deltas, or the final output only.

The cumulative outputs are the reference: the deltas of a request, joined, must give the same
completions (text, tokens, logprobs, finish), and a final-only request must give the same
last output and nothing before it.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from pagedkv import SamplingParams
from pagedkv.engine.request_input import RequestInput
from pagedkv.sampling_params import RequestOutputKind
from tests.tiny_models import random_prompt

CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)


def stream(engine, prompt: list[int], params: SamplingParams) -> list:
    """Every output of one request, stepping the engine until it drains (60 s at most)."""
    request_id = engine.add_request(RequestInput(prompt, params))
    outputs = []
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not drain"
        outputs += [out for out in engine.step() if out.request_id == request_id]
    return outputs


def joined(deltas: list) -> dict[int, dict]:
    """Per completion index: the deltas' text, tokens and logprobs joined, and every finish
    reason reported."""
    by_index: dict[int, dict] = {}
    for output in deltas:
        for c in output.outputs:
            seq = by_index.setdefault(c.index, dict(text="", tokens=[], logprobs=[], finishes=[]))
            seq["text"] += c.text
            seq["tokens"] += c.token_ids
            seq["logprobs"] += c.logprobs or []
            if c.finish_reason is not None:
                seq["finishes"].append(c.finish_reason)
    return by_index


def with_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    return dataclasses.replace(params, output_kind=kind)


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    "logprobs": SamplingParams(temperature=0, max_tokens=9, logprobs=3, ignore_eos=True),
    "n=3 sampled": SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=11),
    "prompt logprobs": SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=2),
}


@pytest.mark.parametrize("case", CASES)
def test_deltas_join_into_the_cumulative_output(make_llm, case: str) -> None:
    # No prefix cache: both runs compute the prompt alike, so their logprobs are bit-equal.
    engine = make_llm("llama", enable_prefix_caching=False).llm_engine
    prompt = random_prompt(23, seed=5)
    params = CASES[case]
    cumulative = stream(engine, prompt, with_kind(params, CUMULATIVE))
    deltas = stream(engine, prompt, with_kind(params, DELTA))

    final = cumulative[-1]
    assert final.finished and deltas[-1].finished
    assert [o.finished for o in deltas].count(True) == 1
    by_index = joined(deltas)
    assert sorted(by_index) == list(range(params.n))
    for c in final.outputs:
        seq = by_index[c.index]
        assert seq["text"] == c.text and seq["tokens"] == c.token_ids
        assert seq["finishes"] == [c.finish_reason]  # a finish is sent once
        if params.logprobs is not None:
            assert seq["logprobs"] == c.logprobs
    for output in deltas:  # a delta carries only sequences that moved
        assert all(c.token_ids or c.text or c.finish_reason for c in output.outputs)
    if params.prompt_logprobs is not None:
        sent = [p for o in deltas if o.prompt_logprobs for p in o.prompt_logprobs]
        assert sent == final.prompt_logprobs


def test_deltas_hold_back_text_that_may_become_a_stop_string(make_llm) -> None:
    engine = make_llm("llama").llm_engine
    prompt = random_prompt(12, seed=9)
    free = stream(engine, prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    words = free[-1].outputs[0].text.split()
    stop = " ".join(words[3:5])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    cumulative = stream(engine, prompt, params)
    deltas = stream(engine, prompt, with_kind(params, DELTA))
    final_text = cumulative[-1].outputs[0].text
    assert cumulative[-1].outputs[0].finish_reason == "stop" and stop not in final_text
    assert joined(deltas)[0]["text"] == final_text
    sent = ""
    for delta in deltas:  # text once sent is never taken back by a later stop string
        sent += "".join(c.text for c in delta.outputs)
        assert final_text.startswith(sent)


def test_final_only_gives_one_output_equal_to_the_last_cumulative_one(make_llm) -> None:
    engine = make_llm("llama", enable_prefix_caching=False).llm_engine
    prompt = random_prompt(30, seed=6)
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10, logprobs=1)
    cumulative = stream(engine, prompt, params)
    final_only = stream(engine, prompt, with_kind(params, FINAL_ONLY))
    assert len(cumulative) > 1
    assert len(final_only) == 1 and final_only[0].finished
    for a, b in zip(final_only[0].outputs, cumulative[-1].outputs, strict=True):
        assert (a.index, a.text, a.token_ids, a.logprobs, a.finish_reason) == (
            b.index,
            b.text,
            b.token_ids,
            b.logprobs,
            b.finish_reason,
        )


def test_an_aborted_final_only_request_still_ends_with_an_output(make_llm) -> None:
    engine = make_llm("llama").llm_engine
    params = SamplingParams(max_tokens=50, output_kind=FINAL_ONLY)
    request_id = engine.add_request(RequestInput(random_prompt(10, seed=1), params))
    assert engine.step() == [] and engine.step() == []
    (out,) = engine.abort_request(request_id)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) >= 1


def test_llm_generate_builds_no_per_step_outputs(make_llm) -> None:
    """``LLM.generate`` asks for final outputs only, as vLLM's does; the caller's params are
    left as they were."""
    llm = make_llm("llama")
    engine = llm.llm_engine
    per_step = []
    step = engine.step
    engine.step = lambda: per_step.append(step()) or per_step[-1]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([random_prompt(9, seed=s) for s in range(3)], params, use_tqdm=False)
    assert params.output_kind is CUMULATIVE
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert sum(len(step_outputs) for step_outputs in per_step) == 3  # the three final ones


@pytest.mark.parametrize("bad", ["delta", 1, None])
def test_a_bad_output_kind_is_refused_by_name(bad) -> None:
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=bad)
