"""Attention on CPU: the compiled paged kernels against SDPA over a gathered copy.

Ours: ``paged_attention`` with the compiled kernels (decodes in one call, prefill chunks in
another, K/V read in place through the block table). Peer: the same function without them,
the path ``--enforce-eager`` takes, which is what a torch engine does: each chunk's (or bucket
of decodes') blocks gathered into a dense copy, then ``scaled_dot_product_attention`` (CPU
flash attention). Both see the same cache, block tables and queries; outputs are checked equal
(fp32 rounding) before timing.

Workloads, one layer, fp32, block size 16, block tables shuffled (seeded):
- prefill: the HF-peer prompts (64 of 71-507 tokens), one 2,048-token prompt, and 512 new
  tokens after a 1,536-token prefix-cache hit;
- decode: 64 requests at contexts of <= 350 and of 1,000 tokens;
each for the HF-peer model's heads (8 query / 4 KV heads of 32) and a Llama-8B-like layer
(32 / 8 heads of 128). Times are medians of interleaved repeats.

    python benchmarks/attention_cpu.py [--threads 2] [--repeats 9]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from pagedkv.attention import AttentionMetadata, GatherBuffer, paged_attention  # noqa: E402
from pagedkv.attention.cpu_paged_attention import load_cpu_attention  # noqa: E402

BLOCK_SIZE = 16
HEADS = {"8/4 x 32": (8, 4, 32), "32/8 x 128": (32, 8, 128)}


def workloads(rng: np.random.Generator) -> dict[str, list[tuple[int, int]]]:
    """(cached tokens, new tokens) per request."""
    return {
        "prefill, 64 prompts of 71-507": [(0, int(n)) for n in rng.integers(71, 508, 64)],
        "prefill, one 2,048-token prompt": [(0, 2048)],
        "prefill, 512 after a 1,536 hit": [(1536, 512)],
        "decode, 64 x <= 350": [(int(n), 1) for n in rng.integers(71, 350, 64)],
        "decode, 64 x 1,000": [(999, 1)] * 64,
    }


def build(requests, heads, rng: np.random.Generator, gen: torch.Generator):
    num_heads, num_kv_heads, head_size = heads
    blocks = [math.ceil((c + n) / BLOCK_SIZE) for c, n in requests]
    pool = rng.permutation(np.arange(1, sum(blocks) + 1))
    table = np.zeros((len(requests), max(blocks)), dtype=np.int32)
    used = 0
    for row, count in enumerate(blocks):
        table[row, :count] = pool[used : used + count]
        used += count
    query_lens = [n for _, n in requests]
    metadata = AttentionMetadata.from_numpy(
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]),
        seq_lens=np.array([c + n for c, n in requests]),
        block_table=table,
        slot_mapping=np.zeros(sum(query_lens), dtype=np.int64),
        block_size=BLOCK_SIZE,
    )
    kv_cache = torch.randn(2, used + 1, BLOCK_SIZE, num_kv_heads, head_size, generator=gen)
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen)
    return query, kv_cache, metadata


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_attention()
    if kernels is None:
        sys.exit("the CPU kernels could not be built here: nothing to compare")
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    print(f"{args.threads} threads, fp32, medians of {args.repeats} interleaved repeats")
    print(f"{'workload':34} {'heads':11} {'ours ms':>9} {'SDPA ms':>9} {'speed-up':>9}")
    for name, requests in workloads(rng).items():
        for heads_name, heads in HEADS.items():
            query, kv_cache, metadata = build(requests, heads, rng, gen)
            scale = heads[2] ** -0.5
            step = partial(paged_attention, query, kv_cache, metadata, scale, GatherBuffer())
            runs = {"ours": partial(step, kernels=kernels), "sdpa": step}
            torch.testing.assert_close(runs["ours"](), runs["sdpa"](), atol=2e-5, rtol=1e-4)
            times: dict[str, list[float]] = {key: [] for key in runs}
            for _ in range(args.repeats):
                for key, run in runs.items():
                    start = time.perf_counter()
                    run()
                    times[key].append(time.perf_counter() - start)
            ours, sdpa = (statistics.median(times[key]) * 1e3 for key in ("ours", "sdpa"))
            print(f"{name:34} {heads_name:11} {ours:9.2f} {sdpa:9.2f} {sdpa / ours:8.2f}x")


if __name__ == "__main__":
    main()
