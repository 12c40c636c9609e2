"""The store under tensor parallelism: values per KV head, so an instance of any TP size reads
what another wrote. The key scheme alone (every TP size and KV head count), then real worker
halves, one per rank on threads of their own, writing to a real redis-server or directory
and readers of another TP size loading byte-identical heads."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from pagedkv.distributed.shard import TPLayout
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_transfer.store.block_codec import block_key, head_key, head_keys
from pagedkv.kv_transfer.store.connector import StoreConnector
from pagedkv.kv_transfer.store.metadata import BlockRef, StoreConnectorMetadata, StoreLoad
from pagedkv.kv_transfer.store.rank_heads import RankHeads
from pagedkv.kv_transfer.store.worker import StoreConnectorWorker
from tests.kv_transfer.store.conftest import backend_for, store_kv_config
from tests.kv_transfer.store.tp_ranks import (
    BLOCK_SIZE,
    full_caches,
    kv_cache_config,
    layouts,
    on_each_rank,
    rank_caches,
)

KEY = block_key("fp", 0, b"\x01" * 16)
TP_SIZES, HEAD_COUNTS = (1, 2, 4), (1, 2, 4, 8)


def rank_heads(num_kv_heads: int, tp_size: int) -> list[RankHeads]:
    return [RankHeads.of(tp, tp.kv_heads().size) for tp in layouts(num_kv_heads, tp_size)]


@pytest.mark.parametrize("num_kv_heads", HEAD_COUNTS)
@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_the_ranks_of_any_tp_size_write_each_head_exactly_once(tp_size, num_kv_heads) -> None:
    ranks = rank_heads(num_kv_heads, tp_size)
    written = Counter(key for heads in ranks for key in head_keys([KEY], heads.written))
    assert written == Counter(head_keys([KEY], range(num_kv_heads)))
    for heads in ranks:  # a rank writes all it holds, or (a replica) nothing
        assert heads.written in (heads.read, range(0))


@pytest.mark.parametrize("num_kv_heads", HEAD_COUNTS)
@pytest.mark.parametrize("reader_tp", TP_SIZES)
@pytest.mark.parametrize("writer_tp", TP_SIZES)
def test_readers_of_any_tp_size_find_every_head_writers_of_any_tp_size_wrote(
    writer_tp, reader_tp, num_kv_heads
) -> None:
    written = {k for heads in rank_heads(num_kv_heads, writer_tp) for k in heads_keys(heads, True)}
    read = [heads_keys(heads, False) for heads in rank_heads(num_kv_heads, reader_tp)]
    assert all(keys and set(keys) <= written for keys in read)
    assert {k for keys in read for k in keys} == written  # together the readers read all


def heads_keys(heads: RankHeads, writes: bool) -> list[str]:
    return head_keys([KEY], heads.written if writes else heads.read)


def test_a_rank_whose_cache_holds_other_heads_is_refused() -> None:
    with pytest.raises(ValueError, match="holds 2 of 4 KV heads, but its KV cache has 4"):
        RankHeads.of(TPLayout(0, 2, 4), 4)
    assert RankHeads.of(TPLayout(), 3).written == range(3)  # one rank: all its cache holds


def worker_half(store_url: str, role: str, tp: TPLayout, caches) -> StoreConnectorWorker:
    config = KVTransferConfig.from_dict(store_kv_config(store_url, role, load_mode="sync"))
    worker = StoreConnectorWorker(config, kv_cache_config(tp), "fp", tp)
    worker.register_kv_caches(caches, [0] * len(caches))
    return worker


def keys_of(blocks: range) -> list[str]:
    return [block_key("fp", 0, bytes([b]) * 16) for b in blocks]


def write(store_url: str, full: list[torch.Tensor], tp_size: int, blocks: range) -> None:
    """An instance of ``tp_size`` ranks stores ``blocks`` of ``full`` (its ranks' heads)."""
    num_kv_heads = full[0].shape[3]

    def rank_writes(rank: int) -> None:
        tp = TPLayout(rank, tp_size, num_kv_heads)
        worker = worker_half(store_url, "kv_producer", tp, rank_caches(full, tp))
        saves = [("w", BlockRef(0, b, key)) for b, key in zip(blocks, keys_of(blocks))]
        worker.bind_connector_metadata(StoreConnectorMetadata(saves=saves, flushes=["w"]))
        worker.start_load_kv()
        worker.wait_for_save()
        assert worker.writer is not None and worker.writer.wait_idle(10)
        assert worker.get_finished().finished_sending == {"w"}
        worker.shutdown()

    on_each_rank(rank_writes, tp_size)


def read(store_url: str, num_kv_heads: int, tp_size: int, blocks: range, into: int) -> list:
    """An instance of ``tp_size`` ranks loads ``blocks`` into blocks ``into...`` of zeroed
    caches: each rank's caches, and the block ids its load left invalid."""

    def rank_reads(rank: int) -> tuple[list[torch.Tensor], set[int]]:
        tp = TPLayout(rank, tp_size, num_kv_heads)
        caches = [torch.zeros_like(c) for c in rank_caches(full_caches(num_kv_heads, 0), tp)]
        worker = worker_half(store_url, "kv_consumer", tp, caches)
        refs = [BlockRef(0, into + i, key) for i, key in enumerate(keys_of(blocks))]
        worker.bind_connector_metadata(StoreConnectorMetadata(loads=[StoreLoad("r", refs, False)]))
        worker.start_load_kv()
        invalid = worker.get_finished().invalid_block_ids
        worker.shutdown()
        return caches, invalid

    return on_each_rank(rank_reads, tp_size)


def lookup(store_url: str, num_kv_heads: int, tp_size: int, num_blocks: int) -> int | None:
    """What the scheduler half of an instance of ``tp_size`` ranks finds stored of a request
    whose first ``num_blocks`` blocks are ``keys_of(range(1, ...))`` (in tokens)."""
    tp = TPLayout(0, tp_size, num_kv_heads)
    config = KVTransferConfig.from_dict(store_kv_config(store_url, "kv_consumer"))
    scheduler_half = StoreConnector(config, kv_cache_config(tp), "fp", tp)
    request = SimpleNamespace(
        request_id="q",
        num_tokens=(num_blocks + 1) * BLOCK_SIZE,
        num_prompt_tokens=(num_blocks + 1) * BLOCK_SIZE,
        block_hashes=[bytes([b]) * 16 for b in range(1, num_blocks + 1)],
        kv_transfer_params=None,
        sampling_params=SimpleNamespace(prompt_logprobs=None),
    )
    num_tokens, _ = scheduler_half.get_num_new_matched_tokens(request, 0)
    scheduler_half.shutdown()
    return num_tokens


@pytest.mark.parametrize(
    ("num_kv_heads", "writer_tp", "reader_tp"),
    [(4, 2, 1), (4, 1, 2), (4, 4, 2), (2, 4, 1), (2, 1, 4)],
)
@pytest.mark.parametrize("store_url", ["redis", "file"], indirect=True)
def test_a_reader_of_another_tp_size_loads_byte_identical_heads(
    store_url, num_kv_heads, writer_tp, reader_tp
) -> None:
    full = full_caches(num_kv_heads, seed=0)
    write(store_url, full, writer_tp, range(1, 6))
    assert lookup(store_url, num_kv_heads, reader_tp, 5) == 5 * BLOCK_SIZE
    for rank, (caches, invalid) in enumerate(
        read(store_url, num_kv_heads, reader_tp, range(1, 6), 6)
    ):
        assert not invalid
        heads = TPLayout(rank, reader_tp, num_kv_heads).kv_heads()
        for cache, want in zip(caches, full):
            assert torch.equal(cache[:, 6:11], want[:, 1:6, :, heads.start : heads.end])
            assert not cache[:, :6].any()  # nothing else written


@pytest.mark.parametrize("store_url", ["redis", "file"], indirect=True)
def test_a_block_missing_one_head_is_not_stored_for_any_tp_size(store_url) -> None:
    write(store_url, full_caches(4, seed=0), 2, range(1, 5))
    store = backend_for(store_url)
    store.delete_many([head_key(keys_of(range(3, 4))[0], 3)])  # rank 1's last head of block 3
    store.close()
    for tp_size in (1, 2, 4):
        assert lookup(store_url, 4, tp_size, 4) == 2 * BLOCK_SIZE  # blocks 1-2 only
    (_, rank0), (_, rank1) = read(store_url, 4, 2, range(1, 5), 6)
    assert not rank0 and rank1 == {8}  # block 3 loads into block 8: rank 1 misses a head
