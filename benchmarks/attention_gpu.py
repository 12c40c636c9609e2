"""Decode attention on a GPU: the Triton paged kernel against SDPA over a gathered dense copy.

Workload: one query per request (decode), 32 query heads over 8 KV heads, head size 128, bf16,
block size 16, block tables drawn from a shuffled pool (seeded); batch 1-256 x context 1k-32k,
every request of a point at the same context length.

Peer: the K/V blocks gathered through the block table into a dense tensor, then
``scaled_dot_product_attention`` (query heads sharing a KV head ride as extra query rows, so
K/V are not repeated). Reported both as attention only and as gather + attention.

Each method is captured in a CUDA graph (no Python launch overhead) and timed with CUDA
events, L2 flushed before each run; the figure is the median of the repeats. Bandwidth counts
the bytes a decode must move: K and V of every context plus q and out.

    python benchmarks/attention_gpu.py           # the full sweep, sized for < 5 min on an H200
    python benchmarks/attention_gpu.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from pagedkv.attention import AttentionMetadata  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCH_SIZES = [1, 4, 16, 64, 256]
CONTEXT_LENS = [1024, 4096, 16384, 32768]
QUICK_BATCH_SIZES = [1, 32]
QUICK_CONTEXT_LENS = [2048, 8192]
# Peak HBM bandwidth by a substring of torch.cuda.get_device_name() (the H100 SXM calls itself
# "H100 80GB HBM3").
PEAK_GBPS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB": 2039.0,
}
L2_FLUSH_BYTES = 256 << 20
# Triton against SDPA, both bf16 with fp32 accumulation: outputs of magnitude ~1 differ by a
# few bf16 ulps at most.
MAX_BF16_ERROR = 3e-2


def peak_gbps(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_GBPS.items() if key in device_name), None)


def median_ms(fn: Callable[[], object], warmup: int, repeats: int, flush: torch.Tensor) -> float:
    """Median time of one call of ``fn``, replayed from a CUDA graph, L2 flushed before each."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the Triton kernels, warms allocators
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def build_point(
    batch: int,
    context: int,
    kv_cache: torch.Tensor,
    dense_storage: torch.Tensor,
    tpa: ModuleType,
) -> dict[str, Callable[[], torch.Tensor | None]]:
    """The three timed calls of one point: ``triton``, ``sdpa`` (over the dense copy that
    ``gather`` fills) and ``gather_sdpa``; each attention returns ``[batch, heads, head]``."""
    device = kv_cache.device
    num_cache_blocks = kv_cache.shape[1]
    blocks_per_req = context // BLOCK_SIZE
    rng = np.random.default_rng(batch * 100_003 + context)
    block_ids = rng.permutation(np.arange(1, num_cache_blocks))[: batch * blocks_per_req]
    block_table = block_ids.reshape(batch, blocks_per_req)
    metadata = AttentionMetadata.from_numpy(
        query_start_loc=np.arange(batch + 1),
        seq_lens=np.full(batch, context),
        block_table=block_table,
        slot_mapping=block_table[:, -1] * BLOCK_SIZE + BLOCK_SIZE - 1,
        block_size=BLOCK_SIZE,
        device=device,
    )
    query = torch.randn(batch, NUM_HEADS, HEAD_SIZE, dtype=DTYPE, device=device)
    scale = HEAD_SIZE**-0.5

    # The peer's dense copy: [2, batch * blocks_per_req, block_size * kv_heads * head_size].
    gather_ids = torch.from_numpy(block_ids).to(device)
    dense = dense_storage[: 2 * batch * context * NUM_KV_HEADS * HEAD_SIZE].view(
        2, batch * blocks_per_req, -1
    )
    cache_rows = kv_cache.view(2, num_cache_blocks, -1)
    dense_kv = dense.view(2, batch, context, NUM_KV_HEADS, HEAD_SIZE).transpose(2, 3)
    dense_query = query.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_SIZE)

    def gather() -> None:
        torch.index_select(cache_rows, 1, gather_ids, out=dense)

    def sdpa() -> torch.Tensor:
        out = F.scaled_dot_product_attention(dense_query, dense_kv[0], dense_kv[1], scale=scale)
        return out.view(query.shape)

    def gather_sdpa() -> torch.Tensor:
        gather()
        return sdpa()

    def triton() -> torch.Tensor:
        return tpa.triton_paged_attention(query, kv_cache, metadata, scale)

    return {"gather": gather, "triton": triton, "sdpa": sdpa, "gather_sdpa": gather_sdpa}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 batch sizes x 2 context lengths")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--context-lens", type=int, nargs="+", default=None)
    parser.add_argument("--peak-gbps", type=float, default=None, help="the GPU's peak HBM GB/s")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_gpu.py needs a CUDA device; torch.cuda.is_available() is False.")
    try:
        from pagedkv.attention import triton_paged_attention as tpa
    except ModuleNotFoundError as e:
        sys.exit(f"attention_gpu.py needs triton ({e}): pip install 'pagedkv[gpu]'")
    if tpa._INTERPRETED:
        sys.exit("TRITON_INTERPRET is set: unset it to time the compiled kernels.")

    batch_sizes = args.batch_sizes or (QUICK_BATCH_SIZES if args.quick else BATCH_SIZES)
    context_lens = args.context_lens or (QUICK_CONTEXT_LENS if args.quick else CONTEXT_LENS)
    if any(c % BLOCK_SIZE for c in context_lens):
        sys.exit(f"context lengths must be multiples of the block size {BLOCK_SIZE}")
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_gbps or peak_gbps(name)
    peak_source = "--peak-gbps" if args.peak_gbps else "table" if peak else "unknown"

    # One cache (and one dense buffer for the peer) sized for the largest point that fits.
    token_bytes = 2 * NUM_KV_HEADS * HEAD_SIZE * DTYPE.itemsize
    free_bytes = torch.cuda.mem_get_info(device)[0] - L2_FLUSH_BYTES - (2 << 30)
    max_tokens = free_bytes // (2 * token_bytes)
    points = [(b, c) for b in batch_sizes for c in context_lens]
    too_big = [p for p in points if p[0] * p[1] > max_tokens]
    points = [p for p in points if p not in too_big]
    if not points:
        sys.exit("no point fits in the free GPU memory")
    num_blocks = 1 + max(b * c for b, c in points) // BLOCK_SIZE
    kv_cache = torch.empty(
        2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device=device
    ).normal_()
    dense_storage = torch.empty(
        (num_blocks - 1) * BLOCK_SIZE * token_bytes // DTYPE.itemsize, dtype=DTYPE, device=device
    )
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)

    print(f"# {name}; peak HBM bandwidth {peak or '?'} GB/s ({peak_source})")
    print(
        f"# decode, {NUM_HEADS} q heads / {NUM_KV_HEADS} kv heads, head {HEAD_SIZE}, "
        f"{str(DTYPE).removeprefix('torch.')}, block {BLOCK_SIZE}; median of {args.repeats}"
    )
    header = (
        f"{'batch':>5} {'context':>7} {'splits':>6} {'triton us':>10} {'GB/s':>7} {'%peak':>6} "
        f"{'sdpa us':>9} {'gather+sdpa us':>15} {'x sdpa':>7} {'x gather+sdpa':>14} {'max|err|':>9}"
    )
    print(header)
    mismatches = 0
    for batch, context in points:
        calls = build_point(batch, context, kv_cache, dense_storage, tpa)
        calls["gather"]()
        max_err = (calls["triton"]().float() - calls["sdpa"]().float()).abs().max().item()
        mismatches += max_err > MAX_BF16_ERROR
        us = {
            method: 1e3 * median_ms(calls[method], args.warmup, args.repeats, flush)
            for method in ("triton", "sdpa", "gather_sdpa")
        }
        q_out_bytes = 2 * batch * NUM_HEADS * HEAD_SIZE * DTYPE.itemsize
        moved_bytes = batch * context * token_bytes + q_out_bytes
        gbps = moved_bytes / us["triton"] / 1e3
        splits = tpa.default_num_kv_splits(batch * NUM_KV_HEADS, context, tpa.num_sms(device))
        pct = f"{100 * gbps / peak:5.1f}%" if peak else "?"
        print(
            f"{batch:>5} {context:>7} {splits:>6} {us['triton']:>10.1f} {gbps:>7.0f} {pct:>6} "
            f"{us['sdpa']:>9.1f} {us['gather_sdpa']:>15.1f} {us['sdpa'] / us['triton']:>7.2f} "
            f"{us['gather_sdpa'] / us['triton']:>14.2f} {max_err:>9.1e}"
            + ("  MISMATCH" if max_err > MAX_BF16_ERROR else ""),
            flush=True,
        )
    for batch, context in too_big:
        print(f"skipped batch {batch} x context {context}: does not fit in free GPU memory")
    if not peak:
        print(f"unknown peak bandwidth for {name!r}: pass --peak-gbps")
    if mismatches:
        sys.exit(
            f"{mismatches} point(s) where triton and SDPA differ by more than {MAX_BF16_ERROR}"
        )


if __name__ == "__main__":
    main()
