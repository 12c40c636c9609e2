"""The tiered KV cache under a random workload (hypothesis): a tiny pool over tiny host and disk
tiers, prompts that share prefixes in random ways, batches of random sizes, restarts.

After every batch: greedy outputs equal an engine without tiers, no tier holds more than its
capacity, no two host entries share a slot. Once idle: nothing is pending or pinned, the disk
holds exactly the indexed files, and every pool block is free."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv import LLM
from tests.engine.conftest import assert_all_blocks_free
from tests.kv_transfer.offload.conftest import (
    GREEDY,
    SMALL_POOL,
    assert_tiers_idle,
    connector_halves,
    cpu_tier,
    disk_tier,
    offloading,
    tokens,
)
from tests.tiny_models import random_prompt

#: Prompts are 2-6 segments of 16 tokens (one block each) drawn from 5: shared prefixes galore.
SEGMENTS = [random_prompt(16, 1000 + i) for i in range(5)]
PROMPT = st.lists(st.integers(0, len(SEGMENTS) - 1), min_size=2, max_size=6).map(
    lambda ids: [t for i in ids for t in SEGMENTS[i]] + [ids[0] + 1]
)
#: Host tier: 6 blocks; disk tier: 10 (of 2 layers x 2 x 16 tokens x 2 heads x 16 x 4 bytes;
#: on disk, a file of a 256-byte header and one head's payload per KV head).
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4
DISK_BLOCK_BYTES = BLOCK_BYTES + 2 * 256
TIERS = (cpu_tier(6 * BLOCK_BYTES / 2**30), disk_tier)


@pytest.fixture(scope="module")
def engines(checkpoint, tmp_path_factory):
    path = checkpoint("llama")
    disk = tmp_path_factory.mktemp("disk")
    config = offloading(TIERS[0], TIERS[1](disk, 10 * DISK_BLOCK_BYTES / 2**30))
    made = {"ref": LLM(str(path), **SMALL_POOL), "path": path, "config": config}
    made["tiered"] = LLM(str(path), **SMALL_POOL, kv_transfer_config=config)
    yield made
    for key in ("ref", "tiered"):
        made[key].llm_engine.shutdown()


def test_tiers_under_a_random_workload(engines):
    reference: dict[tuple[int, ...], list[int]] = {}
    #: Tokens the tiers served, over every engine of the run.
    tier_hits = [0]

    def count_hits() -> None:
        tier_hits[0] += engines["tiered"].llm_engine.get_kv_connector_stats()[
            "num_external_prefix_cache_hits"
        ]

    class Tiers(RuleBasedStateMachine):
        @rule(batch=st.lists(PROMPT, min_size=1, max_size=5))
        def generate(self, batch):
            missing = [p for p in batch if tuple(p) not in reference]
            if missing:
                ref = engines["ref"].generate(
                    [{"prompt_token_ids": p} for p in missing], GREEDY, use_tqdm=False
                )
                reference.update(zip(map(tuple, missing), tokens(ref)))
            outputs = engines["tiered"].generate(
                [{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False
            )
            assert tokens(outputs) == [reference[tuple(p)] for p in batch]

        @rule()
        def evict_the_pool(self):
            engines["tiered"].llm_engine.reset_prefix_cache()

        @rule()
        def restart(self):
            assert_tiers_idle(engines["tiered"])
            count_hits()
            engines["tiered"].llm_engine.shutdown()
            engines["tiered"] = LLM(
                str(engines["path"]), **SMALL_POOL, kv_transfer_config=engines["config"]
            )

        @invariant()
        def within_capacity(self):
            scheduler_half, _ = connector_halves(engines["tiered"])
            for index in scheduler_half.tiers.values():
                assert len(index) <= index.capacity_blocks
            slots = [e.slot for e in scheduler_half.tiers["cpu"].entries.values()]
            assert len(slots) == len(set(slots))

        def teardown(self):
            assert_tiers_idle(engines["tiered"])
            assert_all_blocks_free(engines["tiered"])

    Tiers.TestCase.settings = settings(
        max_examples=12,
        stateful_step_count=6,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    Tiers.TestCase().runTest()
    count_hits()
    assert tier_hits[0] > 0
