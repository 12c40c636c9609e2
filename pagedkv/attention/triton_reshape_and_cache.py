"""Triton ``reshape_and_cache``: a step's keys and values written into their slots of the paged
KV cache (one program per token), and the device check every Triton kernel here shares."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its ``[num_kv_heads, head_size]`` key and value into slot
    ``slot_mapping[token]``, i.e. offset ``slot % BLOCK_SIZE`` of block ``slot // BLOCK_SIZE``."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_SIZE)
    cache_offsets = (
        (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
        + heads * stride_ch
        + dims
    )
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


#: Under ``TRITON_INTERPRET=1`` (set before import) the kernels run on CPU tensors.
INTERPRETED = isinstance(_reshape_and_cache_kernel, InterpretedFunction)


def _check_device(tensor: torch.Tensor) -> None:
    check_device(tensor.device)


def check_device(device: torch.device) -> None:
    """ValueError unless the kernels can run on ``device``."""
    if device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            "the triton attention kernels need CUDA tensors; CPU tensors work only under "
            "TRITON_INTERPRET=1 (set before pagedkv's triton module is imported)"
        )


def triton_reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the step's keys and values into their slots (same contract as the torch
    ``reshape_and_cache``): key, value ``[num_tokens, num_kv_heads, head_size]``."""
    _check_device(kv_cache)
    num_tokens, num_kv_heads, head_size = key.shape
    block_size = kv_cache.shape[2]
    assert key.stride(-1) == value.stride(-1) == 1 and kv_cache.is_contiguous()
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
    )
