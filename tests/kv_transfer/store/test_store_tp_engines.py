"""Whole engines of different tensor-parallel sizes share KV: what a TP 2 instance stores (two
ranks, each writing its KV head) a TP 1 instance loads as a prefix hit, and the reverse, with
the same greedy outputs; likewise the disk tier across a restart with another TP size."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from tests.kv_transfer.offload.conftest import SMALL_POOL, disk_tier, offloading
from tests.kv_transfer.store.conftest import store_kv_config
from tests.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
#: 70 tokens: 4 full 16-token blocks loadable (never the last prompt token), 6 computed.
PROMPT = random_prompt(70, seed=41)


def token_ids(llm, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2)])
def test_an_instance_loads_what_one_of_another_tp_size_stored(
    redis_server, make_llm, writer_tp, reader_tp
):
    expected = token_ids(make_llm("llama"), [PROMPT])
    producer = store_kv_config(redis_server.url, "kv_producer")
    writer = make_llm("llama", tensor_parallel_size=writer_tp, kv_transfer_config=producer)
    assert token_ids(writer, [PROMPT]) == expected  # returns once its puts have ended
    consumer = store_kv_config(redis_server.url, "kv_consumer")
    reader = make_llm("llama", tensor_parallel_size=reader_tp, kv_transfer_config=consumer)
    assert token_ids(reader, [PROMPT]) == expected
    assert reader.llm_engine.get_stats().num_prompt_tokens == 70 - 64


def test_a_restart_with_another_tp_size_hits_the_disk_tier(make_llm, tmp_path):
    prompts = [random_prompt(70, seed) for seed in (42, 43)]
    expected = token_ids(make_llm("llama", **SMALL_POOL), prompts)
    config = offloading(disk_tier(tmp_path / "kv"))
    first = make_llm("llama", **SMALL_POOL, tensor_parallel_size=2, kv_transfer_config=config)
    assert token_ids(first, prompts) == expected
    for lower in first.llm_engine.model_runner.kv_connector.lower.values():
        assert lower.writer.wait_idle(30.0)  # rank 0's writes; rank 1's end with its exit
    first.llm_engine.shutdown()
    restarted = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    assert token_ids(restarted, prompts) == expected
    stats = restarted.llm_engine.get_kv_connector_stats()
    assert stats["num_external_prefix_cache_hits"] == 2 * 64
