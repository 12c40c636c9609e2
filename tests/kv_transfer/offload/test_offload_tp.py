"""The tiers under tensor parallelism: the host tier per rank (its own heads, the same slots on
every rank); the disk tier's files per KV head, so an instance restarted with another TP size
reads them; the ranks' reports combined, a store ended once every rank reported it."""

from __future__ import annotations

import time

import pytest
import torch

from pagedkv.distributed.shard import TPLayout
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer.multi.connector import MultiConnector
from pagedkv.kv_transfer.offload.connector import OffloadingConnector
from pagedkv.kv_transfer.offload.metadata import (
    OffloadingMetadata,
    OffloadLoad,
    OffloadReport,
    TierBlock,
)
from pagedkv.kv_transfer.offload.rank_reports import RankReports
from pagedkv.kv_transfer.offload.worker import OffloadingConnectorWorker
from pagedkv.kv_transfer.store.block_codec import block_key
from tests.kv_transfer.offload.conftest import cpu_tier, disk_tier, offloading
from tests.kv_transfer.store.tp_ranks import (
    full_caches,
    kv_cache_config,
    on_each_rank,
    rank_caches,
)

NUM_KV_HEADS = 4
KEYS = {b: block_key("fp", 0, bytes([b]) * 16) for b in range(1, 6)}


def tiers_config(tmp_path) -> KVTransferConfig:
    return KVTransferConfig.from_dict(offloading(cpu_tier(0.0001), disk_tier(tmp_path / "kv")))


def worker_half(tmp_path, tp: TPLayout, caches) -> OffloadingConnectorWorker:
    worker = OffloadingConnectorWorker(tiers_config(tmp_path), kv_cache_config(tp), "fp", tp)
    worker.register_kv_caches(caches, [0] * len(caches))
    return worker


def step(worker: OffloadingConnectorWorker, meta: OffloadingMetadata) -> KVConnectorOutput:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    output = worker.get_finished()
    worker.clear_connector_metadata()
    return output


def load_until_done(worker: OffloadingConnectorWorker, load: OffloadLoad) -> set[int]:
    """Run steps until ``load`` ends; the blocks it left invalid."""
    output = step(worker, OffloadingMetadata(loads=[load]))
    invalid = set(output.invalid_block_ids)
    deadline = time.monotonic() + 10
    while not output.finished_recving:
        assert time.monotonic() < deadline
        time.sleep(0.001)
        output = step(worker, OffloadingMetadata())
        invalid |= output.invalid_block_ids
    return invalid


def store_on_each_rank(tmp_path, full, tp_size: int, tiers: tuple[str, ...]) -> list:
    """Each rank of an instance of ``tp_size`` stores blocks 1-5 into ``tiers``; its worker
    half (not shut down) and what it reported."""

    def rank_stores(rank: int):
        tp = TPLayout(rank, tp_size, NUM_KV_HEADS)
        worker = worker_half(tmp_path, tp, rank_caches(full, tp))
        saves = {
            tier: [TierBlock(0, b, key, b if tier == "cpu" else None) for b, key in KEYS.items()]
            for tier in tiers
        }
        outputs = [step(worker, OffloadingMetadata(saves=saves))]
        for lower in worker.lower.values():
            assert lower.writer.wait_idle(10)
        outputs.append(step(worker, OffloadingMetadata()))
        return worker, OffloadReport.combine([output.worker_meta for output in outputs])

    return on_each_rank(rank_stores, tp_size)


def assert_loaded(caches, full, tp: TPLayout, into: int) -> None:
    heads = tp.kv_heads()
    for cache, want in zip(caches, full):
        assert torch.equal(cache[:, into + 1 : into + 6], want[:, 1:6, :, heads.start : heads.end])


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2), (4, 2)])
def test_a_restart_with_another_tp_size_reads_the_disk_tier(tmp_path, writer_tp, reader_tp):
    full = full_caches(NUM_KV_HEADS, seed=0)
    for worker, _ in store_on_each_rank(tmp_path, full, writer_tp, ("disk",)):
        worker.shutdown()
    tp0 = TPLayout(0, reader_tp, NUM_KV_HEADS)
    scheduler_half = OffloadingConnector(tiers_config(tmp_path), kv_cache_config(tp0), "fp", tp0)
    assert set(scheduler_half.tiers["disk"].entries) == set(KEYS.values())

    def rank_loads(rank: int) -> None:
        tp = TPLayout(rank, reader_tp, NUM_KV_HEADS)
        caches = [torch.zeros_like(c) for c in rank_caches(full, tp)]
        worker = worker_half(tmp_path, tp, caches)
        blocks = [TierBlock(0, 6 + b, key) for b, key in KEYS.items()]
        assert not load_until_done(worker, OffloadLoad("r", {"disk": blocks}))
        assert_loaded(caches, full, tp, into=6)
        worker.shutdown()

    on_each_rank(rank_loads, reader_tp)


def test_a_block_some_ranks_did_not_store_is_dropped_at_restart(tmp_path):
    """Rank 1 of TP 2 never wrote block 5's heads: a TP 1 restart indexes blocks 1-4 and
    deletes block 5's other files in its first step."""
    full = full_caches(NUM_KV_HEADS, seed=0)
    for worker, _ in store_on_each_rank(tmp_path, full, 2, ("disk",)):
        worker.shutdown()
    rank1 = worker_half(
        tmp_path, TPLayout(1, 2, NUM_KV_HEADS), rank_caches(full, TPLayout(1, 2, 4))
    )
    rank1.lower["disk"].writer.submit_delete([KEYS[5]], rank1.head_layouts[0].write_keys([KEYS[5]]))
    assert rank1.lower["disk"].writer.wait_idle(10)
    rank1.shutdown()
    tp = TPLayout(0, 1, NUM_KV_HEADS)
    scheduler_half = OffloadingConnector(tiers_config(tmp_path), kv_cache_config(tp), "fp", tp)
    assert set(scheduler_half.tiers["disk"].entries) == {KEYS[b] for b in range(1, 5)}
    assert scheduler_half._meta.deletes == {"disk": [KEYS[5]]}


def test_each_rank_keeps_its_own_heads_in_the_host_tier_and_reports_each_store(tmp_path):
    full = full_caches(NUM_KV_HEADS, seed=0)
    ranks = store_on_each_rank(tmp_path, full, 2, ("cpu", "disk"))
    tp0 = TPLayout(0, 2, NUM_KV_HEADS)
    scheduler_half = OffloadingConnector(tiers_config(tmp_path), kv_cache_config(tp0), "fp", tp0)
    combined = scheduler_half.combine_worker_meta([report for _, report in ranks])
    assert len(combined.stores) == 2 * 2 * len(KEYS)  # both ranks, both tiers, every block
    assert sorted(RankReports(2).stores_ended(combined.stores)) == sorted(
        (tier, key, True) for tier in ("cpu", "disk") for key in KEYS.values()
    )
    for rank, (worker, _) in enumerate(ranks):
        for cache in worker.kv_caches:
            cache.zero_()
        blocks = [TierBlock(0, 6 + b, key, b) for b, key in KEYS.items()]
        assert not load_until_done(worker, OffloadLoad("r", {"cpu": blocks}))
        assert_loaded(worker.kv_caches, full, TPLayout(rank, 2, NUM_KV_HEADS), into=6)
        worker.shutdown()


def test_a_store_ends_once_every_rank_reported_it_stored_only_if_each_did():
    reports = RankReports(2)
    assert reports.stores_ended([("disk", "a", True), ("disk", "b", True)]) == []
    assert reports.stores_ended([("disk", "b", False), ("cpu", "a", True)]) == [
        ("disk", "b", False)
    ]
    assert reports.stores_ended([("disk", "a", True)]) == [("disk", "a", True)]
    assert reports.loads_ended({"r": 0.5}, []) == []
    assert reports.loads_ended({"r": 0.2, "s": 0.1}, ["r"]) == [0.5]  # the slower rank's
    assert RankReports(1).stores_ended([("cpu", "a", False)]) == [("cpu", "a", False)]


def test_a_multi_connector_combines_each_childs_reports(tmp_path):
    tiers = offloading(cpu_tier(0.0001))
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [tiers, tiers]},
        }
    )
    tp = TPLayout(0, 2, NUM_KV_HEADS)
    multi = MultiConnector(config, kv_cache_config(tp), "fp", tp)
    rank0 = (OffloadReport(stores=[("cpu", "a", True)], load_seconds={"r": 0.1}), None)
    rank1 = (OffloadReport(stores=[("cpu", "a", True)], load_seconds={"r": 0.3}), None)
    first, second = multi.combine_worker_meta([rank0, rank1])
    assert first.stores == [("cpu", "a", True)] * 2 and first.load_seconds == {"r": 0.3}
    assert second is None
    assert multi.combine_worker_meta([None, None]) is None
    multi.shutdown()
