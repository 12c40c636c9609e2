"""Loads from the tiers: requests that need the same blocks share one load (no convoy), an
aborted load still ends and frees its blocks, and every block read back is what was stored."""

from __future__ import annotations

import time

import torch

from pagedkv.engine.request_input import RequestInput
from pagedkv.kv_cache.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from pagedkv.kv_cache.kv_cache_spec import FullAttentionSpec
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer.offload.metadata import OffloadingMetadata, OffloadLoad, TierBlock
from pagedkv.kv_transfer.offload.worker import OffloadingConnectorWorker
from pagedkv.kv_transfer.store.block_codec import block_key
from tests.engine.conftest import run
from tests.kv_transfer.offload.conftest import (
    GREEDY,
    assert_tiers_idle,
    connector_halves,
    cpu_tier,
    disk_tier,
    offloading,
    settle,
    tokens,
)
from tests.tiny_models import random_prompt

POOL = dict(num_gpu_blocks_override=200, block_size=16, max_num_seqs=32, max_model_len=160)


def test_requests_needing_the_same_blocks_share_one_load(make_llm):
    shared = random_prompt(96, 1)  # 6 blocks
    prompts = [shared + random_prompt(20, 100 + i) for i in range(16)]
    want = tokens(
        make_llm("llama", **POOL).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    )
    llm = make_llm("llama", **POOL, kv_transfer_config=offloading(cpu_tier()))
    llm.generate([{"prompt_token_ids": shared + [7]}], GREEDY)  # the prefix, into the host tier
    settle(llm)
    assert llm.llm_engine.reset_prefix_cache()  # and out of the pool
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert tokens(outputs) == want
    assert all(o.num_cached_tokens == 96 for o in outputs)
    stats = llm.llm_engine.get_kv_connector_stats()
    assert sum(stats["offload_load_seconds"].counts) == 1  # one load, for the first request
    _, worker_half = connector_halves(llm)
    assert stats["num_offload_cpu_bytes_out"] == 6 * worker_half.layouts[0].payload_size
    assert_tiers_idle(llm)


def test_an_aborted_load_ends_and_frees_its_blocks(make_llm, monkeypatch):
    prompt = random_prompt(100, 3)
    llm = make_llm("llama", **POOL, kv_transfer_config=offloading(cpu_tier()))
    llm.generate([{"prompt_token_ids": prompt}], GREEDY)
    settle(llm)
    llm.llm_engine.reset_prefix_cache()
    _, worker_half = connector_halves(llm)
    slow_load = worker_half.host.load

    def load(*args, **kwargs):
        time.sleep(0.5)
        slow_load(*args, **kwargs)

    monkeypatch.setattr(worker_half.host, "load", load)
    engine = llm.llm_engine
    request_id = engine.add_request(RequestInput(prompt, GREEDY))
    engine.step()  # admitted: its load starts
    assert engine.scheduler.kv_transfers.phase(request_id) is not None
    engine.abort_request(request_id)
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests():  # the aborted load's blocks wait for its end
        assert time.monotonic() < deadline
        engine.step()
    assert_tiers_idle(llm)  # and make_llm checks every block is back in the pool


def test_outputs_with_max_parallel_loads_one_equal_many(make_llm):
    prompts = [random_prompt(100, 200 + i) for i in range(8)]
    requests = [(p, GREEDY, None) for p in prompts]
    outputs = {}
    for parallel in (1, 4):
        llm = make_llm(
            "llama", **POOL, kv_transfer_config=offloading(cpu_tier(), max_parallel_loads=parallel)
        )
        run(llm.llm_engine, requests)
        settle(llm)
        llm.llm_engine.reset_prefix_cache()
        outputs[parallel] = [list(o.outputs[0].token_ids) for o in run(llm.llm_engine, requests)]
        assert llm.llm_engine.get_kv_connector_stats()["num_offload_cpu_hit_tokens"] == 8 * 96
        assert_tiers_idle(llm)
    assert outputs[1] == outputs[4]


def _worker(tmp_path, num_blocks: int = 16) -> OffloadingConnectorWorker:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    kv_cache_config = KVCacheConfig(num_blocks, (KVCacheGroupSpec(("l0", "l1"), spec),))
    config = KVTransferConfig.from_dict(
        offloading(cpu_tier(0.0001), disk_tier(tmp_path / "kv", 0.0001))
    )
    worker = OffloadingConnectorWorker(config, kv_cache_config, "fp")
    caches = [torch.randn(2, num_blocks, 4, 2, 8) for _ in range(2)]
    worker.register_kv_caches(caches, [0, 0])
    return worker


def _step(worker: OffloadingConnectorWorker, meta: OffloadingMetadata) -> KVConnectorOutput:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    output = worker.get_finished()
    worker.clear_connector_metadata()
    return output


def test_every_block_read_back_equals_what_was_stored(tmp_path):
    worker = _worker(tmp_path)
    stored = {b: [c[:, b].clone() for c in worker.kv_caches] for b in range(1, 6)}
    keys = {b: block_key("fp", 0, bytes([b]) * 16) for b in stored}
    saves = {
        "cpu": [TierBlock(0, b, keys[b], slot=b) for b in stored],
        "disk": [TierBlock(0, b, keys[b]) for b in stored],
    }
    _step(worker, OffloadingMetadata(saves=saves))
    assert worker.lower["disk"].writer.wait_idle(10)
    for cache in worker.kv_caches:
        cache.zero_()
    # Blocks 1-2 from host memory into pool blocks 8-9, blocks 3-5 from disk into 10-12.
    load = OffloadLoad(
        "r",
        {
            "cpu": [TierBlock(0, 7 + b, keys[b], slot=b) for b in (1, 2)],
            "disk": [TierBlock(0, 7 + b, keys[b]) for b in (3, 4, 5)],
        },
    )
    output = _step(worker, OffloadingMetadata(loads=[load]))  # may end within its own step
    deadline = time.monotonic() + 10
    while not output.finished_recving:
        assert not output.invalid_block_ids
        assert time.monotonic() < deadline
        time.sleep(0.001)
        output = _step(worker, OffloadingMetadata())
    assert output.finished_recving == {"r"} and not output.invalid_block_ids
    for b, layers in stored.items():
        for cache, want in zip(worker.kv_caches, layers):
            assert torch.equal(cache[:, 7 + b], want)
    worker.shutdown()
