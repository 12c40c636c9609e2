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
