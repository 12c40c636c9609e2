"""The Triton kernels against the torch reference.

By default they run on CPU under ``TRITON_INTERPRET=1`` (set in this directory's conftest before
the kernels are imported); with ``TRITON_INTERPRET=0`` they run on the CUDA device. Caveat: the
interpreter multiplies bf16 operands in fp32 after exact widening (see ``_dot``), so the bf16
tensor-core path itself is exercised only on a GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from pagedkv.attention import (  # noqa: E402
    AttentionMetadata,
    get_attention_backend,
    paged_attention,
    reshape_and_cache,
)
from pagedkv.attention import triton_paged_attention as tpa  # noqa: E402
from pagedkv.attention import triton_reshape_and_cache as trc  # noqa: E402

INTERPRETED = trc.INTERPRETED
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")

NULL_BLOCK = 0
# Max abs error against the fp32 reference: fp32 is tight; fp16/bf16 round q, k, v, the
# softmax weights and the output.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


class Case(NamedTuple):
    query: torch.Tensor
    kv_cache: torch.Tensor  # NaN everywhere except the slots holding the requests' keys
    metadata: AttentionMetadata
    written_slots: np.ndarray  # the slots holding keys, so the only ones a kernel may read


def make_case(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    window: int | None,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """requests: ``(num_computed_tokens, num_scheduled_tokens)`` per request, in batch order.

    Blocks are handed out from a shuffled pool, so block tables are not contiguous. The null
    block stands for every block left of the window of the request's first query, and fills
    table entries past the request's last block. Every slot that holds no key is NaN: the null
    block, the tail of each partial last block and all free blocks.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_blocks = 1 + sum(math.ceil((c + n) / block_size) for c, n in requests) + 3
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"))
    free_blocks = list(rng.permutation(np.arange(1, num_blocks)))
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in requests) + 2
    block_table = np.full((len(requests), max_blocks), NULL_BLOCK, dtype=np.int32)
    written, new_slots = [], []
    for row, (computed, scheduled) in enumerate(requests):
        seq_len = computed + scheduled
        needed = math.ceil(seq_len / block_size)
        block_table[row, :needed] = [free_blocks.pop() for _ in range(needed)]
        first_key = 0 if window is None else max(computed - window + 1, 0)
        block_table[row, : first_key // block_size] = NULL_BLOCK
        # The window's first block keeps its keys left of the window too.
        positions = np.arange(first_key // block_size * block_size, seq_len)
        slots = block_table[row, positions // block_size] * block_size + positions % block_size
        written.append(slots)
        new_slots.append(slots[len(slots) - scheduled :])
    slots = np.concatenate(written)
    key = torch.randn(len(slots), num_kv_heads, head_size, generator=gen)
    reshape_and_cache(key, torch.randn(key.shape, generator=gen), kv_cache, torch.from_numpy(slots))
    query_lens = [n for _, n in requests]
    metadata = AttentionMetadata.from_numpy(
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]),
        seq_lens=np.array([c + n for c, n in requests]),
        block_table=block_table,
        slot_mapping=np.concatenate(new_slots),
        block_size=block_size,
        sliding_window=window,
        device=DEVICE,
    )
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen)
    return Case(query.to(DEVICE, dtype), kv_cache.to(DEVICE, dtype), metadata, slots)


def reference(case: Case) -> torch.Tensor:
    """The torch reference in fp32 over the same cache, its NaN (never visible) zeroed: SDPA
    multiplies masked values by zero weights, so NaN there would poison the reference."""
    kv_cache = torch.nan_to_num(case.kv_cache.float(), nan=0.0)
    scale = 1 / math.sqrt(case.query.shape[-1])
    return paged_attention(case.query.float(), kv_cache, case.metadata, scale)


def check(case: Case, num_kv_splits: int | None = 1) -> float:
    """Run the kernel, compare with the reference, return the max abs error."""
    scale = 1 / math.sqrt(case.query.shape[-1])
    out = tpa.triton_paged_attention(case.query, case.kv_cache, case.metadata, scale, num_kv_splits)
    assert out.dtype == case.query.dtype and not out.isnan().any()
    expected = reference(case)
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[case.query.dtype])
    return (out.float() - expected).abs().max().item()


# Decodes, prefill chunks from position 0 and after a prefix hit, lengths on and off block
# boundaries; (20, 70) and (64, 40) span several query tiles.
MIXED = [(37, 1), (0, 23), (45, 19), (130, 1), (0, 1), (3, 1), (64, 40), (1, 1), (20, 70)]


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("window", [None, 5, 40, 1000])
@pytest.mark.parametrize("queries_per_kv", [1, 2, 4])
def test_mixed_batch_fp32(block_size: int, window: int | None, queries_per_kv: int) -> None:
    order = np.random.default_rng(block_size + queries_per_kv).permutation(len(MIXED))
    requests = [MIXED[i] for i in order]
    check(make_case(requests, 2 * queries_per_kv, 2, 32, block_size, window, seed=block_size))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("window", "queries_per_kv"), [(None, 4), (24, 2), (7, 1)])
def test_mixed_batch_low_precision(
    dtype: torch.dtype, window: int | None, queries_per_kv: int
) -> None:
    check(make_case(MIXED, 2 * queries_per_kv, 2, 64, 16, window, seed=3, dtype=dtype))


@pytest.mark.parametrize("head_size", [64, 128])
def test_model_head_sizes(head_size: int) -> None:
    requests = [(50, 1), (0, 20), (31, 9), (200, 1)]
    check(make_case(requests, 8, 2, head_size, 16, None, seed=4, dtype=torch.bfloat16))


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    num_kv_heads = int(rng.choice([1, 2, 4]))
    num_heads = num_kv_heads * int(rng.choice([1, 2, 3, 4]))
    requests = [
        (int(rng.integers(0, 150)), int(rng.choice([1, 1, rng.integers(2, 40)])))
        for _ in range(int(rng.integers(1, 7)))
    ]
    head_size = int(rng.choice([8, 16, 24, 32]))
    block_size = int(rng.choice([16, 32, 64]))
    window = [None, int(rng.integers(1, 100))][seed % 2]
    dtype = [torch.float32, torch.float16, torch.bfloat16][seed % 3]
    check(make_case(requests, num_heads, num_kv_heads, head_size, block_size, window, seed, dtype))


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("num_kv_splits", [2, 8])
def test_kv_splits_for_long_decodes(window: int | None, num_kv_splits: int) -> None:
    # Some splits of the short requests get no keys at all and must drop out of the reduction.
    requests = [(700, 1), (16, 1), (300, 1), (0, 1)]
    check(make_case(requests, 4, 1, 32, 16, window, seed=5), num_kv_splits)


def test_kv_splits_with_prefill_chunks() -> None:
    requests = [(0, 20), (90, 1), (40, 24)]
    check(make_case(requests, 4, 2, 16, 16, 30, seed=6), num_kv_splits=4)


@pytest.mark.parametrize(
    ("num_programs", "max_seq_len", "expected"),
    [
        (8, 32768, 32),  # one decode, 8 KV heads, 132 SMs: split to fill the GPU
        (8, 1024, 2),  # ... but never below _MIN_KEYS_PER_SPLIT keys per split
        (8, 1 << 20, 32),  # 2 * 132 / 8 = 33 wanted: rounded down to a power of two
        (1, 1 << 20, 64),  # capped at _MAX_KV_SPLITS
        (2048, 32768, 1),  # 256 decodes fill the GPU alone
    ],
)
def test_split_heuristic(num_programs: int, max_seq_len: int, expected: int) -> None:
    assert tpa.default_num_kv_splits(num_programs, max_seq_len, num_sms=132) == expected


@pytest.mark.skipif(not INTERPRETED, reason="spies on the interpreter's loads")
@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_reads_only_slots_holding_keys(monkeypatch: pytest.MonkeyPatch, num_kv_splits: int) -> None:
    """Record every address the kernel loads: within the cache, only slots holding keys of the
    requests, never the null block, a free block or the tail of a partial last block."""
    from triton.runtime import interpreter

    reads: list[np.ndarray] = []
    load = interpreter.InterpreterBuilder.create_masked_load

    def spy(
        self: interpreter.InterpreterBuilder,
        ptrs: interpreter.TensorHandle,
        mask: interpreter.TensorHandle,
        *args: object,
    ) -> interpreter.TensorHandle:
        reads.append(ptrs.data[mask.data])
        return load(self, ptrs, mask, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", spy)
    case = make_case(MIXED, 4, 2, 16, 16, 9, seed=7)
    check(case, num_kv_splits)

    addresses = np.concatenate(reads).astype(np.int64)
    cache = case.kv_cache
    offsets = (addresses - cache.data_ptr()) // cache.element_size()
    offsets = offsets[(offsets >= 0) & (offsets < cache.numel())]
    num_slots = cache.shape[1] * cache.shape[2]
    slots_read = np.unique(offsets // cache[0, 0, 0].numel() % num_slots)
    assert len(offsets) > 0
    assert set(slots_read) <= set(case.written_slots)
    assert NULL_BLOCK not in set(slots_read // cache.shape[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache_matches_reference(dtype: torch.dtype) -> None:
    num_blocks, block_size, num_kv_heads, head_size = 6, 16, 3, 24
    gen = torch.Generator().manual_seed(8)
    # Key and value are column slices of one projection output, as in the model.
    qkv = torch.randn(40, 3 * num_kv_heads * head_size, generator=gen).to(DEVICE, dtype)
    key, value = qkv[:, num_kv_heads * head_size :].view(40, 2, num_kv_heads, head_size).unbind(1)
    slot_mapping = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:40] + block_size
    slot_mapping = slot_mapping.to(DEVICE)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    kv_cache = kv_cache.to(DEVICE)
    expected = kv_cache.clone()
    reshape_and_cache(key, value, expected, slot_mapping)
    trc.triton_reshape_and_cache(key, value, kv_cache, slot_mapping)
    assert torch.equal(kv_cache, expected)
    assert kv_cache[:, NULL_BLOCK].count_nonzero() == 0


def test_backend_is_registered_and_matches_the_functions() -> None:
    backend = get_attention_backend("triton")
    assert backend.name == "triton"
    case = make_case([(10, 1), (0, 5)], 4, 2, 16, 16, None, seed=9)
    scale = 1 / math.sqrt(16)
    torch.testing.assert_close(
        backend.forward(case.query, case.kv_cache, case.metadata, scale),
        tpa.triton_paged_attention(case.query, case.kv_cache, case.metadata, scale),
    )
    key = value = torch.ones(3, 2, 16, device=DEVICE)
    backend.reshape_and_cache(key, value, case.kv_cache, torch.tensor([0, 1, 2], device=DEVICE))
    assert case.kv_cache[:, NULL_BLOCK, :3].eq(1).all()


# Runs without the interpreter: the kernels are then real JIT functions. The launch functions
# run on meta tensors with the kernels swapped for recorders, and every recorded launch (its
# exact arguments and constexprs) is compiled for sm_90 down to a cubin; no GPU is needed.
_COMPILE_LAUNCHES_FOR_SM90 = """
import numpy as np, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedkv.attention import AttentionMetadata
from pagedkv.attention import triton_paged_attention as tpa
from pagedkv.attention import triton_reshape_and_cache as trc

launches = []

class Recorder:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, **constexprs):
            launches.append((self.fn, args, constexprs, num_warps))
        return launch

for module, name in ((tpa, "_paged_attention_kernel"), (tpa, "_reduce_kv_splits_kernel"),
                     (trc, "_reshape_and_cache_kernel")):
    setattr(module, name, Recorder(getattr(module, name)))

TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
         torch.int32: "*i32", torch.int64: "*i64"}

def type_of(arg):
    if isinstance(arg, torch.Tensor):
        return TYPES[arg.dtype]
    return "fp32" if isinstance(arg, float) else "i32"

for dtype, head_size, window, splits, query_lens in [
    (torch.bfloat16, 128, None, 8, [1] * 6),
    (torch.float16, 128, 4096, 1, [1, 70, 1]),
    (torch.float32, 64, None, 1, [1, 70, 1]),
]:
    kv_cache = torch.empty(2, 64, 16, 8, head_size, dtype=dtype, device="meta")
    query = torch.empty(sum(query_lens), 32, head_size, dtype=dtype, device="meta")
    metadata = AttentionMetadata.from_numpy(
        query_start_loc=np.cumsum([0] + query_lens),
        seq_lens=np.full(len(query_lens), 100),
        block_table=np.arange(7 * len(query_lens)).reshape(len(query_lens), 7),
        slot_mapping=np.arange(sum(query_lens)),
        block_size=16,
        sliding_window=window,
        device="meta",
    )
    tpa.triton_paged_attention(query, kv_cache, metadata, 0.1, num_kv_splits=splits)
    trc.triton_reshape_and_cache(query[:, :8], query[:, 8:16], kv_cache, metadata.slot_mapping)

for fn, args, constexprs, num_warps in launches:
    signature = {name: type_of(arg) for name, arg in zip(fn.arg_names, args)}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    assert kernel.asm["cubin"], fn.__name__
print(len(launches), "launches compiled")
"""


def test_launches_compile_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_LAUNCHES_FOR_SM90],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "7 launches compiled" in result.stdout
