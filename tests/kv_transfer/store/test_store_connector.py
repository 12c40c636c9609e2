"""The store connector end to end: two engines in one process, a real store between them."""

from __future__ import annotations

import logging
import time

import pytest

from pagedkv import SamplingParams
from pagedkv.engine.request_input import RequestInput
from tests.engine.conftest import run
from tests.kv_transfer.store.conftest import store_kv_config
from tests.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 16


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    ("store_url", "arch", "load_mode"),
    [
        (store, arch, load_mode)
        for store in ("redis", "file")
        for arch in ("llama", "qwen2_hybrid")
        for load_mode in ("async", "sync")
    ]
    # Mooncake: each mode once (a Mooncake engine takes ~3 s to shut down).
    + [("mooncake", "llama", "sync"), ("mooncake", "qwen2_hybrid", "async")],
    indirect=["store_url"],
)
def test_1p1d_through_the_store_equals_a_single_instance(arch, load_mode, store_url, make_llm):
    prompts = [random_prompt(n, seed=n) for n in (5, 16, 33, 47, 80)]
    expected = make_llm(arch).generate(prompts, GREEDY, use_tqdm=False)
    producer = make_llm(arch, kv_transfer_config=store_kv_config(store_url, "kv_producer"))
    consumer = make_llm(
        arch, kv_transfer_config=store_kv_config(store_url, "kv_consumer", load_mode=load_mode)
    )
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    p_outs = run(producer.llm_engine, [(p, first, {"do_remote_decode": True}) for p in prompts])
    params = [o.kv_transfer_params for o in p_outs]
    assert [p["store_num_tokens"] for p in params] == [len(p) // BLOCK * BLOCK for p in prompts]
    d_outs = run(consumer.llm_engine, [(p, GREEDY, kv) for p, kv in zip(prompts, params)])
    assert token_ids(d_outs) == token_ids(expected)
    # D computed only what the store could not give: the tail after the last whole block
    # before the last prompt token.
    tails = [len(p) - (len(p) - 1) // BLOCK * BLOCK for p in prompts]
    assert consumer.llm_engine.get_stats().num_prompt_tokens == sum(tails)
    assert consumer.llm_engine.model_runner.kv_connector.stats.num_load_invalid == 0


def test_a_second_instance_reuses_the_first_ones_prefix(store_url, make_llm):
    shared = random_prompt(50, seed=7)
    first_prompt = shared + random_prompt(20, seed=8)
    second_prompt = shared + random_prompt(30, seed=9)
    (expected,) = make_llm("llama").generate([second_prompt], GREEDY, use_tqdm=False)
    config = store_kv_config(store_url, "kv_both")
    a, b = (
        make_llm("llama", kv_transfer_config=config),
        make_llm("llama", kv_transfer_config=config),
    )
    a.generate([first_prompt], GREEDY, use_tqdm=False)
    (out,) = b.generate([second_prompt], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    # The shared 50 tokens hold 3 whole blocks (48 tokens): B computed the other 32.
    assert b.llm_engine.get_stats().num_prompt_tokens == 80 - 48
    assert out.num_cached_tokens == 48


def test_d_waits_for_blocks_p_is_still_writing(redis_server, make_llm):
    """D gets the request as soon as P answers, while P's writer is still busy."""
    prompt = random_prompt(70, seed=11)
    (expected,) = make_llm("llama").generate([prompt], GREEDY, use_tqdm=False)
    producer = make_llm(
        "llama", kv_transfer_config=store_kv_config(redis_server.url, "kv_producer")
    )
    consumer = make_llm(
        "llama", kv_transfer_config=store_kv_config(redis_server.url, "kv_consumer")
    )
    backend = producer.llm_engine.model_runner.kv_connector.backend
    real_put_from = backend.put_from

    def slow_put_from(keys, rows):
        time.sleep(0.3)
        real_put_from(keys, rows)

    backend.put_from = slow_put_from
    p_engine, d_engine = producer.llm_engine, consumer.llm_engine
    p_engine.add_request(
        RequestInput(
            prompt,
            SamplingParams(max_tokens=1, ignore_eos=True),
            kv_transfer_params={"do_remote_decode": True},
        )
    )
    params = None
    while params is None:
        params = next((o.kv_transfer_params for o in p_engine.step() if o.finished), None)
    assert p_engine.has_unfinished_requests()  # P still holds the blocks: its puts run
    d_id = d_engine.add_request(RequestInput(prompt, GREEDY, kv_transfer_params=params))
    out = None
    deadline = time.monotonic() + 30
    while out is None or p_engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        if p_engine.has_unfinished_requests():
            p_engine.step()
        for o in d_engine.step():
            if o.finished and o.request_id == d_id:
                out = o
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert d_engine.get_stats().num_prompt_tokens == 70 - 64


#: ``store_num_tokens`` values a client may send that are not a token count of a 70-token
#: prompt (an int, not a bool, from 0 to 70).
BAD_STORE_NUM_TOKENS = [
    "x",
    "48",
    [1],
    {"n": 1},
    True,
    False,
    48.0,
    float("nan"),
    float("inf"),
    -1,
    -(2**70),
    71,
    2**70,
]


def test_a_bad_store_num_tokens_is_ignored_with_a_warning(redis_server, make_llm, caplog):
    """``store_num_tokens`` is client input read on the engine thread: a bad value is warned
    about and ignored (never an exception, never a wait for blocks nobody announced); each
    request completes exactly and nothing is left behind."""
    # One prompt each: a prompt hit in the local prefix cache is not looked up in the store.
    prompts = [random_prompt(70, seed=200 + i) for i in range(len(BAD_STORE_NUM_TOKENS))]
    expected = token_ids(make_llm("llama").generate(prompts, GREEDY, use_tqdm=False))
    # An empty store and a long wait: a bad value read as an announcement would wait 30 s.
    config = store_kv_config(redis_server.url, "kv_consumer", remote_prefill_wait_s=30)
    consumer = make_llm("llama", kv_transfer_config=config)
    requests = [
        (prompt, GREEDY, {"do_remote_prefill": True, "store_num_tokens": value})
        for prompt, value in zip(prompts, BAD_STORE_NUM_TOKENS)
    ]
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pagedkv.kv_transfer.store.connector"):
        outs = run(consumer.llm_engine, requests)
    assert time.monotonic() - t0 < 10
    assert token_ids(outs) == expected
    warned = " ".join(r.getMessage() for r in caplog.records if "store_num_tokens" in r.message)
    assert all(f"request {o.request_id}:" in warned for o in outs)
    assert not consumer.llm_engine.scheduler.connector._lookups
    # make_llm checks afterwards: no request left, every block back in the pool.
