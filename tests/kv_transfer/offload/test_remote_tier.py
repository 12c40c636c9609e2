"""The remote tier is the store connector's backends, keys and values: instances share it, and
a StoreConnector and an offloading connector read what the other wrote."""

from __future__ import annotations

import pytest

from tests.kv_transfer.offload.conftest import (
    SMALL_POOL,
    assert_tiers_idle,
    generate_each,
    offloading,
    tokens,
)
from tests.kv_transfer.offload.test_offload_faults import PROMPTS, remote_tier


def store_connector(url: str) -> dict:
    return {
        "kv_connector": "StoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store_url": url},
    }


def test_a_remote_tier_shared_by_two_instances(make_llm, redis_server):
    want = tokens(generate_each(make_llm("llama", **SMALL_POOL), PROMPTS))
    config = offloading(remote_tier(redis_server.url))
    writer = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    generate_each(writer, PROMPTS)
    assert_tiers_idle(writer)
    reader = make_llm("llama", **SMALL_POOL, kv_transfer_config=config)
    outputs = generate_each(reader, PROMPTS)
    assert tokens(outputs) == want
    assert [o.num_cached_tokens for o in outputs] == [96] * 6
    assert reader.llm_engine.get_kv_connector_stats()["num_offload_remote_hit_tokens"] == 6 * 96


@pytest.mark.parametrize("writer_is_store_connector", [True, False])
def test_the_store_connector_and_the_remote_tier_read_each_other(
    make_llm, tmp_path, writer_is_store_connector
):
    url = (tmp_path / "store").as_uri()
    want = tokens(generate_each(make_llm("llama", **SMALL_POOL), PROMPTS))
    configs = [store_connector(url), offloading(remote_tier(url))]
    if not writer_is_store_connector:
        configs.reverse()
    writer = make_llm("llama", **SMALL_POOL, kv_transfer_config=configs[0])
    generate_each(writer, PROMPTS)
    writer.llm_engine.shutdown()  # every put done
    reader = make_llm("llama", **SMALL_POOL, kv_transfer_config=configs[1])
    outputs = generate_each(reader, PROMPTS)
    assert tokens(outputs) == want
    assert [o.num_cached_tokens for o in outputs] == [96] * 6
