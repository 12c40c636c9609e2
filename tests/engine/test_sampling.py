"""Sampling through the engine: seeds, stop conditions, parameter validation."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.engine.request_input import RequestInput
from tests.tiny_models import random_prompt


def test_seeded_sampling_is_reproducible_across_batches(make_llm) -> None:
    llm = make_llm("llama")
    prompt = random_prompt(10, seed=5)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [random_prompt(n, seed=n) for n in (4, 30, 17)]
    mixed = llm.generate(
        [others[0], prompt, others[1], others[2]],
        [SamplingParams(temperature=1.0, max_tokens=25)]
        + [params]
        + [SamplingParams(temperature=0.7, max_tokens=5)] * 2,
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_seeded_sampling_survives_preemption(make_llm) -> None:
    prompts = [random_prompt(n, seed=n) for n in (30, 31, 32, 33)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40) for i in range(4)]
    roomy = make_llm("llama").generate(prompts, params, use_tqdm=False)
    tight = make_llm("llama", num_gpu_blocks_override=12, max_model_len=96)
    cramped = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in cramped] == [o.outputs[0].token_ids for o in roomy]


def test_stop_token_ids_and_eos(make_llm) -> None:
    llm = make_llm("llama")
    prompt = random_prompt(9, seed=2)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    (out,) = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    # min_tokens masks the stop token until enough tokens exist.
    (late,) = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=20, stop_token_ids=[stop_at], min_tokens=first + 2
        ),
        use_tqdm=False,
    )
    assert len(late.outputs[0].token_ids) >= first + 2
    assert stop_at not in late.outputs[0].token_ids[: first + 2]


def test_stop_strings(make_llm) -> None:
    llm = make_llm("llama")
    prompt = "w5 w17 w42 w99"
    (free,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = free.outputs[0].text
    words = text.split()
    stop = words[3]
    cut = text.index(stop)
    (out,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False
    )
    assert out.outputs[0].text == text[:cut]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    (kept,) = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept.outputs[0].text == text[: cut + len(stop)]


def test_max_tokens_and_length_finish(make_llm) -> None:
    llm = make_llm("llama", max_model_len=40)
    (out,) = llm.generate(
        [random_prompt(30, seed=1)], SamplingParams(temperature=0, max_tokens=100), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == 10  # capped by the context length
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logprobs=-1), "logprobs"),
        (dict(seed="x"), "seed"),
        (dict(n=0), "n"),
        (dict(stop=[""]), "stop"),
        # Values the model runner's tensors cannot hold (top_k is int64, floats float32).
        (dict(top_k=2**63), "top_k"),
        (dict(top_k=2**31), "top_k"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=10**400), "temperature"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(repetition_penalty=10**400), "repetition_penalty"),
        (dict(seed=-(2**63) - 1), "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_extreme_valid_sampling_params_are_served(make_llm) -> None:
    """Whatever passes validation must not break the engine's tensor conversions: an integer
    temperature of 2**63 once made an int64 tensor overflow on the engine thread."""
    llm = make_llm("llama", max_model_len=64)
    params = [
        SamplingParams(temperature=2**63, max_tokens=3),
        SamplingParams(temperature=1e308, top_k=2**31 - 1, seed=-(2**63), max_tokens=3),
        SamplingParams(repetition_penalty=1e308, seed=2**64 - 1, max_tokens=3),
        SamplingParams(max_tokens=2**70, min_tokens=2**69),
        SamplingParams(max_tokens=None, min_tokens=2**70, ignore_eos=True),
    ]
    # One at a time: in a batch, the others' float temperatures would hide an int64 one.
    outputs = [llm.generate([[5, 6, 7]], p, use_tqdm=False)[0] for p in params]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3, 3, 61, 61]
    assert params[0].temperature == float(2**63)  # stored as a float


def test_bad_prompts_are_rejected(make_llm) -> None:
    llm = make_llm("llama", max_model_len=64)
    engine = llm.llm_engine
    for prompt, message in [
        ([], "empty"),
        ("", "empty"),
        (list(range(3, 70)), "max_model_len"),
        ([5, 300], "token ids"),
        ([5, -1], "token ids"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(RequestInput(prompt, SamplingParams()))
    with pytest.raises(ValueError, match="cache_salt"):  # vLLM: a salt is a non-empty string
        engine.add_request(RequestInput([5, 6], SamplingParams(), cache_salt=""))
    assert not engine.has_unfinished_requests()


def test_abort_frees_blocks(make_llm) -> None:
    llm = make_llm("llama")
    engine = llm.llm_engine
    rid = engine.add_request(
        RequestInput(random_prompt(50, seed=3), SamplingParams(max_tokens=100))
    )
    engine.step()
    engine.step()
    assert engine.kv_cache_manager.usage > 0
    (out,) = engine.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.kv_cache_manager.usage == 0
    engine.step()  # the worker drops the request's state
