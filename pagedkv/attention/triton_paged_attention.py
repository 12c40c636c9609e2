"""Triton paged attention over the paged KV cache (``triton_reshape_and_cache.py`` writes it).

One attention launch serves the whole mixed varlen batch (prefill chunks and decodes), reading
keys and values straight from the paged cache through the block table. On CPU the kernels run
under ``TRITON_INTERPRET=1`` (the tests do that); in production they run on CUDA tensors.

Grid of the attention kernel: ``(query tile, kv head, kv split)``.

* A **query tile** is ``BLOCK_Q`` consecutive queries of one request together with the
  ``QUERIES_PER_KV`` query heads that share one KV head (GQA), packed into the ``BLOCK_M`` rows
  of one ``tl.dot``: row ``r`` is query ``r // QUERIES_PER_KV`` of the tile, query head
  ``kv_head * QUERIES_PER_KV + r % QUERIES_PER_KV``. A decode is a request with one tile holding
  one query; a prefill chunk has ``ceil(q_len / BLOCK_Q)`` tiles. Both kinds share the launch.
* A **kv split** is a contiguous share of the key tiles one query tile visits. With one split
  the kernel writes the normalised output; with several (long contexts, few query tiles: the
  decode case) each split writes an unnormalised partial result and ``_reduce_kv_splits_kernel``
  combines them.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.triton_reshape_and_cache import INTERPRETED, check_device

_MAX_KV_SPLITS = 64
# Splitting a context into pieces of fewer keys than this costs more in the reduction than it
# wins in parallelism.
_MIN_KEYS_PER_SPLIT = 512


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """The request owning query tile ``tile``: request ``i`` owns the tiles
    ``[query_start_loc[i] // BLOCK_Q + i, query_start_loc[i + 1] // BLOCK_Q + i + 1)``.

    That closed form is a prefix sum of tile counts that needs no host pass: each request gets
    ``ceil(q_len / BLOCK_Q)`` tiles or one more, and the extra tile returns at once::

        BLOCK_Q=4, query lens [1, 6, 1], query_start_loc [0, 1, 7, 8]
        request 0: tiles [0, 1)   request 1: tiles [1, 3)   request 2: tiles [3, 5), 4 is empty
        grid = num_tokens // BLOCK_Q + num_reqs = 5

    First tiles strictly increase with ``i``, so a binary search finds the last request whose
    first tile is ``<= tile``.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs  # invariant: the owner is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """``a @ b`` accumulated in fp32. The interpreter multiplies bf16 tensors as their raw
    uint16 bits (triton 3.9); with DOT_FP32 the operands, already rounded to bf16, are widened
    to fp32 exactly, so the result matches a bf16 tensor-core dot up to summation order."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    qk_scale,
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_q = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if first_q >= q_len:
        return
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
    seq_len = tl.load(seq_lens_ptr + req)
    # The request's queries sit at positions seq_len - q_len ... seq_len - 1 (the chunk may
    # start after a prefix-cache hit).
    context_len = seq_len - q_len

    # Rows past the tile's last query (or past BLOCK_Q * QUERIES_PER_KV when BLOCK_M is not a
    # multiple of it) repeat the last query: every row then sees at least one key, and only
    # the rows of real queries are stored.
    rows = tl.arange(0, BLOCK_M)
    row_q = first_q + rows // QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (row_q <= last_q)
    row_q = tl.minimum(row_q, last_q)
    row_head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_token = (q_start + row_q).to(tl.int64)
    row_pos = context_len + row_q
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < HEAD_SIZE

    q = tl.load(
        query_ptr + row_token[:, None] * stride_qt + row_head[:, None] * stride_qh + dims[None, :],
        mask=dim_mask[None, :],
        other=0.0,
    )

    # Keys the tile visits: start_key, the start of the block holding the first key in the
    # window of the tile's first query, up to last_pos, the tile's last query (inclusive).
    # Blocks left of start_key are never looked up, so the null block standing in for them is
    # never read; slots right of last_pos (the partial last block's tail) are masked out.
    #
    #   SLIDING_WINDOW=4, BLOCK_SIZE=4, the tile's queries at positions 9 and 10
    #   position:        0  1  2  3 |  4  5  6  7 |  8  9 10  _
    #   query 9 sees:                        6  7 |  8  9
    #   query 10 sees:                          7 |  8  9 10
    #   visited:                    |-----------------------|  start_key=4 .. last_pos=10
    #   never read:     |-----------|
    first_pos = context_len + first_q
    last_pos = context_len + last_q
    first_key = 0 if SLIDING_WINDOW is None else tl.maximum(first_pos - SLIDING_WINDOW + 1, 0)
    start_key = (first_key // BLOCK_SIZE) * BLOCK_SIZE
    num_tiles = tl.cdiv(last_pos + 1 - start_key, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    # Online softmax in base 2 (qk_scale includes log2(e)). m_i is the running row max; a row
    # that has not seen a visible key yet keeps m_i = -inf and l_i = 0.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for t in range(tile_lo, tile_hi):
        key_pos = start_key + t * TILE_N + offs_n
        # The last tile may run past last_pos, into the partial last block or past the
        # request's last block: those slots are neither looked up nor loaded.
        key_valid = key_pos <= last_pos
        physical_block = tl.load(block_table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        slot_offsets = (
            physical_block.to(tl.int64) * stride_cb
            + (key_pos % BLOCK_SIZE) * stride_cs
            + kv_head * stride_ch
        )
        load_mask = key_valid[:, None] & dim_mask[None, :]
        k = tl.load(
            key_cache_ptr + slot_offsets[:, None] + dims[None, :], mask=load_mask, other=0.0
        )
        v = tl.load(
            value_cache_ptr + slot_offsets[:, None] + dims[None, :], mask=load_mask, other=0.0
        )

        # Causal: key_pos <= row_pos (this also hides key_valid's padding, since
        # row_pos <= last_pos). Window: key_pos > row_pos - SLIDING_WINDOW.
        visible = key_pos[None, :] <= row_pos[:, None]
        if SLIDING_WINDOW is not None:
            visible &= key_pos[None, :] > row_pos[:, None] - SLIDING_WINDOW
        s = _dot(q, tl.trans(k), DOT_FP32) * qk_scale
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr
            + row_token[:, None] * stride_ot
            + row_head[:, None] * stride_oh
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_mask[None, :],
        )
    else:
        # Partial results indexed [token, head, split] (num_programs(1) * QUERIES_PER_KV is
        # num_heads), contiguous; an empty split stores
        # m=-inf, l=0, acc=0 and drops out of the reduction.
        partial = (row_token * tl.num_programs(1) * QUERIES_PER_KV + row_head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + partial, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + partial, l_i, mask=row_valid)
        tl.store(
            partial_out_ptr + partial[:, None] * HEAD_PAD + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )


@triton.jit
def _reduce_kv_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One program per (token, query head): rescale each split to the common max and
    normalise. Every query sees its own key, so at least one split has a finite max."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    partial = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(partial_max_ptr + partial)
    weight = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(tl.load(partial_sum_ptr + partial) * weight, 0)
    dims = tl.arange(0, HEAD_PAD)
    acc = tl.load(partial_out_ptr + partial[:, None] * HEAD_PAD + dims[None, :])
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    return _num_sms(torch.cuda.current_device() if device.index is None else device.index)


def default_num_kv_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Split the keys only when the launch has too few programs to fill the GPU (small decode
    batches over long contexts). A power of two, so few kernel variants get compiled."""
    wanted = min(
        math.ceil(2 * num_sms / num_programs),
        max_seq_len // _MIN_KEYS_PER_SPLIT,
        _MAX_KV_SPLITS,
    )
    return 1 << (max(wanted, 1).bit_length() - 1)


def triton_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of a mixed varlen batch over the paged cache.

    Same contract as the torch ``paged_attention``: query ``[num_tokens, num_heads, head_size]``
    with ``num_heads`` a multiple of the cache's ``num_kv_heads``; kv_cache
    ``[2, num_blocks, block_size, num_kv_heads, head_size]``. ``num_kv_splits`` (a power of two)
    overrides the heuristic that splits long contexts across programs.
    """
    check_device(query.device)
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    queries_per_kv = num_heads // num_kv_heads
    assert queries_per_kv * num_kv_heads == num_heads and query.stride(-1) == 1
    assert kv_cache.is_contiguous() and kv_cache.dtype == query.dtype
    assert metadata.block_table.stride(1) == 1
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out

    # Decode-only batches use the smallest tile tl.dot accepts; batches with prefill chunks a
    # flash-attention sized one. A tile always holds all heads of one KV head.
    block_m = max(16 if metadata.max_query_len == 1 else 64, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    num_reqs = metadata.seq_lens.shape[0]
    num_tiles = num_tokens // block_q + num_reqs
    if num_kv_splits is None and query.device.type == "cuda":
        # Tiles that do work, ceil(q_len / block_q) per request: at most this, exact for decodes.
        num_busy_tiles = num_reqs + (num_tokens - num_reqs) // block_q
        num_kv_splits = default_num_kv_splits(
            num_busy_tiles * num_kv_heads, metadata.max_seq_len, num_sms(query.device)
        )
    elif num_kv_splits is None:  # the interpreter runs programs one by one: no use splitting
        num_kv_splits = 1
    head_pad = max(16, triton.next_power_of_2(head_size))
    # Keys per inner-loop step; independent of block_size, since each key finds its physical
    # block through the block table. With these tiles and 8 warps every dtype and head size up
    # to 256 compiles for sm_90 without register spills; not tuned on a GPU yet.
    tile_n = 32 if head_pad <= 128 else 16
    if num_kv_splits == 1:
        partial_out = partial_max = partial_sum = out  # unused: the kernel writes `out`
    else:
        partial_max = torch.empty(
            num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
        partial_out = torch.empty(
            num_tokens, num_heads, num_kv_splits, head_pad, dtype=torch.float32, device=query.device
        )

    _paged_attention_kernel[(num_tiles, num_kv_heads, num_kv_splits)](
        out,
        query,
        kv_cache[0],
        kv_cache[1],
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        partial_out,
        partial_max,
        partial_sum,
        scale * math.log2(math.e),
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        metadata.block_table.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        SLIDING_WINDOW=metadata.sliding_window,
        NUM_SPLITS=num_kv_splits,
        DOT_FP32=INTERPRETED and query.dtype == torch.bfloat16,
        num_warps=8,
    )
    if num_kv_splits > 1:
        _reduce_kv_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            out.stride(0),
            out.stride(1),
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            NUM_SPLITS=num_kv_splits,
        )
    return out
