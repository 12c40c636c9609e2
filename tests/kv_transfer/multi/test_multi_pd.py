"""1P1D where P and D each run MultiConnector(P2pConnector, StoreConnector on a shared
directory), engines in their own processes: D takes P's KV over P2P and hits the store for
prefixes it never computed; P hits the store before computing. Outputs equal one instance's,
and every block comes back (P's blocks are held by both children until both are done)."""

from __future__ import annotations

import uuid

import pytest

from tests.kv_transfer.engine_host import EngineHost, p2p_config
from tests.kv_transfer.store.conftest import store_kv_config
from tests.kv_transfer.test_p2p_engines import MAX_TOKENS, disaggregate
from tests.tiny_models import random_prompt


def multi_config(role: str, engine_id: str, store_url: str) -> dict:
    """P2P first (it loads what P hands off), the store second (a cache both instances
    share). The P2P child's address is copied to the top (where the tests read it)."""
    p2p = p2p_config(role, engine_id)
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_port": p2p["kv_port"],
        "kv_connector_extra_config": {"connectors": [p2p, store_kv_config(store_url, "kv_both")]},
    }


@pytest.fixture
def pd(start_engine, tmp_path) -> tuple[EngineHost, EngineHost]:
    store_url = f"file://{tmp_path / 'store'}"
    p = start_engine("P", kv_transfer_config=multi_config("kv_producer", "P-0", store_url))
    d = start_engine("D", kv_transfer_config=multi_config("kv_consumer", "D-0", store_url))
    return p, d


def alone(host: EngineHost, prompt: list[int]) -> list[int]:
    rid = f"alone-{uuid.uuid4().hex[:8]}"
    host.add(rid, prompt, max_tokens=MAX_TOKENS)
    return host.wait([rid])[rid]["token_ids"]


def test_1p1d_with_a_store_beside_p2p_equals_a_single_instance(pd, reference_outputs) -> None:
    p, d = pd
    prompts = [random_prompt(n, seed=300 + n) for n in (7, 16, 45, 100)]
    outs = disaggregate(p, d, prompts)
    assert [o["token_ids"] for o in outs] == reference_outputs("llama", prompts, MAX_TOKENS)
    p_stats, d_stats = p.wait_settled(), d.wait_settled()
    # P2P loaded every prompt: D computed only the last token of each.
    assert d_stats["num_prompt_tokens"] == len(prompts)
    assert d_stats["connector"]["num_p2p_loads_delivered"] == len(prompts)
    assert p_stats["connector"]["num_p2p_sends_delivered"] == len(prompts)
    # P also put its prompts' full blocks in the store (and held them until both were done).
    assert p_stats["connector"]["num_store_blocks_put"] == sum(n // 16 for n in (7, 16, 45, 100))

    # D: a prefix only P computed comes from the store.
    shared = random_prompt(70, seed=1)
    alone(p, shared)
    p.wait_settled()
    prompt = shared[:64] + random_prompt(20, seed=2)
    assert alone(d, prompt) == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    d_after = d.wait_settled()
    assert d_after["num_prompt_tokens"] - d_stats["num_prompt_tokens"] == len(prompt) - 64
    assert d_after["connector"]["num_store_blocks_loaded"] == 4

    # P: a handoff whose prefix only D computed: P loads it from the store, then computes the
    # rest and sends the whole prompt to D over P2P.
    mine = random_prompt(50, seed=3)
    alone(d, mine)
    d_before = d.wait_settled()
    p_before = p.wait_settled()
    prompt = mine[:48] + random_prompt(30, seed=4)
    (out,) = disaggregate(p, d, [prompt])
    assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    p_after, d_after = p.wait_settled(), d.wait_settled()
    assert p_after["num_prompt_tokens"] - p_before["num_prompt_tokens"] == len(prompt) - 48
    assert p_after["connector"]["num_store_blocks_loaded"] == 3
    assert d_after["num_prompt_tokens"] - d_before["num_prompt_tokens"] == 1
