"""The compiled CPU attention kernels (``csrc/paged_decode.cpp``, ``csrc/paged_prefill.cpp``,
built by ``cpu_kernels``): both read keys and values in place through the block table.

Decode attention on CPU is memory-bound: the torch path gathers each decode's blocks into a
scratch copy, then runs SDPA over the copy, so every key and value is read twice and written
once, in about ten small calls per layer. The decode kernel reads them once, in one parallel
region per layer (64 decodes of 350 tokens: 6.8 vs 12.3 ms per layer on one core of this
project's CPU; on two cores shared with other jobs 16 vs 128 ms).

Prefill attention is compute-bound: the prefill kernel runs every chunk of a step in one
parallel region, as tiles of query rows against keys transposed once per work item (64 prompts
of 71-507 tokens, head size 32, 2 threads: about half of per-chunk SDPA's time).
Without a compiler the torch path is used.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedkv.cpu_kernels import load_cpu_kernels

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT = ctypes.c_int64
_PTR = ctypes.c_void_p
_DECODE_ARGTYPES = [_PTR] * 7 + [ctypes.c_float] + [_INT] * 7 + [ctypes.c_int]
_PREFILL_ARGTYPES = [_PTR] * 7 + [ctypes.c_float] + [_INT] * 8 + [ctypes.c_int]


def _functions(library: ctypes.CDLL, prefix: str, argtypes: list, restype) -> dict:
    functions = {}
    for dtype in _DTYPES:
        function = getattr(library, f"{prefix}_{str(dtype).removeprefix('torch.')}")
        function.argtypes = argtypes
        function.restype = restype
        functions[dtype] = function
    return functions


def _check(
    name: str,
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    per_row: tuple[torch.Tensor, ...],
) -> None:
    """What both kernels trust: contiguous CPU tensors, one float dtype, int32 tables and
    per-row arrays of one length (the table's rows), query and out shaped like the cache."""
    if query.dtype not in _DTYPES:
        raise ValueError(f"{name}: unsupported dtype {query.dtype}")
    tensors = (out, query, kv_cache, block_table, *per_row)
    if not all(t.is_cpu and t.is_contiguous() for t in tensors):
        raise ValueError(f"{name}: every tensor must be a contiguous CPU tensor")
    if out.dtype != query.dtype or kv_cache.dtype != query.dtype:
        raise ValueError(f"{name}: out, query and kv_cache must share one dtype")
    if block_table.dtype != torch.int32 or any(t.dtype != torch.int32 for t in per_row):
        raise ValueError(f"{name}: block_table and the per-row lengths must be int32")
    if any(t.numel() != block_table.shape[0] for t in per_row):
        raise ValueError(f"{name}: one table row and one length of each kind per row")
    if (
        out.shape != query.shape
        or query.shape[2] != kv_cache.shape[-1]
        or query.shape[1] % kv_cache.shape[-2]
    ):
        raise ValueError(f"{name}: query/out shape does not match the cache")


class PagedDecode:
    """``paged_decode(out, query, kv_cache, token_indices, block_table, seq_lens, first_keys,
    scale)``: writes the decode rows ``token_indices`` of ``out``.

    out, query: ``[num_tokens, num_heads, head_size]``; kv_cache: ``[2, num_blocks, block_size,
    num_kv_heads, head_size]``; all contiguous, of one dtype (fp32, fp16 or bf16).
    token_indices: int64 ``[R]``; block_table: int32 ``[R, max_blocks]``; seq_lens, first_keys:
    int32 ``[R]``: row ``r`` attends to the keys at positions ``[first_keys[r], seq_lens[r])``.
    The C side trusts these shapes: they are checked here, before any pointer crosses.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = _functions(library, "paged_decode", _DECODE_ARGTYPES, None)

    def __call__(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        token_indices: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        first_keys: torch.Tensor,
        scale: float,
    ) -> None:
        _check("paged_decode", out, query, kv_cache, block_table, (seq_lens, first_keys))
        if not (token_indices.is_cpu and token_indices.dtype == torch.int64):
            raise ValueError("paged_decode: token_indices must be int64 on the CPU")
        if token_indices.numel() != block_table.shape[0]:
            raise ValueError("paged_decode: one table row and one length of each kind per row")
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        self._functions[query.dtype](
            out.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), token_indices.data_ptr(),
            block_table.data_ptr(), seq_lens.data_ptr(), first_keys.data_ptr(), scale,
            token_indices.numel(), query.shape[1], head_size, num_blocks, block_size,
            num_kv_heads, block_table.shape[1], torch.get_num_threads(),
        )  # fmt: skip


class PagedPrefill:
    """``paged_prefill(out, query, kv_cache, token_starts, query_lens, seq_lens, block_table,
    scale, sliding_window) -> bool``: writes the rows of every prefill chunk of ``out``.

    Chunk ``c`` is the ``query_lens[c]`` tokens from row ``token_starts[c]``, at positions
    ``seq_lens[c] - query_lens[c]`` to ``seq_lens[c] - 1``, its keys through ``block_table[c]``;
    a query at position ``p`` sees the keys at ``(p - sliding_window, p]`` (all of ``[0, p]``
    without a window). All index tensors int32. False, with nothing written, where this CPU or
    shape has no kernel (it needs AVX-512 and head size 32, 64 or 128): run SDPA instead.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = _functions(library, "paged_prefill", _PREFILL_ARGTYPES, ctypes.c_int)

    def __call__(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        token_starts: torch.Tensor,
        query_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        scale: float,
        sliding_window: int | None,
    ) -> bool:
        per_row = (token_starts, query_lens, seq_lens)
        _check("paged_prefill", out, query, kv_cache, block_table, per_row)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"paged_prefill: sliding_window must be >= 1, got {sliding_window}")
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        handled = self._functions[query.dtype](
            out.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), token_starts.data_ptr(),
            query_lens.data_ptr(), seq_lens.data_ptr(), block_table.data_ptr(), scale,
            block_table.shape[0], query.shape[1], head_size, num_blocks, block_size, num_kv_heads,
            block_table.shape[1], sliding_window or 0, torch.get_num_threads(),
        )  # fmt: skip
        return bool(handled)


@dataclass(frozen=True, slots=True)
class CpuAttentionKernels:
    decode: PagedDecode
    prefill: PagedPrefill


def load_cpu_attention() -> CpuAttentionKernels | None:
    """The kernels, or None when the CPU kernels cannot be built (warned once per process)."""
    library = load_cpu_kernels()
    if library is None:
        return None
    return CpuAttentionKernels(PagedDecode(library), PagedPrefill(library))
