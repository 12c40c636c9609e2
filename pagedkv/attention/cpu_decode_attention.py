"""The compiled CPU decode kernel (``csrc/paged_decode.cpp``, built by ``cpu_kernels``).

Decode attention on CPU is memory-bound: the torch path gathers each decode's blocks into a
scratch copy, then runs SDPA over the copy, so every key and value is read twice and written
once, in about ten small calls per layer. The kernel reads them once, in place, through the
block table, in one parallel region per layer (64 decodes of 350 tokens: 6.8 vs 12.3 ms per
layer on one core of this project's CPU; on two cores shared with other jobs 16 vs 128 ms).
Without a compiler the torch path is used.
"""

from __future__ import annotations

import ctypes

import torch

from pagedkv.cpu_kernels import load_cpu_kernels

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES = [_PTR] * 7 + [ctypes.c_float] + [_INT] * 7 + [ctypes.c_int]


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
        self._functions = {}
        for dtype in _DTYPES:
            function = getattr(library, f"paged_decode_{str(dtype).removeprefix('torch.')}")
            function.argtypes = _ARGTYPES
            function.restype = None
            self._functions[dtype] = function

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
        function = self._functions.get(query.dtype)
        if function is None:
            raise ValueError(f"paged_decode: unsupported dtype {query.dtype}")
        tensors = (out, query, kv_cache, token_indices, block_table, seq_lens, first_keys)
        if not all(t.is_cpu and t.is_contiguous() for t in tensors):
            raise ValueError("paged_decode: every tensor must be a contiguous CPU tensor")
        if out.dtype != query.dtype or kv_cache.dtype != query.dtype:
            raise ValueError("paged_decode: out, query and kv_cache must share one dtype")
        index_dtypes = (token_indices.dtype, block_table.dtype, seq_lens.dtype, first_keys.dtype)
        if index_dtypes != (torch.int64, torch.int32, torch.int32, torch.int32):
            raise ValueError("paged_decode: token_indices int64; block_table, seq_lens int32")
        num_rows = token_indices.numel()
        if not (block_table.shape[0] == seq_lens.numel() == first_keys.numel() == num_rows):
            raise ValueError("paged_decode: one table row, seq_len and first key per decode")
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        if out.shape != query.shape or query.shape[2] != head_size:
            raise ValueError("paged_decode: query/out shape does not match the cache")
        function(
            out.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), token_indices.data_ptr(),
            block_table.data_ptr(), seq_lens.data_ptr(), first_keys.data_ptr(), scale,
            num_rows, query.shape[1], head_size, num_blocks, block_size, num_kv_heads,
            block_table.shape[1], torch.get_num_threads(),
        )  # fmt: skip


def load_paged_decode() -> PagedDecode | None:
    """The kernel, or None when the CPU kernels cannot be built (warned once per process)."""
    library = load_cpu_kernels()
    return None if library is None else PagedDecode(library)
