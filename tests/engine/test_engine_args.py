"""Engine arguments that shape the whole engine: checked at construction, and honoured."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from tests.tiny_models import random_prompt


def test_a_kv_cache_too_small_for_one_full_length_request_is_refused(make_llm) -> None:
    """Such a request could never be admitted (or would preempt itself forever): say so at
    startup, with the longest max_model_len that fits, as vLLM does."""
    with pytest.raises(ValueError, match=r"max_model_len=256 .*--max-model-len 160 or less"):
        make_llm("llama", num_gpu_blocks_override=11)
    make_llm("llama", num_gpu_blocks_override=11, max_model_len=160)


@pytest.mark.parametrize("value", [0, -0.5, 1.5])
def test_gpu_memory_utilization_is_a_fraction(make_llm, value: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_llm("llama", gpu_memory_utilization=value)


def test_the_engine_seed_makes_unseeded_sampling_reproducible(make_llm) -> None:
    prompts = [random_prompt(12, seed=1), random_prompt(20, seed=2)]
    params = SamplingParams(temperature=1.0, max_tokens=16)

    def sample(seed: int) -> list[list[int]]:
        outs = make_llm("llama", seed=seed).generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 0}, "block_size must be an integer >= 1, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
        ({"max_model_len": 0}, "max_model_len must be an integer >= 1"),
        ({"kv_cache_memory": "1.5x"}, "not a size"),
        ({"device": "tpu"}, "device must be one of"),
    ],
)
def test_engine_args_out_of_range_are_refused_by_name(kwargs, message) -> None:
    from pagedkv.engine.engine_args import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_max_model_len_above_the_model_is_refused(make_llm) -> None:
    """As in vLLM: positions past max_position_embeddings were never trained."""
    with pytest.raises(ValueError, match="max_model_len 257 is larger than the model's"):
        make_llm("llama", max_model_len=257)
    assert make_llm("llama", max_model_len=100).llm_engine.max_model_len == 100


def test_generation_config_supplies_the_defaults(make_llm_at, tmp_path) -> None:
    """``auto``: the model's generation_config.json (the built-in model's 0.7 / 0.95) for
    requests that bring no SamplingParams; ``vllm``: vLLM's own defaults; or a directory."""
    import json

    from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH

    auto = make_llm_at(DEFAULT_MODEL_PATH).get_default_sampling_params()
    assert (auto.temperature, auto.top_p) == (0.7, 0.95)
    plain = make_llm_at(DEFAULT_MODEL_PATH, generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.top_p, plain.max_tokens) == (1.0, 1.0, 16)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 5, "repetition_penalty": 1.1})
    )
    llm = make_llm_at(DEFAULT_MODEL_PATH, generation_config=str(tmp_path))
    custom = llm.get_default_sampling_params()
    assert (custom.temperature, custom.max_tokens, custom.repetition_penalty) == (0.0, 5, 1.1)
    (out,) = llm.generate(["def f(x):"], use_tqdm=False)
    assert len(out.outputs[0].token_ids) <= 5


def test_chat_renders_the_template_as_the_server_does(make_llm_at) -> None:
    from pagedkv.engine.chat_template import render_chat
    from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH

    llm = make_llm_at(DEFAULT_MODEL_PATH)
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    params = SamplingParams(temperature=0, max_tokens=12)
    (reply,) = llm.chat(messages, params, use_tqdm=False)
    prompt = render_chat(llm.get_tokenizer(), messages)
    (expected,) = llm.generate([prompt], params, use_tqdm=False)
    assert reply.outputs[0].token_ids == expected.outputs[0].token_ids
    assert reply.prompt_token_ids == prompt["prompt_token_ids"]
    both = llm.chat([messages, messages + [{"role": "assistant", "content": "ok"}]], params,
                    use_tqdm=False)  # fmt: skip
    assert len(both) == 2 and both[0].outputs[0].text == reply.outputs[0].text
