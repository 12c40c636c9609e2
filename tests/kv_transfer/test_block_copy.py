"""The compiled whole-block copy (``kv_transfer/block_copy.py``, ``csrc/block_copy.cpp``)
against torch's indexing, its torch fallback, and D's segment plan cut at its block runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.kv_transfer import block_copy
from pagedkv.kv_transfer.p2p.transfer import (
    LayerBlocks,
    consecutive_start,
    gather_blocks,
    plan_segments,
    plan_segments_at_runs,
    runs,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.uint8)
#: Row shapes: tiny, odd byte counts, and rows past the kernel's streaming threshold (4 KiB)
#: whose sizes are not whole 64-byte lines (the aligned head and the tail are copied apart).
ROWS = ((1,), (3, 5), (2, 1, 7), (4, 2, 8), (3, 701), (16, 2, 64), (2, 4100))
#: The ``path`` fixture holds for the whole test (every example runs on the same path).
COPY = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch) -> str:
    """Each test runs on the compiled kernel and on the torch fallback (no library)."""
    if request.param == "kernel":
        if block_copy._loaded() is None:
            pytest.skip("the CPU kernels cannot be built here")
    else:
        monkeypatch.setattr(block_copy, "_kernel", None)
    return request.param


@st.composite
def cases(draw):
    """A cache ``[num_blocks, *row]`` of random values and distinct ids into it."""
    dtype = draw(st.sampled_from(DTYPES))
    row = draw(st.sampled_from(ROWS))
    num_blocks = draw(st.integers(1, 24))
    ids = draw(st.permutations(range(num_blocks)))
    ids = ids[: draw(st.integers(0, num_blocks))]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    cache = torch.randint(0, 256, (num_blocks, *row), dtype=torch.uint8, generator=gen)
    if dtype.is_floating_point:  # any bit pattern: a byte copy moves NaNs and infs alike
        size = torch.finfo(dtype).bits // 8
        cache = torch.randint(0, 256, (num_blocks, *row[:-1], row[-1] * size),
                              dtype=torch.uint8, generator=gen).view(dtype)  # fmt: skip
    return cache, torch.tensor(ids, dtype=torch.int64), draw(st.sampled_from([1, 2]))


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@COPY
@given(case=cases(), streaming=st.booleans())
def test_gather_and_scatter_match_torch_indexing(path: str, case, streaming: bool) -> None:
    cache, ids, threads = case
    out = torch.empty((len(ids), *cache.shape[1:]), dtype=cache.dtype)
    block_copy.gather(cache, ids, out, streaming, threads)
    assert _same_bytes(out, cache[ids])
    target = torch.zeros_like(cache)
    block_copy.scatter(target, ids, out, streaming, threads)
    expected = torch.zeros_like(cache)
    expected.view(torch.uint8).index_copy_(0, ids, out.view(torch.uint8))
    assert _same_bytes(target, expected)


@COPY
@given(case=cases())
def test_copies_into_views_at_any_offset(path: str, case) -> None:
    """Messages are views into a staging ring (uint8), at offsets that are not 64-aligned."""
    cache, ids, _ = case
    size = cache[0].numel() * cache.element_size() * len(ids)
    ring = torch.zeros(size + 64, dtype=torch.uint8)
    offset = cache.element_size()
    message = ring[offset : offset + size].view(cache.dtype).view(len(ids), *cache.shape[1:])
    block_copy.gather(cache, ids, message)
    assert _same_bytes(message, cache[ids]) and not ring[:offset].any()
    target = torch.zeros_like(cache)
    block_copy.scatter(target, ids, message)
    assert _same_bytes(target[ids], cache[ids])


def test_a_bad_id_raises_and_copies_nothing(path: str) -> None:
    cache = torch.arange(24.0).view(6, 4)
    out = torch.zeros(3, 4)
    for bad in ([0, 6, 1], [-1, 2, 3]):
        with pytest.raises(IndexError):
            block_copy.gather(cache, torch.tensor(bad), out)
        if path == "kernel":  # the kernel checks every id before a byte moves
            assert not out.any()
            target = torch.zeros(6, 4)
            with pytest.raises(IndexError):
                block_copy.scatter(target, torch.tensor(bad), torch.ones(3, 4))
            assert not target.any()


def test_tensors_the_kernel_does_not_take_are_copied_by_torch() -> None:
    """Not contiguous, or dtypes that differ: the torch ops run (same answer or their error)."""
    cache = torch.arange(2 * 6 * 4.0).view(2, 6, 4)
    strided = cache.transpose(0, 1)  # [6, 2, 4], not contiguous
    ids = torch.tensor([4, 0, 5])
    out = torch.empty(3, 2, 4)
    block_copy.gather(strided, ids, out)
    assert torch.equal(out, strided[ids])
    target = torch.zeros(6, 2, 4).transpose(0, 1).contiguous().transpose(0, 1)
    block_copy.scatter(target, ids, out)
    assert torch.equal(target[ids], out)
    with pytest.raises(RuntimeError):
        block_copy.gather(cache[0], ids, torch.empty(3, 4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_layer_blocks_round_trip_through_a_message(path: str, dtype: torch.dtype) -> None:
    """P packs a message by its ids, D scatters it by its own: D's blocks hold P's KV."""
    src = torch.randn(2, 40, 16, 2, 8).to(dtype)
    p_ids, d_ids = torch.randperm(40)[:12], torch.tensor([*range(20, 26), 3, 9, 11, 30, 31, 2])
    sender = LayerBlocks(src, p_ids, [5, 7])
    receiver = LayerBlocks(torch.zeros_like(src), d_ids, [5, 7])
    for kv, start, end in sender.messages():
        message = torch.empty(sender.shape(start, end), dtype=dtype)
        sender.gather(kv, start, end, message)
        receiver.scatter(kv, start, end, message)
    assert torch.equal(receiver.cache[:, d_ids], src[:, p_ids])
    assert torch.equal(gather_blocks(src, p_ids), src[:, p_ids])


def test_gather_blocks_copies_big_layers_on_several_threads(path: str) -> None:
    cache = torch.randn(2, 300, 16, 8, 128)  # 64 KiB per half block: 18 MiB per copy
    ids = torch.randperm(300)[:150]
    assert torch.equal(gather_blocks(cache, ids), cache[:, ids])


# ---------------------------------------------------------------------------- runs, D's plan
@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 11), min_size=1, max_size=12), data=st.data())
def test_a_message_is_a_slice_of_the_cache_exactly_when_its_ids_are_a_run(ids, data) -> None:
    cache = torch.arange(2 * 12.0).view(2, 12, 1)
    layer = LayerBlocks(cache, torch.tensor(ids), [len(ids)])
    for _ in range(4):  # several messages of one layer: its breaks are found once
        start = data.draw(st.integers(0, len(ids) - 1))
        end = data.draw(st.integers(start + 1, len(ids)))
        kv = data.draw(st.integers(0, 1))
        view = layer.run(kv, start, end)
        assert (view is None) == (consecutive_start(torch.tensor(ids[start:end])) is None)
        if view is not None:
            assert view.data_ptr() == cache[kv, ids[start]].data_ptr()
            assert torch.equal(view, cache[kv, ids[start:end]])


def test_runs_and_a_plan_cut_at_them() -> None:
    assert runs([]) == [] and runs([4, 5, 6, 9, 1, 2]) == [3, 1, 2]
    ids = [*range(10), 50, *range(52, 56), 60]
    assert plan_segments_at_runs(ids, 4, 3) == [4, 3, 3, 1, 4, 1]
    assert plan_segments_at_runs(list(range(100, 108)), 8, 2) == [8]


@settings(max_examples=300, deadline=None)
@given(
    run_lengths=st.lists(st.integers(1, 20), max_size=12),
    chunk=st.integers(1, 16),
    min_run=st.integers(1, 24),
)
def test_a_plan_cuts_long_runs_apart_and_packs_the_rest(run_lengths, chunk, min_run) -> None:
    ids, start = [], 1
    for length in run_lengths:  # runs separated by a gap: exactly these runs
        ids.extend(range(start, start + length))
        start += length + 1
    segments = plan_segments_at_runs(ids, chunk, min_run)
    assert sum(segments) == len(ids) and all(0 < n <= chunk for n in segments)
    cuts, position = {0}, 0
    for n in segments:
        position += n
        cuts.add(position)
    position = 0
    for length in run_lengths:  # a long run starts and ends at a cut: a message of its own
        if length >= min_run:
            assert {position, position + length} <= cuts
        position += length
    if min_run > max(run_lengths, default=0):  # no long run: the fixed chunks
        assert segments == plan_segments(len(ids), chunk)
