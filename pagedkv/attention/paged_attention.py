"""Torch reference of the paged KV cache write and read; the CPU production path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.attention.cpu_paged_attention import CpuAttentionKernels
from pagedkv.attention.metadata import AttentionMetadata


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the step's keys and values into their slots.

    key, value: ``[num_tokens, num_kv_heads, head_size]``; kv_cache:
    ``[2, num_blocks, block_size, num_kv_heads, head_size]``. Slot ``s`` is offset
    ``s % block_size`` of block ``s // block_size``, i.e. row ``s`` of the cache viewed as
    ``[2, num_blocks * block_size, num_kv_heads, head_size]``.
    """
    slots = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    slots[0].index_copy_(0, slot_mapping, key)
    slots[1].index_copy_(0, slot_mapping, value)


class GatherBuffer:
    """A growable scratch buffer for the blocks gathered by one layer at a time.

    Gathering into a fresh tensor each layer costs more than the attention itself on CPU (the
    allocator maps and faults in tens of MB per call), so the buffer is kept and reused.
    Not thread-safe: one buffer per model runner.
    """

    __slots__ = ("_storage",)

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None

    def gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Return ``kv_cache[:, block_ids]`` as ``[2, len(block_ids) * block_size, H, D]``."""
        num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape[1:]
        block_numel = block_size * num_kv_heads * head_size
        numel = 2 * block_ids.numel() * block_numel
        storage = self._storage
        if (
            storage is None
            or storage.numel() < numel
            or storage.dtype != kv_cache.dtype
            or storage.device != kv_cache.device
        ):
            storage = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
            self._storage = storage
        num_ids = block_ids.numel()
        # One gather over the first dimension of the cache viewed as K rows then V rows: torch
        # parallelises index_select over dim 0 only (2x faster on 2 threads than over dim 1).
        rows = torch.cat((block_ids, block_ids + num_blocks))
        out = storage[:numel].view(2 * num_ids, block_numel)
        torch.index_select(kv_cache.view(2 * num_blocks, block_numel), 0, rows, out=out)
        return out.view(2, num_ids * block_size, num_kv_heads, head_size)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    buffer: GatherBuffer | None = None,
    kernels: CpuAttentionKernels | None = None,
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of a mixed varlen batch over the paged cache.

    query: ``[num_tokens, num_heads, head_size]`` with ``num_heads`` a multiple of the cache's
    ``num_kv_heads`` (query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``).
    Keys and values are read only through the block table. With ``kernels`` (the compiled CPU
    kernels) all decodes go through one call and all prefill chunks through another, both
    reading the cache in place; the prefill kernel declines shapes it has no code for. Without
    them each bucket of decodes goes through one padded SDPA call over a gathered copy, and
    each prefill chunk through its own SDPA call. Inputs are 4-D so that CPU SDPA picks its
    flash kernel (3-D inputs fall back to the much slower math path).

    A decode reads whole blocks: the slots past ``seq_len`` in its last block are read and
    masked out, so they must hold finite values (allocate the cache with ``torch.zeros``; every
    later write is a real token's key or value). Blocks outside a sliding window are never read.
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if kernels is not None:
        query = query.contiguous()
        if _compiled_attention(out, query, kv_cache, metadata, scale, kernels):
            return out
    buffer = buffer if buffer is not None else GatherBuffer()
    for bucket in metadata.decode_buckets if kernels is None else ():
        num_rows = bucket.token_indices.numel()
        kv = buffer.gather(kv_cache, bucket.block_ids)
        kv = kv.view(2, num_rows, -1, *kv.shape[-2:]).transpose(2, 3)
        bucket_out = F.scaled_dot_product_attention(
            query[bucket.token_indices].unsqueeze(2),
            kv[0],
            kv[1],
            attn_mask=bucket.key_mask,
            scale=scale,
            enable_gqa=True,
        )
        out[bucket.token_indices] = bucket_out.squeeze(2)
    for chunk in metadata.prefill_chunks:
        kv = buffer.gather(kv_cache, chunk.block_ids)
        kv = kv[:, chunk.key_offset : chunk.key_offset + chunk.num_keys].transpose(1, 2)
        chunk_out = F.scaled_dot_product_attention(
            query[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0),
            kv[0].unsqueeze(0),
            kv[1].unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[chunk.token_start : chunk.token_end] = chunk_out[0].transpose(0, 1)
    return out


def _compiled_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kernels: CpuAttentionKernels,
) -> bool:
    """All decodes through one kernel call, then all prefill chunks through another: whether
    every row is done (False: the prefill kernel declined the chunks' shapes)."""
    decodes, prefills = metadata.decode_batch, metadata.prefill_batch
    if decodes is not None:
        kernels.decode(
            out, query, kv_cache, decodes.token_indices, decodes.block_table, decodes.seq_lens,
            decodes.first_keys, scale,
        )  # fmt: skip
    return prefills is None or kernels.prefill(
        out, query, kv_cache, prefills.token_starts, prefills.query_lens, prefills.seq_lens,
        prefills.block_table, scale, metadata.sliding_window,
    )  # fmt: skip
