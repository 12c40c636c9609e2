"""Fuzzed store values: whatever bytes sit under a key (truncated, bit-flipped, extended,
another key's value, random bytes), a load either lands the exact KV that was stored or
counts the block as invalid (a miss: recomputed) and leaves it untouched, whichever of its KV
heads' values are damaged. Never wrong KV, never an exception other than the codec's
CorruptValue."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.distributed.shard import SINGLE_LAYOUT
from pagedkv.kv_transfer.store.block_codec import CorruptValue, ValueBatch, decode_value
from pagedkv.kv_transfer.store.block_layout import GroupLayout
from pagedkv.kv_transfer.store.head_layout import HeadLayout
from pagedkv.kv_transfer.store.loader import BlockFetcher
from pagedkv.kv_transfer.store.metadata import BlockRef
from pagedkv.kv_transfer.store.rank_heads import RankHeads
from pagedkv.kv_transfer.store.recent_keys import RecentKeys
from pagedkv.kv_transfer.store.stats import StoreStats

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 8, 4, 2, 4
GROUP = GroupLayout(0, (0, 1), (2, BLOCK_SIZE, HEADS, HEAD_SIZE * 4))  # 2 fp32 layers
LAYOUT = HeadLayout(GROUP, RankHeads.of(SINGLE_LAYOUT, HEADS))
KEYS = [f"pagedkv:fp:g0:{i:032x}" for i in range(NUM_BLOCKS)]
#: One value per KV head of each block, block-major.
VALUE_KEYS = LAYOUT.write_keys(KEYS)


def stored_values(seed: int) -> tuple[list[torch.Tensor], list[bytes]]:
    """Source caches, and the sealed value of each KV head of their blocks under VALUE_KEYS."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE)
    src = [torch.randn(shape, generator=gen) for _ in range(2)]
    batch = ValueBatch(len(VALUE_KEYS), LAYOUT.payload_size)
    LAYOUT.pack(GROUP.snapshot(src, torch.arange(NUM_BLOCKS)), slice(None), batch.payloads)
    return src, [bytes(v) for v in batch.seal(VALUE_KEYS)]


SOURCE, VALUES = stored_values(seed=0)


@st.composite
def tampered(draw, value: bytes) -> bytes:
    how = draw(st.sampled_from(["truncate", "flip", "extend", "splice", "random", "other"]))
    if how == "truncate":
        return value[: draw(st.integers(0, len(value) - 1))]
    if how == "flip":
        at = draw(st.integers(0, len(value) - 1))
        return value[:at] + bytes([value[at] ^ draw(st.integers(1, 255))]) + value[at + 1 :]
    if how == "extend":
        return value + draw(st.binary(min_size=1, max_size=16))
    if how == "splice":
        at = draw(st.integers(0, len(value)))
        return value[:at] + draw(st.binary(min_size=1, max_size=16)) + value[at:]
    if how == "random":
        return draw(st.binary(max_size=len(value) + 16))
    return draw(st.sampled_from(VALUES))  # another key's (or, by chance, its own) value


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_tampered_value_is_corrupt_or_exactly_the_stored_payload(data) -> None:
    i = data.draw(st.integers(0, len(VALUE_KEYS) - 1))
    value = data.draw(tampered(VALUES[i]))
    original = VALUES[i][-LAYOUT.payload_size :]
    try:
        payload = decode_value(VALUE_KEYS[i], value, LAYOUT.payload_size)
    except CorruptValue:
        return
    # Accepted: only if the payload is the stored one (a change in header padding, say).
    assert bytes(payload) == original


class DictStore:
    """The backend calls the fetcher makes, over a dict. Like a zero-copy backend, it fetches
    into the fetcher's rows, and hands back as bytes a value longer than a row."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values
        self.deleted: list[str] = []

    def register_buffer(self, buffer) -> None:
        pass

    def get_into(self, keys: list[str], rows) -> list[memoryview | bytes | None]:
        fetched = []
        for key, row in zip(keys, rows):
            value = self.values.get(key)
            if value is not None and len(value) <= len(row):
                row[: len(value)] = np.frombuffer(value, dtype=np.uint8)
                value = memoryview(row)[: len(value)]
            fetched.append(value)
        return fetched

    def delete_many(self, keys: list[str]) -> None:
        self.deleted += keys
        for key in keys:
            self.values.pop(key, None)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_load_lands_exact_kv_or_reports_the_block_invalid_and_leaves_it(data) -> None:
    blocks = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=6,
                                unique=True))  # fmt: skip
    values = {}
    for v in [i * HEADS + head for i in blocks for head in range(HEADS)]:
        state = data.draw(st.sampled_from(["intact", "intact", "tampered", "missing"]))
        if state != "missing":
            values[VALUE_KEYS[v]] = (
                VALUES[v] if state == "intact" else data.draw(tampered(VALUES[v]))
            )
    dst = [torch.full_like(cache, 7.0) for cache in SOURCE]  # 7.0: "never written"
    stats = StoreStats()
    fetcher = BlockFetcher(DictStore(values), [LAYOUT], dst, stats, RecentKeys())
    # Block i of the source lands in block NUM_BLOCKS - 1 - i of the destination.
    refs = [BlockRef(0, NUM_BLOCKS - 1 - i, KEYS[i]) for i in blocks]
    invalid = fetcher.load(refs)
    for i in blocks:
        target = NUM_BLOCKS - 1 - i
        for s, d in zip(SOURCE, dst):
            if target in invalid:
                assert bool((d[:, target] == 7.0).all()), "an invalid block was written"
            else:
                assert torch.equal(d[:, target], s[:, i]), "wrong KV landed"
    assert stats.num_blocks_loaded + stats.num_load_invalid == len(blocks)
    untouched = [b for b in range(NUM_BLOCKS) if b not in {NUM_BLOCKS - 1 - i for i in blocks}]
    assert all(bool((d[:, untouched] == 7.0).all()) for d in dst)
