"""EOS ids, ``ignore_eos`` and ``min_tokens`` against transformers' ``generate``.

Each checkpoint gets a ``generation_config.json`` whose EOS ids are tokens greedy decoding
really produces (read off a first transformers run), so masking and stopping on them change
the output. vLLM's rules (``SamplingParams.update_from_generation_config``): ``min_tokens``
masks every EOS id whatever ``ignore_eos`` says; past it, the EOS ids end the request unless
``ignore_eos``, the primary with no ``stop_reason``, the others with their id as one.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedkv import SamplingParams
from pagedkv.engine.request_input import RequestInput
from tests.tiny_models import CONFIGS, random_prompt

MAX_TOKENS = 24


def hf_generate(model, prompt: list[int], **kwargs) -> list[int]:
    """Greedy ``MAX_TOKENS`` tokens; EOS ids from the model's generation config unless given."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


def first_new_token_at(tokens: list[int], start: int, avoid: list[int]) -> int:
    """The first index from ``start`` whose token neither appeared earlier nor is in ``avoid``."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i] and tokens[i] not in avoid:
            return i
    raise AssertionError(f"no fresh token from step {start} in {tokens}")


@pytest.mark.parametrize("eos_kind", ["single", "list"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_eos_ids_min_tokens_and_ignore_eos_match_transformers(
    arch, eos_kind, checkpoint, hf_model, make_llm_at, tmp_path
) -> None:
    prompt = random_prompt(11, seed=7)
    free = hf_generate(hf_model(arch), prompt, eos_token_id=None)
    # The primary EOS is greedy's token at step k; "list" adds an extra EOS id that greedy
    # produces earlier, at step j < k, so the extra id is what stops (or is masked) first.
    k = first_new_token_at(free, 8, [])
    eos_ids = [free[k]]
    if eos_kind == "list":
        j = first_new_token_at(free, 3, [free[k]])
        assert j < k
        eos_ids.append(free[j])
    first_eos = min(free.index(t) for t in eos_ids)

    model_dir = tmp_path / arch
    shutil.copytree(checkpoint(arch), model_dir)
    generation_config = {"eos_token_id": eos_ids if eos_kind == "list" else eos_ids[0]}
    (model_dir / "generation_config.json").write_text(json.dumps(generation_config))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf.generation_config.eos_token_id == generation_config["eos_token_id"]

    masked_until = k + 1  # past every EOS id's first step
    cases = {
        "stops at the first EOS id": (
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
            hf_generate(hf, prompt),
        ),
        "min_tokens masks every EOS id, then one stops": (
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=masked_until),
            hf_generate(hf, prompt, min_new_tokens=masked_until),
        ),
        "ignore_eos: min_tokens still masks every EOS id": (
            SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True
            ),
            hf_generate(hf, prompt, min_new_tokens=MAX_TOKENS),
        ),
        "ignore_eos: past min_tokens no EOS id stops": (
            SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, min_tokens=first_eos, ignore_eos=True
            ),
            free,
        ),
    }
    expected = {name: ref for name, (_, ref) in cases.items()}
    # The cases are sharp: EOS ids stop transformers early, or masking them changes the tokens.
    assert len(expected["stops at the first EOS id"]) == first_eos + 1
    assert expected["ignore_eos: min_tokens still masks every EOS id"] != free
    assert not set(eos_ids) & set(expected["ignore_eos: min_tokens still masks every EOS id"])

    llm = make_llm_at(model_dir, max_num_seqs=8)
    outputs = llm.generate([prompt] * len(cases), [p for p, _ in cases.values()], use_tqdm=False)
    got = {name: out.outputs[0] for name, out in zip(cases, outputs)}
    assert {name: o.token_ids for name, o in got.items()} == expected
    stopped = got["stops at the first EOS id"]
    assert stopped.finish_reason == "stop"
    # vLLM: the primary EOS leaves no stop_reason; an extra EOS id is a stop token id.
    assert stopped.stop_reason == (None if free[first_eos] == eos_ids[0] else free[first_eos])
    for name in (
        "ignore_eos: min_tokens still masks every EOS id",
        "ignore_eos: past min_tokens no EOS id stops",
    ):
        assert got[name].finish_reason == "length"


def test_caller_params_keep_their_stop_token_ids(checkpoint, make_llm_at, tmp_path) -> None:
    """The EOS ids join each request's own copy of the params, not the caller's object."""
    model_dir = tmp_path / "llama"
    shutil.copytree(checkpoint("llama"), model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    llm = make_llm_at(model_dir)
    params = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[9], min_tokens=2)
    new = llm.llm_engine.make_request(RequestInput(random_prompt(5, seed=1), params))
    request = new.children[0]
    assert request.sampling_params.stop_token_ids == [9, 6]
    assert request.sampling_params.all_stop_token_ids == {5, 6, 9}
    assert params.stop_token_ids == [9] and params.all_stop_token_ids == {9}
