"""MultiConnector(InProcConnector, StoreConnector on a directory) in real engines, in one
process: outputs equal a single instance's, each request is loaded by the child that can, a
failed load follows that child's policy, and every block comes back."""

from __future__ import annotations

import pytest

import tests.engine.inproc_connector  # noqa: F401  (registers InProcConnector)
from pagedkv import SamplingParams
from pagedkv.kv_transfer.store.block_codec import head_key
from tests.engine.conftest import run
from tests.kv_transfer.store.conftest import backend_for, store_kv_config
from tests.kv_transfer.store.test_faults import block_keys
from tests.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
BLOCK = 16


def multi_config(role: str, store_url: str, **inproc) -> dict:
    """The in-process P2P stand-in first, the store (kv_both: a shared cache) second."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "InProcConnector", **inproc},
                store_kv_config(store_url, "kv_both"),
            ]
        },
    }


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture
def store_url(tmp_path) -> str:
    return f"file://{tmp_path / 'store'}"


def test_pd_and_shared_prefixes_through_a_multi_equal_a_single_instance(store_url, make_llm):
    prompts = [random_prompt(n, seed=n) for n in (5, 16, 33, 47, 80)]
    expected = make_llm("llama").generate(prompts, GREEDY, use_tqdm=False)
    producer = make_llm("llama", kv_transfer_config=multi_config("kv_producer", store_url))
    consumer = make_llm("llama", kv_transfer_config=multi_config("kv_consumer", store_url))
    p_outs = run(
        producer.llm_engine,
        [
            (p, FIRST, {"do_remote_decode": True, "transfer_id": f"t{i}"})
            for i, p in enumerate(prompts)
        ],
    )
    params = [o.kv_transfer_params for o in p_outs]
    # Both children answered, key by key: the handoff's and the store's.
    assert [p["transfer_id"] for p in params] == [f"t{i}" for i in range(len(prompts))]
    assert [p["store_num_tokens"] for p in params] == [len(p) // BLOCK * BLOCK for p in prompts]
    d_outs = run(consumer.llm_engine, [(p, GREEDY, kv) for p, kv in zip(prompts, params)])
    assert token_ids(d_outs) == token_ids(expected)
    # The first child loaded every prompt: D computed only the last token of each.
    assert consumer.llm_engine.get_stats().num_prompt_tokens == len(prompts)
    stats = consumer.llm_engine.get_kv_connector_stats()
    assert stats["num_store_lookups"] == 0  # the store was never asked

    # A request without a handoff that shares a prefix with one P computed (and D never saw):
    # the store loads it.
    shared = random_prompt(70, seed=98)
    run(producer.llm_engine, [(shared, FIRST, None)])
    prompt = shared[:64] + random_prompt(20, seed=99)
    (reference,) = make_llm("llama").generate([prompt], GREEDY, use_tqdm=False)
    (out,) = run(consumer.llm_engine, [(prompt, GREEDY, None)])
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert consumer.llm_engine.get_stats().num_prompt_tokens == len(prompts) + len(prompt) - 64
    stats = consumer.llm_engine.get_kv_connector_stats()
    assert stats["num_store_blocks_loaded"] == 4 and stats["num_store_hit_blocks"] == 4


def test_a_failed_load_follows_the_policy_of_the_child_that_loads(store_url, make_llm):
    """The in-process child fails its request (policy fail); the store, a cache, has the same
    engine recompute a request whose stored block is corrupt (its default, recompute)."""
    handoff, cached = random_prompt(40, seed=1), random_prompt(70, seed=21)
    (expected,) = make_llm("llama").generate([cached], GREEDY, use_tqdm=False)
    producer = make_llm("llama", kv_transfer_config=multi_config("kv_producer", store_url))
    consumer = make_llm(
        "llama",
        kv_transfer_config=multi_config("kv_consumer", store_url, kv_load_failure_policy="fail"),
    )
    (params,) = [
        o.kv_transfer_params
        for o in run(
            producer.llm_engine, [(handoff, FIRST, {"do_remote_decode": True, "transfer_id": "h"})]
        )
    ]
    run(producer.llm_engine, [(cached, FIRST, None)])  # stores its 4 full blocks
    keys = block_keys(producer, cached)
    store = backend_for(store_url)
    store.put_many([(head_key(keys[2], 0), b"not a kv block")])
    store.close()

    failed, recomputed = run(
        consumer.llm_engine,
        [(handoff, GREEDY, {**params, "fail_from_block": 1}), (cached, GREEDY, None)],
    )
    assert failed.outputs[0].finish_reason == "error"
    assert "kv_load_failure_policy=fail" in failed.error
    assert recomputed.outputs[0].token_ids == expected.outputs[0].token_ids
    stats = consumer.llm_engine.get_kv_connector_stats()
    assert stats["num_store_load_corrupt"] == 1
