"""Tensor parallelism end to end: two real rank processes (``tp_harness``) meeting over gloo,
each with its own ModelRunner over its shard, on every tiny model, against one rank and
against transformers' ``generate``; plus the shard rules' errors.

All in fp32, where the two ranks' sums round differently from one rank's matmul: with the tiny
models' decisive logits (``tiny_models``) greedy tokens still agree exactly, and logprobs within
1e-4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedkv.cpu_kernels import load_cpu_kernels
from pagedkv.distributed.tp_group import SINGLE_RANK
from pagedkv.model.config import ModelConfig
from pagedkv.model.tensor_parallel import ModelShards
from tests.model.test_models import hf_greedy
from tests.model.tp_harness import drive
from tests.tiny_models import CONFIGS, TINY, build_checkpoint, random_prompt

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Beyond the tiny models: one KV head for two ranks (each holds it: replicated), a
#: vocabulary two ranks cannot split evenly (the last rank holds one row fewer), and biases on
#: both row-parallel projections (o_proj, down_proj: added once, by rank 0).
EXTRA_CONFIGS = {
    "llama_one_kv_head_odd_vocab_biases": lambda: LlamaConfig(
        **(TINY | {"num_key_value_heads": 1, "vocab_size": 255}),
        num_hidden_layers=2,
        attention_bias=True,
        mlp_bias=True,
    ),
}
ALL_CONFIGS = CONFIGS | EXTRA_CONFIGS
NUM_NEW = 12
PROMPTS = [random_prompt(n, seed=40 + n, vocab_size=255) for n in (11, 3, 26)]
GREEDY = [{"prompt": p, "params": {"temperature": 0.0, "max_tokens": NUM_NEW}} for p in PROMPTS]
#: Every path but the plain argmax: seeded sampling with logprobs and prompt logprobs, greedy
#: rows with penalties and min_tokens beside it, and a plain row once the others have ended.
MIXED = [
    {
        "prompt": PROMPTS[0],
        "params": {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 7, "max_tokens": 6,
                   "logprobs": 3, "prompt_logprobs": 2},
    },
    {
        "prompt": PROMPTS[1],
        "params": {"temperature": 0.0, "repetition_penalty": 1.3, "min_tokens": 3,
                   "max_tokens": 8, "logprobs": 0},
    },
    {"prompt": PROMPTS[2], "params": {"temperature": 0.0, "max_tokens": 10}},
]  # fmt: skip
#: r0 may sample only tokens [100, 140): across the border of two ranks' vocabulary rows.
ALLOWED = [100, 140]
SCENARIOS = {
    "greedy": {"requests": GREEDY},
    "mixed": {"requests": MIXED},
    "grammar": {"requests": GREEDY, "allowed": ALLOWED},
    "eager": {"requests": GREEDY, "enforce_eager": True},
    "checked": {"requests": GREEDY[2:], "check_one_call": True},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directories = {}
    for name, config in ALL_CONFIGS.items():
        directory = tmp_path_factory.mktemp(name)
        build_checkpoint(directory, config())
        directories[name] = str(directory)
    return directories


def run_ranks(tmp: Path, models: list[str], world: int = 2) -> list[dict]:
    """Each rank's output (``tp_harness``), from ``world`` processes run at once."""
    store = tmp / "store"
    env = os.environ | {"PYTHONPATH": str(REPO_ROOT), "PAGEDKV_KERNEL_CHOICES_DIR": str(tmp)}
    procs, outs = [], []
    for rank in range(world):
        spec = {"rank": rank, "world": world, "store": str(store), "models": models,
                "scenarios": SCENARIOS, "out": str(tmp / f"out{rank}.json")}  # fmt: skip
        (tmp / f"spec{rank}.json").write_text(json.dumps(spec))
        outs.append(tmp / f"out{rank}.json")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.model.tp_harness", str(tmp / f"spec{rank}.json")],
                cwd=REPO_ROOT,
                env=env,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    errors = [proc.communicate(timeout=240)[1] for proc in procs]
    failed = [
        f"rank {r}: {e[-3000:]}" for r, (p, e) in enumerate(zip(procs, errors)) if p.returncode
    ]
    assert not failed, "\n".join(failed)
    return [json.loads(out.read_text()) for out in outs]


@pytest.fixture(scope="module")
def tp2_outputs(
    checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    return run_ranks(tmp_path_factory.mktemp("tp2"), list(checkpoints.values()))


@pytest.mark.parametrize("arch", sorted(ALL_CONFIGS))
def test_tp2_greedy_equals_one_rank_and_transformers(
    arch: str, checkpoints: dict[str, str], tp2_outputs: list[dict]
) -> None:
    """Rank 0 returns transformers' greedy tokens, as one rank does; rank 1 the same requests
    with no tokens. The shards run the compiled kernels, the one-call decode layer included
    (it all-reduces through shared memory), or with ``enforce_eager`` torch ops only."""
    directory = checkpoints[arch]
    rank0, rank1 = (out[directory]["greedy"] for out in tp2_outputs)
    assert rank1["others_empty"] and rank1["results"] == {}
    config = ALL_CONFIGS[arch]()
    compiled = load_cpu_kernels() is not None
    num_one_call = config.num_hidden_layers if compiled else 0
    assert rank0["one_call_layers"] == rank1["one_call_layers"] == num_one_call
    local_kv_heads = max(config.num_key_value_heads // 2, 1)  # 1 head: replicated
    assert rank0["kv_heads"] == rank1["kv_heads"] == [local_kv_heads] * config.num_hidden_layers
    single = drive(directory, SCENARIOS["greedy"], SINGLE_RANK)
    assert single["kv_heads"] == [config.num_key_value_heads] * config.num_hidden_layers
    assert single["one_call_layers"] == num_one_call
    one_rank = single["results"]
    hf_model = AutoModelForCausalLM.from_pretrained(directory).eval()
    eager = tp2_outputs[0][directory]["eager"]["results"]
    for i, spec in enumerate(GREEDY):
        tokens = rank0["results"][f"r{i}"]["tokens"]
        assert tokens == one_rank[f"r{i}"]["tokens"] == eager[f"r{i}"]["tokens"]
        assert tokens == hf_greedy(hf_model, spec["prompt"], NUM_NEW)


@pytest.mark.parametrize("arch", sorted(ALL_CONFIGS))
def test_tp2_one_call_decode_equals_the_modules_bit_for_bit(
    arch: str, checkpoints: dict[str, str], tp2_outputs: list[dict]
) -> None:
    """On each rank, every decoder layer ran its modules, then its one-call decode (which
    all-reduces from C), on the same inputs: every output bit for bit alike, on every step of a
    request decoding alone (one call per layer and decode step)."""
    if load_cpu_kernels() is None:
        pytest.skip("no compiled kernels: no one-call decode layer")
    directory = checkpoints[arch]
    num_layers = ALL_CONFIGS[arch]().num_hidden_layers
    for out in tp2_outputs:
        checks = out[directory]["checked"]["one_call_checks"]
        assert checks == {"one_call": (NUM_NEW - 1) * num_layers, "differ": 0}
    tokens = tp2_outputs[0][directory]["checked"]["results"]["r0"]["tokens"]
    assert tokens == tp2_outputs[0][directory]["greedy"]["results"]["r2"]["tokens"]


@pytest.mark.parametrize("arch", sorted(ALL_CONFIGS))
def test_tp2_sampling_logprobs_and_penalties_equal_one_rank(
    arch: str, checkpoints: dict[str, str], tp2_outputs: list[dict]
) -> None:
    """The whole logits gathered to rank 0: seeded sampling, top-k/p, penalties, min_tokens,
    logprobs and prompt logprobs as with one rank (the logprobs within fp32 rounding)."""
    directory = checkpoints[arch]
    rank0, rank1 = (out[directory]["mixed"] for out in tp2_outputs)
    assert rank1["others_empty"] and rank1["results"] == {}
    one_rank = drive(directory, SCENARIOS["mixed"], SINGLE_RANK)["results"]
    assert rank0["results"].keys() == one_rank.keys()
    for req_id, expected in one_rank.items():
        got = rank0["results"][req_id]
        assert got["tokens"] == expected["tokens"], req_id
        for key in ("logprobs", "prompt_logprobs"):
            assert [ids for ids, _ in got[key]] == [ids for ids, _ in expected[key]], req_id
            torch.testing.assert_close(
                torch.tensor([v for _, v in got[key]]),
                torch.tensor([v for _, v in expected[key]]),
                atol=1e-4,
                rtol=1e-4,
            )
    assert len(one_rank["r0"]["prompt_logprobs"]) == len(PROMPTS[0]) - 1


def test_kv_heads_are_replicated_when_fewer_than_ranks() -> None:
    config = ModelConfig.from_hf_config(EXTRA_CONFIGS["llama_one_kv_head_odd_vocab_biases"]())
    shards = [ModelShards.of(config, rank, 2) for rank in range(2)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 2)]
    assert [s.vocab for s in shards] == [(0, 128), (128, 127)]
    assert [s.num_kv_heads for s in config.kv_cache_layer_specs(2)] == [1, 1]


@pytest.mark.parametrize(
    "changes, tp_size, field",
    [
        ({}, 3, "num_attention_heads"),
        ({"intermediate_size": 130}, 4, "intermediate_size"),
        ({"num_attention_heads": 8, "num_key_value_heads": 6}, 4, "number of KV heads"),
        ({"vocab_size": 5}, 4, "vocab_size"),
        ({"num_attention_heads": 8, "num_key_value_heads": 3}, 4, "number of KV heads"),
    ],
)
def test_a_tp_size_that_does_not_divide_is_refused(changes, tp_size: int, field: str) -> None:
    config = ModelConfig.from_hf_config(LlamaConfig(**(TINY | changes), num_hidden_layers=1))
    with pytest.raises(ValueError, match=f"tensor_parallel_size {tp_size} .*{field}"):
        ModelShards.of(config, 0, tp_size)


@pytest.mark.parametrize("arch", ["llama", "llama_one_kv_head_odd_vocab_biases"])
def test_tp2_grammar_mask_equals_one_rank(
    arch: str, checkpoints: dict[str, str], tp2_outputs: list[dict]
) -> None:
    """A grammar bitmask on one row (the others plain): the step gathers the whole logits."""
    directory = checkpoints[arch]
    rank0, rank1 = (out[directory]["grammar"] for out in tp2_outputs)
    assert rank1["others_empty"] and rank1["results"] == {}
    one_rank = drive(directory, SCENARIOS["grammar"], SINGLE_RANK)["results"]
    assert {r: e["tokens"] for r, e in rank0["results"].items()} == {
        r: e["tokens"] for r, e in one_rank.items()
    }
    assert all(ALLOWED[0] <= t < ALLOWED[1] for t in rank0["results"]["r0"]["tokens"])
