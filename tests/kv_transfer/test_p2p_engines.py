"""The P2P connector between engines in separate processes (no HTTP): outputs, block
accounting, failure modes and hostile control messages."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.kv_transfer.engine_host import EngineHost, p2p_config
from tests.tiny_models import random_prompt

MAX_TOKENS = 8


def disaggregate(p: EngineHost, d: EngineHost, prompts: list[list[int]], **d_params) -> list[dict]:
    """Dispatch every prompt to P (max_tokens=1) and D at once, as the proxy does; D's outputs."""
    ids = []
    for i, prompt in enumerate(prompts):
        tid = uuid.uuid4().hex
        rid = f"r{i}-{tid[:6]}"
        d.add(
            rid,
            prompt,
            {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address, **d_params},
            max_tokens=MAX_TOKENS,
        )
        p.add(
            rid,
            prompt,
            {
                "do_remote_decode": True,
                "transfer_id": tid,
                "remote_engine_id": d.kv_transfer_config["engine_id"],
            },
            max_tokens=1,
        )
        ids.append(rid)
    outs = d.wait(ids, timeout_s=60)
    return [outs[rid] for rid in ids]


def pair(start_engine, arch="llama", p_extra=None, d_extra=None, p_hook=None, d_hook=None):
    p = start_engine(
        "P", arch, p_hook, kv_transfer_config=p2p_config("kv_producer", "P-0", **(p_extra or {}))
    )
    d = start_engine(
        "D", arch, d_hook, kv_transfer_config=p2p_config("kv_consumer", "D-0", **(d_extra or {}))
    )
    return p, d


@pytest.mark.parametrize(
    "arch,send_type",
    [("llama", "PUT"), ("llama", "PUT_ASYNC"), ("llama", "GET"), ("qwen2_hybrid", "PUT_ASYNC")],
)
def test_outputs_equal_single_instance_and_every_block_is_freed(
    start_engine, reference_outputs, arch, send_type
) -> None:
    p, d = pair(start_engine, arch, {"send_type": send_type}, {"send_type": send_type})
    prompts = [random_prompt(n, seed=n) for n in (5, 16, 33, 47, 90)]
    outs = disaggregate(p, d, prompts)
    assert [o["token_ids"] for o in outs] == reference_outputs(arch, prompts, MAX_TOKENS)
    d_stats, p_stats = d.wait_settled(), p.wait_settled()
    # D computed one prompt token per request (the last, for its logits); the rest arrived.
    assert d_stats["num_prompt_tokens"] == len(prompts)
    assert d_stats["connector"]["num_loads_delivered"] == len(prompts)
    assert p_stats["connector"]["num_sends_delivered"] == len(prompts)
    num_groups = 2 if arch == "qwen2_hybrid" else 1
    assert d_stats["connector"]["num_blocks_received"] <= num_groups * sum(
        -(-len(q) // 16) for q in prompts
    )


def test_a_partial_local_prefix_hit_moves_only_the_missing_blocks(
    start_engine, reference_outputs
) -> None:
    p, d = pair(start_engine)
    shared = random_prompt(40, seed=7)
    # D serves a request on its own first: the first 2 full blocks (32 tokens) get cached.
    d.add("warm", shared, max_tokens=1)
    d.wait(["warm"])
    prompt = shared[:32] + random_prompt(30, seed=8)  # 62 tokens = 4 blocks, 2 of them on D
    (out,) = disaggregate(p, d, [prompt])
    assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    stats = d.wait_settled()["connector"]
    assert stats["num_blocks_received"] == 2
    # 2 blocks x 2 layers x (K and V) x 16 tokens x 2 kv heads x 16 head size x 4 bytes
    assert stats["num_bytes_received"] == 2 * 2 * 2 * 16 * 2 * 16 * 4
    p.wait_settled()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_p_dying_mid_transfer_ends_the_load_by_policy(
    start_engine, reference_outputs, policy
) -> None:
    p, d = pair(
        start_engine,
        p_extra={"send_type": "PUT_ASYNC", "chunk_bytes": 4096},
        d_extra={"kv_load_failure_policy": policy, "kv_load_timeout": 20},
        p_hook="die_mid_transfer",
    )
    prompt = random_prompt(100, seed=9)
    t0 = time.monotonic()
    (out,) = disaggregate(p, d, [prompt])
    assert time.monotonic() - t0 < 20  # well within the deadline: the broken pipe is seen
    p.process.join(timeout=10)
    assert not p.process.is_alive()
    if policy == "fail":
        assert out["finish_reason"] == "error" and "kv_load_failure_policy=fail" in out["error"]
    else:
        assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    stats = d.wait_settled()
    assert stats["connector"]["num_loads_failed"] == 1
    assert "receive failed" in d.log()


def test_d_dying_after_its_want_lets_p_free_the_blocks(start_engine) -> None:
    p, d = pair(start_engine, p_extra={"lease_s": 1.0}, d_hook="die_after_want")
    prompt = random_prompt(50, seed=10)
    tid = uuid.uuid4().hex
    d.add("r", prompt, {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address})
    d.process.join(timeout=10)
    assert not d.process.is_alive()
    p.add("r", prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    p.wait(["r"])
    stats = p.wait_settled(timeout_s=15)["connector"]
    assert stats["num_sends_failed"] + stats["num_sends_expired"] == 1


def test_a_lease_nobody_renews_expires_and_a_late_want_is_refused(start_engine) -> None:
    p, d = pair(start_engine, p_extra={"lease_s": 1.0})
    prompt = random_prompt(50, seed=11)
    tid = uuid.uuid4().hex
    p.add("r", prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    p.wait(["r"])
    assert p.stats()["kv_cache_usage"] > 0  # held for D, which never comes
    stats = p.wait_settled(timeout_s=10)["connector"]
    assert stats["num_sends_expired"] == 1
    # D turns up late: P NACKs, D's load fails at once and the policy applies.
    d.add("late", prompt, {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address})
    out = d.wait(["late"])["late"]
    assert out["finish_reason"] == "error"
    assert d.wait_settled()["connector"]["num_loads_refused"] == 1


def test_d_deadline_cancels_and_p_frees_when_its_request_comes_later(start_engine) -> None:
    p, d = pair(start_engine, d_extra={"kv_load_timeout": 1.0})
    prompt = random_prompt(40, seed=12)
    tid = uuid.uuid4().hex
    d.add("r", prompt, {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address})
    out = d.wait(["r"], timeout_s=10)["r"]
    assert out["finish_reason"] == "error"
    assert d.wait_settled()["connector"]["num_loads_failed"] == 1
    # P only now gets its request: D's CANCEL already told it nobody wants this KV.
    p.add("r", prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    p.wait(["r"])
    p.wait_settled(timeout_s=5)
    assert "cancelled by D" in p.log()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_full_get_pool_nacks_and_the_policy_applies(
    start_engine, reference_outputs, policy
) -> None:
    p, d = pair(
        start_engine,
        p_extra={"send_type": "GET", "kv_buffer_size": 1000},
        d_extra={"kv_load_failure_policy": policy, "send_type": "GET"},
    )
    prompt = random_prompt(40, seed=13)
    (out,) = disaggregate(p, d, [prompt])
    if policy == "fail":
        assert out["finish_reason"] == "error"
    else:
        assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
    assert p.wait_settled()["connector"]["num_sends_refused"] == 1
    assert d.wait_settled()["connector"]["num_loads_refused"] == 1
    assert "send pool full" in p.log()
