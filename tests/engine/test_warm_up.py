"""The engine's constructor runs every path a request can take (``ModelRunner.warm_up``), so the
first request costs what the second does; the warm-up leaves no trace an observer could see.

No timing is asserted: the tests check that the warm-up ran and that the engine after it is
exactly a fresh one (no request, no block, zeroed KV, no prefix-cache statistics, no KV
events, the global generator untouched), and that the first requests load nothing new.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv import SamplingParams
from tests.engine.inproc_connector import STORE
from tests.tiny_models import random_prompt

REPO_ROOT = Path(__file__).resolve().parents[2]


def assert_untouched(llm, seed: int = 0) -> None:
    """The engine holds what a fresh one holds."""
    engine = llm.llm_engine
    runner = engine.model_runner
    assert runner.warmed_up
    assert runner.requests == {} and runner.input_batch.num_reqs == 0
    kv = engine.kv_cache_manager
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks - 1
    assert kv.usage == 0.0
    assert kv.prefix_cache_stats.requests == kv.prefix_cache_stats.queries == 0
    assert kv.take_events() == []
    stats = engine.get_stats()
    assert stats.prefix_cache_queries == stats.num_steps == stats.num_prompt_tokens == 0
    assert all(not cache.any() for cache in runner.kv_caches)
    assert torch.equal(torch.random.get_rng_state(), torch.manual_seed(seed).get_state())


@pytest.mark.parametrize(
    "arch, engine_args",
    [
        ("llama", {}),
        ("llama", {"max_num_seqs": 1}),  # each dummy runs alone
        ("llama", {"enforce_eager": True}),
        ("mistral_window", {"block_size": 4}),  # two KV cache groups, dummies span 3 blocks
        ("qwen2", {"max_model_len": 3}),  # the shortest context that holds the steps
        ("llama", {"max_model_len": 2}),  # too short: nothing to run
    ],
    ids=["kernels", "one-seq", "eager", "sliding-window", "tiny-context", "no-room"],
)
def test_construction_warms_up_and_leaves_no_trace(make_llm, arch: str, engine_args) -> None:
    llm = make_llm(arch, seed=3, **engine_args)
    assert_untouched(llm, seed=3)


def test_no_kv_event_is_published_and_no_connector_sees_the_warm_up(make_llm) -> None:
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"}
    transfer = {"kv_connector": "InProcConnector", "kv_role": "kv_producer"}
    stored = dict(STORE)
    llm = make_llm("llama", kv_events_config=events, kv_transfer_config=transfer)
    assert_untouched(llm)
    publisher = llm.llm_engine.kv_event_publisher
    assert publisher.get_stats()["num_published_batches"] == 0
    assert stored == STORE
    assert llm.llm_engine.model_runner.kv_connector.get_finished().finished_sending == set()


FIRST_REQUESTS = """
import json, sys, threading
from pagedkv import LLM, SamplingParams
llm = LLM(sys.argv[1], max_num_seqs=16)
sampled = SamplingParams(
    temperature=0.7, top_k=8, top_p=0.9, min_p=0.02, repetition_penalty=1.2, seed=1,
    max_tokens=6, logprobs=3, prompt_logprobs=2,
)
greedy = SamplingParams(temperature=0.0, max_tokens=6)
modules, threads = set(sys.modules), {t.name for t in threading.enumerate()}
llm.generate([list(range(3, 23)), list(range(5, 14))], [greedy, sampled], use_tqdm=False)
llm.generate([list(range(7, 12))], greedy, use_tqdm=False)
new_threads = {t.name for t in threading.enumerate()} - threads
print(json.dumps({"modules": sorted(set(sys.modules) - modules), "threads": sorted(new_threads)}))
"""


def test_the_first_requests_load_nothing_new(checkpoint) -> None:
    """In a fresh process, greedy and sampled requests, batched then alone: no module is
    imported and no thread started on the way (the warm-up already ran every such path, and no
    disabled progress bar makes its lock and monitor thread)."""
    done = subprocess.run(
        [sys.executable, "-c", FIRST_REQUESTS, str(checkpoint("llama"))],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"modules": [], "threads": []}


def test_warm_up_outputs_equal_an_engine_that_did_not_warm_up(make_llm, monkeypatch) -> None:
    """Unseeded sampling draws from the engine seed's generator: the warm-up drew nothing, so
    the first request samples as it would have without it."""
    from pagedkv.worker.model_runner import ModelRunner

    prompts = [random_prompt(12, seed=1), random_prompt(20, seed=2)]
    params = SamplingParams(temperature=1.0, max_tokens=16)
    warm = make_llm("llama", seed=5).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: None)
    cold = make_llm("llama", seed=5).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
