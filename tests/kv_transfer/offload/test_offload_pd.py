"""1P1D with tiers on both sides: P and D each run MultiConnector(offloading, P2P), engines in
their own processes. Outputs equal one instance's; D takes a shared prefix from its own tiers
and only the rest from P; P loads a prefix from its tiers before computing the rest."""

from __future__ import annotations

import uuid

from tests.kv_transfer.engine_host import EngineHost, p2p_config
from tests.kv_transfer.offload.conftest import cpu_tier, offloading
from tests.kv_transfer.test_p2p_engines import MAX_TOKENS, disaggregate
from tests.tiny_models import random_prompt


def tiers_and_p2p(role: str, engine_id: str) -> dict:
    """The tiers first (they load what they hold), P2P second (the rest, from P). The P2P
    child's address is copied to the top, where the tests read it."""
    p2p = p2p_config(role, engine_id)
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_port": p2p["kv_port"],
        "kv_connector_extra_config": {"connectors": [offloading(cpu_tier()), p2p]},
    }


def alone(host: EngineHost, prompt: list[int]) -> list[int]:
    rid = f"alone-{uuid.uuid4().hex[:8]}"
    host.add(rid, prompt, max_tokens=MAX_TOKENS)
    return host.wait([rid])[rid]["token_ids"]


def grew(after: dict, before: dict, name: str) -> int:
    return after["connector"].get(name, 0) - before["connector"].get(name, 0)


def test_1p1d_with_tiers_on_both_sides_equals_a_single_instance(
    start_engine, reference_outputs
) -> None:
    p = start_engine("P", kv_transfer_config=tiers_and_p2p("kv_producer", "P-0"))
    d = start_engine("D", kv_transfer_config=tiers_and_p2p("kv_consumer", "D-0"))
    prompts = [random_prompt(n, seed=400 + n) for n in (7, 16, 45, 100)]
    outs = disaggregate(p, d, prompts)
    assert [o["token_ids"] for o in outs] == reference_outputs("llama", prompts, MAX_TOKENS)
    p_stats, d_stats = p.wait_settled(), d.wait_settled()
    assert p_stats["connector"]["num_p2p_sends_delivered"] == len(prompts)
    assert d_stats["num_prompt_tokens"] == len(prompts)  # D computed only each last token
    assert d_stats["connector"]["num_p2p_loads_delivered"] == len(prompts)

    # D: a prefix it computed once, evicted from its pool since, comes from its host tier;
    # only the rest comes from P.
    shared = random_prompt(64, seed=5)
    alone(d, shared + [1])
    assert d.call("reset_prefix_cache")
    prompt = shared + random_prompt(40, seed=6)
    d_before = d.wait_settled()
    (out,) = disaggregate(p, d, [prompt])
    assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    d_after, p_after = d.wait_settled(), p.wait_settled()
    assert d_after["num_prompt_tokens"] - d_before["num_prompt_tokens"] == 1
    assert grew(d_after, d_before, "num_offload_cpu_hit_tokens") == 64
    assert grew(d_after, d_before, "num_p2p_loads_delivered") == 1

    # P: the same prefix, now in P's host tier too (P computed it for that handoff): once P's
    # pool forgot it, P loads it from its tier and computes only the rest.
    assert p.call("reset_prefix_cache")
    prompt = shared + random_prompt(30, seed=7)
    (out,) = disaggregate(p, d, [prompt])
    assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    p_last = p.wait_settled()
    assert p_last["num_prompt_tokens"] - p_after["num_prompt_tokens"] == len(prompt) - 64
    assert grew(p_last, p_after, "num_offload_cpu_hit_tokens") == 64
