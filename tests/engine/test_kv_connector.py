"""The scheduler's side of the KV connector contract, with two engines in one process."""

from __future__ import annotations

import time

import pytest

import tests.engine.inproc_connector as inproc
from pagedkv import SamplingParams
from pagedkv.engine.kv_transfer_tracker import TransferPhase
from pagedkv.engine.request_input import RequestInput
from tests.engine.conftest import run
from tests.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def kv_config(role: str, **extra) -> dict:
    return dict(kv_connector="InProcConnector", kv_role=role, **extra)


def prefill_remotely(producer, prompts: list[list[int]]) -> list[dict]:
    """P: max_tokens=1 with do_remote_decode; returns the params D needs."""
    outs = run(
        producer.llm_engine,
        [
            (
                p,
                SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                {"do_remote_decode": True, "transfer_id": f"t{i}-{time.monotonic_ns()}"},
            )
            for i, p in enumerate(prompts)
        ],
    )
    return [o.kv_transfer_params for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2_hybrid"])
def test_disaggregated_outputs_equal_single_instance(arch, make_llm) -> None:
    prompts = [random_prompt(n, seed=n) for n in (5, 16, 33, 47)]
    single = make_llm(arch).generate(prompts, GREEDY, use_tqdm=False)
    producer = make_llm(arch, kv_transfer_config=kv_config("kv_producer"))
    consumer = make_llm(arch, kv_transfer_config=kv_config("kv_consumer"))
    params = prefill_remotely(producer, prompts)
    assert all(p["do_remote_prefill"] for p in params)
    outs = run(consumer.llm_engine, [(p, GREEDY, kv) for p, kv in zip(prompts, params)])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in single]
    # D computed exactly one prompt token per request: the last (for its logits).
    assert consumer.llm_engine.get_stats().num_prompt_tokens == len(prompts)


def test_failed_load_with_fail_policy_ends_in_an_error(make_llm) -> None:
    prompt = random_prompt(40, seed=1)
    producer = make_llm("llama", kv_transfer_config=kv_config("kv_producer"))
    consumer = make_llm("llama", kv_transfer_config=kv_config("kv_consumer"))
    (params,) = prefill_remotely(producer, [prompt])
    (out,) = run(consumer.llm_engine, [(prompt, GREEDY, {**params, "fail_from_block": 1})])
    assert out.outputs[0].finish_reason == "error"
    assert "kv_load_failure_policy=fail" in out.error
    assert out.outputs[0].token_ids == []


def test_failed_load_with_recompute_policy_recomputes_the_missing_part(make_llm) -> None:
    prompt = random_prompt(50, seed=2)
    (expected,) = make_llm("llama").generate([prompt], GREEDY, use_tqdm=False)
    producer = make_llm("llama", kv_transfer_config=kv_config("kv_producer"))
    consumer = make_llm(
        "llama", kv_transfer_config=kv_config("kv_consumer", kv_load_failure_policy="recompute")
    )
    (params,) = prefill_remotely(producer, [prompt])
    (out,) = run(consumer.llm_engine, [(prompt, GREEDY, {**params, "fail_from_block": 2})])
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    # Blocks 0-1 (32 tokens) arrived; D computed the other 18 prompt tokens itself.
    assert consumer.llm_engine.get_stats().num_prompt_tokens == 50 - 32


def test_a_load_that_never_completes_fails_at_its_deadline(make_llm) -> None:
    prompt = random_prompt(30, seed=3)
    producer = make_llm("llama", kv_transfer_config=kv_config("kv_producer"))
    consumer = make_llm("llama", kv_transfer_config=kv_config("kv_consumer", kv_load_timeout=0.3))
    (params,) = prefill_remotely(producer, [prompt])
    t0 = time.monotonic()
    (out,) = run(consumer.llm_engine, [(prompt, GREEDY, {**params, "hang": True})])
    assert out.outputs[0].finish_reason == "error"
    assert 0.3 <= time.monotonic() - t0 < 5


def test_abort_while_loading_frees_blocks_after_the_load_ends(make_llm) -> None:
    prompt = random_prompt(30, seed=4)
    producer = make_llm("llama", kv_transfer_config=kv_config("kv_producer"))
    consumer = make_llm("llama", kv_transfer_config=kv_config("kv_consumer"))
    (params,) = prefill_remotely(producer, [prompt])
    engine = consumer.llm_engine
    rid = engine.add_request(
        RequestInput(prompt, GREEDY, kv_transfer_params={**params, "hang": True})
    )
    engine.step()
    assert engine.kv_cache_manager.usage > 0
    engine.abort_request(rid)
    assert engine.kv_cache_manager.usage > 0  # the load may still write: blocks held
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache_manager.usage == 0


def test_producer_holds_blocks_until_sent(make_llm) -> None:
    prompt = random_prompt(40, seed=5)
    producer = make_llm("llama", kv_transfer_config=kv_config("kv_producer"))
    engine = producer.llm_engine
    engine.add_request(
        RequestInput(
            prompt,
            SamplingParams(max_tokens=1),
            kv_transfer_params={"do_remote_decode": True, "transfer_id": "held"},
        )
    )
    outs = engine.step()
    assert outs[0].finished and outs[0].kv_transfer_params["transfer_id"] == "held"
    assert engine.kv_cache_manager.usage > 0 and engine.has_unfinished_requests()
    engine.step()
    assert "held" in inproc.STORE
    assert engine.kv_cache_manager.usage == 0 and not engine.has_unfinished_requests()


def test_abort_after_the_load_ended_but_before_promotion_frees_at_once(make_llm) -> None:
    """The load of L ends while R holds the only running slot, so L is not promoted yet; an
    abort then has no load to wait for. (Once L waited for a second end of its load that never
    came: its blocks leaked and the engine never drained.)"""
    prompt = random_prompt(30, seed=6)
    producer = make_llm("llama", kv_transfer_config=kv_config("kv_producer"))
    consumer = make_llm("llama", kv_transfer_config=kv_config("kv_consumer"), max_num_seqs=1)
    (params,) = prefill_remotely(producer, [prompt])
    engine = consumer.llm_engine
    loaded = engine.add_request(RequestInput(prompt, GREEDY, kv_transfer_params=params))
    engine.add_request(RequestInput(random_prompt(9, seed=7), GREEDY))
    engine.step()  # L's load starts and ends; R takes the only slot
    transfers = engine.scheduler.kv_transfers
    assert transfers.phase(loaded) is TransferPhase.LOADED
    engine.abort_request(loaded)
    assert transfers.phase(loaded) is None and not transfers.holds_blocks
    run(engine, [])
    assert engine.kv_cache_manager.usage == 0


def test_an_id_whose_blocks_are_still_held_is_refused(make_llm) -> None:
    """P holds a finished request's blocks until they are sent: a new request under the same id
    would otherwise take over that block table, and the send's end would free its blocks."""
    producer = make_llm("llama", kv_transfer_config=kv_config("kv_producer"))
    engine = producer.llm_engine
    remote = {"do_remote_decode": True, "transfer_id": "reused"}
    engine.add_request(
        RequestInput(
            random_prompt(40, seed=8),
            SamplingParams(max_tokens=1),
            request_id="r",
            kv_transfer_params=remote,
        )
    )
    assert engine.step()[0].finished and engine.kv_cache_manager.usage > 0
    with pytest.raises(ValueError, match="still in use"):
        engine.add_request(RequestInput(random_prompt(20, seed=9), GREEDY, request_id="r"))
    run(engine, [])
    # Free again once sent.
    engine.add_request(RequestInput(random_prompt(20, seed=9), GREEDY, request_id="r"))
    run(engine, [])
