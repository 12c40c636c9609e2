"""Blocks from a paged cache to the store and back (writer, fetcher, layout), without engines."""

from __future__ import annotations

import pytest
import torch

from pagedkv.distributed.shard import SINGLE_LAYOUT
from pagedkv.kv_transfer.store.block_codec import decode_value, head_key
from pagedkv.kv_transfer.store.block_layout import GroupLayout
from pagedkv.kv_transfer.store.head_layout import HeadLayout
from pagedkv.kv_transfer.store.loader import BlockFetcher
from pagedkv.kv_transfer.store.metadata import BlockRef
from pagedkv.kv_transfer.store.rank_heads import RankHeads
from pagedkv.kv_transfer.store.recent_keys import RecentKeys
from pagedkv.kv_transfer.store.stats import StoreStats
from pagedkv.kv_transfer.store.writer import PUT_BATCH_BLOCKS, BlockWriter, PutJob
from tests.kv_transfer.store.conftest import backend_for

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 80, 4, 2, 8


def head_layout(group: GroupLayout) -> HeadLayout:
    """One rank holding every head."""
    return HeadLayout(group, RankHeads.of(SINGLE_LAYOUT, HEADS))


def caches(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_round_trip_through_the_store_bit_exactly(dtype, store_url) -> None:
    src, dst = caches(dtype, seed=1), caches(dtype, seed=2)
    element = torch.tensor([], dtype=dtype).element_size()
    group = GroupLayout(0, (0, 2), (2, BLOCK_SIZE, HEADS, HEAD_SIZE * element))
    layout = head_layout(group)
    backend = backend_for(store_url)
    stats, recent = StoreStats(), RecentKeys()
    writer = BlockWriter(backend, stats, recent, max_queued_bytes=1 << 30)
    try:
        n = PUT_BATCH_BLOCKS + 8  # two put batches
        src_ids = list(range(1, n + 1))
        keys = [f"blk{i}" for i in range(n)]
        # Every third block is already stored: only the others are written.
        first = [i for i in range(n) if i % 3 == 0]
        writer.store(
            PutJob(
                layout,
                [keys[i] for i in first],
                set(),
                group.snapshot(src, torch.tensor([src_ids[i] for i in first])),
            )
        )
        writer.store(PutJob(layout, keys, set(), group.snapshot(src, torch.tensor(src_ids))))
        assert stats.num_blocks_put == n and stats.num_puts_skipped_stored == len(first)
        (value,) = backend.get_many([head_key(keys[5], HEADS - 1)])
        decode_value(head_key(keys[5], HEADS - 1), value, layout.payload_size)

        fetcher = BlockFetcher(backend, [layout], dst, stats, recent)
        dst_ids = [NUM_BLOCKS - 1 - i for i in range(n)]  # other slots, reversed
        assert fetcher.load([BlockRef(0, b, k) for b, k in zip(dst_ids, keys)]) == set()
        for layer in (0, 2):
            assert torch.equal(dst[layer][:, dst_ids], src[layer][:, src_ids])
        assert not torch.equal(dst[1][:, dst_ids], src[1][:, src_ids])  # not in the group
        assert stats.num_blocks_loaded == n
    finally:
        writer.close()
        backend.close()


def test_missing_keys_come_back_invalid_and_the_rest_loads(store_url) -> None:
    src, dst = caches(torch.float32, seed=3), caches(torch.float32, seed=4)
    group = GroupLayout(0, (0, 1, 2), (2, BLOCK_SIZE, HEADS, HEAD_SIZE * 4))
    layout = head_layout(group)
    backend = backend_for(store_url)
    stats = StoreStats()
    writer = BlockWriter(backend, stats, RecentKeys(), max_queued_bytes=1 << 30)
    try:
        writer.store(PutJob(layout, ["a", "b"], set(), group.snapshot(src, torch.tensor([1, 2]))))
        fetcher = BlockFetcher(backend, [layout], dst, stats, RecentKeys())
        refs = [BlockRef(0, 10, "a"), BlockRef(0, 11, "gone"), BlockRef(0, 12, "b")]
        assert fetcher.load(refs) == {11}
        assert torch.equal(dst[0][:, [10, 12]], src[0][:, [1, 2]])
        assert stats.num_load_missing == 1
        assert fetcher.load(refs, is_cancelled=lambda: True) == {10, 11, 12}
        assert stats.num_load_cancelled == 3
    finally:
        writer.close()
        backend.close()
