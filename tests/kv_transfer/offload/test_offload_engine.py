"""The tiered KV cache in a real engine: greedy outputs equal an engine without tiers, hits
come from the tier that holds the blocks, and nothing is left pending, pinned or on disk
beyond the index once idle."""

from __future__ import annotations

import pytest

from tests.kv_transfer.offload.conftest import (
    SMALL_POOL,
    assert_tiers_idle,
    connector_halves,
    cpu_tier,
    disk_tier,
    generate_each,
    offloading,
    tokens,
)
from tests.tiny_models import random_prompt

#: 12 prompts of 100 tokens: 1200 tokens, twice what the 40-block pool holds.
PROMPTS = [random_prompt(100, seed) for seed in range(12)]
#: The first four come back once the pool has evicted them.
WORKLOAD = PROMPTS + PROMPTS[:4]


@pytest.mark.parametrize("arch", ["llama", "qwen2_hybrid", "mistral_window"])
def test_outputs_equal_without_tiers_and_returning_prompts_hit_the_host_tier(make_llm, arch):
    want = tokens(generate_each(make_llm(arch, **SMALL_POOL), WORKLOAD))
    llm = make_llm(arch, **SMALL_POOL, kv_transfer_config=offloading(cpu_tier()))
    outputs = generate_each(llm, WORKLOAD)
    assert tokens(outputs) == want
    # 6 full blocks of each returning prompt (the last token is always computed).
    assert [o.num_cached_tokens for o in outputs[12:]] == [96] * 4
    stats = llm.llm_engine.get_kv_connector_stats()
    assert stats["num_offload_cpu_hit_tokens"] == 4 * 96
    assert stats["num_external_prefix_cache_hits"] == 4 * 96
    assert_tiers_idle(llm)


def test_disk_tier_survives_a_restart(make_llm, tmp_path):
    config = offloading(disk_tier(tmp_path / "kv"))
    want = tokens(generate_each(make_llm("llama", **SMALL_POOL), PROMPTS[:6]))
    first = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    generate_each(first, PROMPTS[:6])
    assert_tiers_idle(first)
    first.llm_engine.shutdown()
    second = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    outputs = generate_each(second, PROMPTS[:6])
    assert tokens(outputs) == want
    assert [o.num_cached_tokens for o in outputs] == [96] * 6
    assert second.llm_engine.get_kv_connector_stats()["num_offload_disk_hit_tokens"] == 6 * 96
    assert_tiers_idle(second)


def test_a_lower_tier_hit_is_promoted_to_the_host_tier(make_llm, tmp_path):
    config = offloading(cpu_tier(), disk_tier(tmp_path / "kv"))
    first = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    generate_each(first, PROMPTS[:3])
    assert_tiers_idle(first)
    first.llm_engine.shutdown()
    second = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    generate_each(second, PROMPTS[:3])  # from disk, copied up to the host tier
    generate_each(second, PROMPTS[3:12])  # evicts them from the pool
    generate_each(second, PROMPTS[:3])  # from the host tier now
    stats = second.llm_engine.get_kv_connector_stats()
    assert stats["num_offload_disk_hit_tokens"] == 3 * 96
    assert stats["num_offload_cpu_hit_tokens"] == 3 * 96
    assert_tiers_idle(second)


def test_tiers_never_exceed_their_capacity_and_evict(make_llm, tmp_path):
    # Room for 8 blocks in host memory and 16 on disk: far less than the workload's 72.
    _, probe = connector_halves(
        make_llm("llama", **SMALL_POOL, kv_transfer_config=offloading(cpu_tier()))
    )
    slot = probe.host.rows.shape[1]
    disk_block = slot + 2 * 256  # a 256-byte header per KV head's file (2 heads)
    config = offloading(
        cpu_tier(8 * slot / 2**30), disk_tier(tmp_path / "kv", 16 * disk_block / 2**30)
    )
    llm = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    generate_each(llm, WORKLOAD)
    scheduler_half, _ = connector_halves(llm)
    assert scheduler_half.tiers["cpu"].capacity_blocks == 8
    assert scheduler_half.tiers["disk"].capacity_blocks == 16
    stats = llm.llm_engine.get_kv_connector_stats()
    assert stats["num_offload_cpu_evictions"] > 0 and stats["num_offload_disk_evictions"] > 0
    assert_tiers_idle(llm)


def test_the_tiers_are_described_through_a_multi_connector(make_llm, tmp_path):
    """Registration (``kv_tiers``) and KV-event snapshots see the tiers of a child too."""
    store = {
        "kv_connector": "StoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store_url": (tmp_path / "store").as_uri()},
    }
    tiers = offloading(cpu_tier(), disk_tier(tmp_path / "kv"))
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [tiers, store]},
    }
    llm = make_llm("llama", **SMALL_POOL, kv_transfer_config=multi)
    generate_each(llm, PROMPTS[:2])
    offload = llm.llm_engine.scheduler.connector.connectors[0]
    assert llm.llm_engine.description.kv_tiers == {
        "CPU": offload.tiers["cpu"].capacity_blocks,
        "DISK": offload.tiers["disk"].capacity_blocks,
    }
    hashes = llm.llm_engine.scheduler.connector.tier_block_hashes()
    assert len(hashes["CPU"][0]) == 2 * 6
    assert len(offload.tiers["cpu"]) == 12
