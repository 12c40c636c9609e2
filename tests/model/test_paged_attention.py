from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.attention import (
    AttentionMetadata,
    get_attention_backend,
    paged_attention,
    reshape_and_cache,
)
from pagedkv.attention.cpu_paged_attention import load_cpu_attention

NULL_BLOCK = 0


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_query: int, window: int | None
) -> torch.Tensor:
    """Reference for one request: q [n, Hq, D] at positions first_query…; k, v [seq, Hk, D]."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(first_query, first_query + q.shape[0])[:, None]
    key_pos = torch.arange(k.shape[0])[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def slots_of(block_row: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    return block_row[positions // block_size] * block_size + positions % block_size


def run_case(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    window: int | None,
    seed: int,
) -> AttentionMetadata:
    """requests: (num_computed_tokens, num_scheduled_tokens) per request, in batch order."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in requests) + 2
    num_blocks = 1 + sum(math.ceil((c + n) / block_size) for c, n in requests) + 5
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    kv_cache[:, NULL_BLOCK] = float("nan")

    free_blocks = list(rng.permutation(np.arange(1, num_blocks)))
    block_table = np.zeros((len(requests), max_blocks), dtype=np.int32)
    dense_k, dense_v, queries, prefix_slots, new_slots = [], [], [], [], []
    for row, (computed, scheduled) in enumerate(requests):
        seq_len = computed + scheduled
        needed = math.ceil(seq_len / block_size)
        block_table[row, :needed] = [free_blocks.pop() for _ in range(needed)]
        # Stale entries past the request's blocks must never be read either.
        block_table[row, needed:] = NULL_BLOCK
        if window is not None:
            first_visible = max(computed - window + 1, 0)
            block_table[row, : first_visible // block_size] = NULL_BLOCK
        else:
            first_visible = 0
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        dense_k.append(k)
        dense_v.append(v)
        queries.append(torch.randn(scheduled, num_heads, head_size, generator=gen))
        # The prefix was written by earlier steps; positions that left the window were freed.
        kept = np.arange(first_visible // block_size * block_size, computed)
        prefix_slots.append((row, kept, slots_of(block_table[row], kept, block_size)))
        new_slots.append(slots_of(block_table[row], np.arange(computed, seq_len), block_size))

    for row, kept, slots in prefix_slots:
        reshape_and_cache(dense_k[row][kept], dense_v[row][kept], kv_cache, torch.from_numpy(slots))
    query_lens = [n for _, n in requests]
    metadata = AttentionMetadata.from_numpy(
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]),
        seq_lens=np.array([c + n for c, n in requests]),
        block_table=block_table,
        slot_mapping=np.concatenate(new_slots),
        block_size=block_size,
        sliding_window=window,
    )
    step_k = torch.cat([k[c:] for k, (c, _) in zip(dense_k, requests, strict=True)])
    step_v = torch.cat([v[c:] for v, (c, _) in zip(dense_v, requests, strict=True)])
    reshape_and_cache(step_k, step_v, kv_cache, metadata.slot_mapping)

    scale = 1 / math.sqrt(head_size)
    out = paged_attention(torch.cat(queries), kv_cache, metadata, scale)
    expected = torch.cat(
        [
            dense_attention(q, k, v, computed, window)
            for q, k, v, (computed, _) in zip(queries, dense_k, dense_v, requests, strict=True)
        ]
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)

    backend = get_attention_backend("torch")
    for _ in range(2):  # the second call reuses the backend's gather buffer
        torch.testing.assert_close(
            backend.forward(torch.cat(queries), kv_cache, metadata, scale), out
        )
    # The compiled decode kernel: same answers, reading the cache in place (never the NaN null
    # block nor stale table entries).
    backend.load_kernels(torch.device("cpu"))
    kernel_out = backend.forward(torch.cat(queries), kv_cache, metadata, scale)
    assert not kernel_out.isnan().any()
    torch.testing.assert_close(kernel_out, expected, atol=2e-5, rtol=1e-4)
    return metadata


def test_the_kernels_build_here() -> None:
    """The machine has a C++ compiler (as inductor needs): the kernels must build, not fall
    back."""
    assert load_cpu_attention() is not None


def test_a_missing_compiler_falls_back_with_a_warning(tmp_path, caplog) -> None:
    """No library cached and no compiler: the engine still starts, on the gather + SDPA path,
    and says why. A second start with a compiler builds into the same cache (a temporary file
    renamed into place: nothing half-written is ever left under the library's name)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": "/nonexistent/c++"}
    code = (
        "import logging; logging.basicConfig()\n"
        "from pagedkv.attention.cpu_paged_attention import load_cpu_attention\n"
        "print(load_cpu_attention() is None)"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.strip() == "True", run.stderr
    assert "could not be built or loaded" in run.stderr and "/nonexistent/c++" in run.stderr
    del env["CXX"]
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.strip() == "False", run.stderr
    assert [p.suffix for p in (tmp_path / "pagedkv").iterdir()] == [".so"]


def test_the_kernel_refuses_mismatched_inputs() -> None:
    """The C side trusts shapes and dtypes: the wrapper checks them before a pointer crosses."""
    kernels = load_cpu_attention()
    assert kernels is not None
    kernel = kernels.decode
    kv_cache = torch.zeros(2, 4, 16, 2, 8)
    query, out = torch.zeros(1, 4, 8), torch.zeros(1, 4, 8)
    index = torch.zeros(1, dtype=torch.int64)
    ints = torch.ones(1, dtype=torch.int32)
    table = torch.ones(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        kernel(out, query, kv_cache, index, table.long(), ints, ints * 0, 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        kernel(out, query.bfloat16(), kv_cache, index, table, ints, ints * 0, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(out, query.transpose(1, 2), kv_cache, index, table, ints, ints * 0, 1.0)
    with pytest.raises(ValueError, match="one table row"):
        kernel(out, query, kv_cache, index, table.repeat(2, 1), ints, ints * 0, 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [16, 32, 128])
@pytest.mark.parametrize("num_decodes", [3, 24])
def test_decode_kernel_16_bit_cache(dtype: torch.dtype, head_size: int, num_decodes: int) -> None:
    """bf16 / fp16 caches: the kernel accumulates in fp32, like SDPA over the gathered copy
    (head sizes 32 and 128 take the one-pass AVX-512 kernel where the CPU has it, 16 the generic
    one; with 24 decodes a work item is a whole request)."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = np.random.default_rng(head_size).integers(1, 80, num_decodes).astype(np.int32)
    block_size, num_kv_heads, num_heads = 16, 2, 4
    max_blocks = math.ceil(int(seq_lens.max()) / block_size)
    num_blocks = 1 + int(sum(math.ceil(n / block_size) for n in seq_lens))
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    kv_cache = kv_cache.to(dtype)
    block_table = np.zeros((num_decodes, max_blocks), dtype=np.int32)
    next_block = 1
    for row, n in enumerate(seq_lens):
        for b in range(math.ceil(n / block_size)):
            block_table[row, b] = next_block
            next_block += 1
    metadata = AttentionMetadata.from_numpy(
        np.arange(num_decodes + 1),
        seq_lens,
        block_table,
        np.zeros(num_decodes, dtype=np.int64),
        block_size,
    )
    query = torch.randn(num_decodes, num_heads, head_size, generator=gen).to(dtype)
    kernels = load_cpu_attention()
    assert kernels is not None
    out = paged_attention(query, kv_cache, metadata, 0.2, kernels=kernels)
    expected = paged_attention(query.float(), kv_cache.float(), metadata, 0.2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


MIXED = [(37, 1), (0, 23), (45, 19), (130, 1), (0, 1), (3, 1), (64, 40), (1, 1)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 5, 16, 40, 1000])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_mixed_batch_matches_dense(
    block_size: int, window: int | None, heads: tuple[int, int]
) -> None:
    order = np.random.default_rng(block_size).permutation(len(MIXED))
    run_case([MIXED[i] for i in order], *heads, 32, block_size, window, seed=block_size)


@pytest.mark.parametrize("window", [None, 7, 100])
def test_decode_only_batch(window: int | None) -> None:
    rng = np.random.default_rng(0)
    requests = [(int(c), 1) for c in rng.integers(1, 300, size=24)]
    metadata = run_case(requests, 8, 4, 16, 16, window, seed=1)
    buckets = metadata.decode_buckets
    assert len(buckets) > 1  # contexts 1…300 do not share one padded call
    assert sorted(torch.cat([b.token_indices for b in buckets]).tolist()) == list(range(24))


@pytest.mark.parametrize("head_size", [16, 32, 64, 128])
@pytest.mark.parametrize("num_decodes", [3, 24])
@pytest.mark.parametrize(("heads", "block_size", "window"), [
    ((8, 8), 16, None), ((8, 2), 32, 50), ((6, 2), 8, None), ((32, 1), 16, 20), ((40, 1), 16, None),
    ((8, 2), 1, None), ((8, 4), 128, 70),
])  # fmt: skip
def test_decode_kernel_every_work_split(
    head_size: int,
    num_decodes: int,
    heads: tuple[int, int],
    block_size: int,
    window: int | None,
) -> None:
    """fp32 head sizes 32, 64 and 128 take the one-pass AVX-512 kernel where the CPU has it,
    others the generic one. With many decodes a work item is a whole request, with few a
    (request, KV head); blocks of 1 to 128 keys, smaller and larger than its chunk of 16; 1 to
    32 query heads per KV head (40: the generic kernel)."""
    rng = np.random.default_rng(head_size + num_decodes)
    requests = [(int(c), 1) for c in rng.integers(1, 300, size=num_decodes)]
    run_case(requests, *heads, head_size, block_size, window, seed=head_size)


PREFILLS = [(0, 300), (37, 45), (0, 2), (130, 17), (5, 1), (0, 16), (16, 33)]


@pytest.mark.parametrize("head_size", [16, 32, 64, 128])
@pytest.mark.parametrize(("heads", "block_size", "window"), [
    ((8, 8), 16, None), ((8, 2), 32, 50), ((6, 2), 8, None), ((32, 1), 16, 20), ((40, 1), 16, None),
    ((8, 2), 1, None), ((8, 4), 128, 70), ((4, 1), 16, 1),
])  # fmt: skip
def test_prefill_kernel_every_work_split(
    head_size: int, heads: tuple[int, int], block_size: int, window: int | None
) -> None:
    """The prefill kernel (fp32 head sizes 32, 64 and 128 on AVX-512; SDPA for the others and
    for 40 query heads per KV head): a 300-token prompt split into several work items, chunks
    after a prefix-cache hit, chunks of 2 tokens and of exactly one key group, a decode beside
    them; blocks of 1 to 128 keys; windows that cut a block, a key group, or all but one key."""
    run_case(PREFILLS, *heads, head_size, block_size, window, seed=head_size)


def test_prefill_kernel_takes_the_shapes_it_has_code_for() -> None:
    """It writes nothing and says False where it has no code (then SDPA runs): head sizes other
    than 32, 64 and 128, more than 32 query heads per KV head, a CPU without AVX-512."""
    kernels = load_cpu_attention()
    assert kernels is not None
    has_avx512 = "avx512f" in Path("/proc/cpuinfo").read_text().split()
    ints = torch.tensor([0], dtype=torch.int32)
    table = torch.ones(1, 1, dtype=torch.int32)
    for head_size, num_heads, expected in [(32, 8, True), (128, 32, True), (16, 8, False),
                                           (64, 33, False)]:  # fmt: skip
        kv_cache = torch.ones(2, 2, 16, 1, head_size)
        query = torch.ones(4, num_heads, head_size)
        out = torch.zeros_like(query)
        lens = torch.tensor([4], dtype=torch.int32)
        handled = kernels.prefill(out, query, kv_cache, ints, lens, lens, table, 1.0, None)
        assert handled == (expected and has_avx512)
        assert out.eq(1 if handled else 0).all()
    with pytest.raises(ValueError, match="sliding_window"):
        kernels.prefill(out, query, kv_cache, ints, lens, lens, table, 1.0, 0)
    with pytest.raises(ValueError, match="int32"):
        kernels.prefill(out, query, kv_cache, ints.long(), lens, lens, table, 1.0, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_kernel_16_bit_cache(dtype: torch.dtype) -> None:
    """bf16 / fp16: widened as loaded, accumulated in fp32, like the fp32 path on the same
    values."""
    gen = torch.Generator().manual_seed(4)
    block_size, num_kv_heads, num_heads, head_size = 16, 2, 4, 64
    requests = [(0, 90), (20, 30), (0, 1)]
    seq_lens = np.array([c + n for c, n in requests], dtype=np.int32)
    num_blocks = 1 + sum(math.ceil(n / block_size) for n in seq_lens)
    block_table = np.zeros((len(requests), math.ceil(seq_lens.max() / block_size)), np.int32)
    next_block = 1
    for row, n in enumerate(seq_lens):
        for b in range(math.ceil(n / block_size)):
            block_table[row, b], next_block = next_block, next_block + 1
    query_lens = [n for _, n in requests]
    metadata = AttentionMetadata.from_numpy(
        np.concatenate([[0], np.cumsum(query_lens)]),
        seq_lens,
        block_table,
        np.zeros(sum(query_lens), dtype=np.int64),
        block_size,
    )
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    kv_cache = kv_cache.to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen).to(dtype)
    out = paged_attention(query, kv_cache, metadata, 0.2, kernels=load_cpu_attention())
    expected = paged_attention(query.float(), kv_cache.float(), metadata, 0.2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("window", [None, 9])
def test_single_prefill_from_zero(window: int | None) -> None:
    run_case([(0, 77)], 6, 2, 16, 16, window, seed=2)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    num_kv_heads = int(rng.choice([1, 2, 4]))
    num_heads = num_kv_heads * int(rng.choice([1, 2, 3]))
    requests = [
        (int(rng.integers(0, 200)), int(rng.choice([1, 1, rng.integers(2, 60)])))
        for _ in range(int(rng.integers(1, 10)))
    ]
    window = [None, int(rng.integers(1, 120))][seed % 2]
    run_case(requests, num_heads, num_kv_heads, 8 * int(rng.integers(1, 5)), 16, window, seed)


def test_reshape_and_cache_writes_exact_slots() -> None:
    kv_cache = torch.zeros(2, 4, 8, 2, 3)
    key = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3) + 1
    value = -key
    reshape_and_cache(key, value, kv_cache, torch.tensor([13, 30]))
    torch.testing.assert_close(kv_cache[0, 1, 5], key[0])
    torch.testing.assert_close(kv_cache[1, 3, 6], value[1])
    assert kv_cache.count_nonzero() == 2 * key.numel()


def test_unknown_backend_lists_available() -> None:
    with pytest.raises(ValueError, match=r"'triton-nope'.*available: torch"):
        get_attention_backend("triton-nope")
