"""Whole-block copies between a paged KV cache and a packed buffer (``csrc/block_copy.cpp``):
``gather`` packs blocks by id into a message, ``scatter`` writes a message into blocks by id.

A block of a cache half ``[num_blocks, block_size, heads, head_size]`` is one contiguous row
of bytes, so both are a memcpy per run of consecutive blocks, whatever the dtype. The compiled
kernel does them in one call (ids checked there, before a byte moves), on one thread unless
told more: on a small machine the gloo thread and the peer process need the other cores.
Both stream their stores past the caches by default (non-temporal): a line is then not read
before it is written, and what the socket is reading stays cached. D's blocks are read by
attention steps later, not now; a packed message is read once, by the socket, after a few
MiB of others. Measured on this project's 2 cores (AVX-512, shared with other jobs): 256
scattered 32 KiB blocks of a 1 GiB cache, the kernel's scatter 2.8x ``index_copy_``, its
gather 1.1-1.4x ``index_select``; in the bandwidth benchmark (random blocks, 4k tokens) the
CPU time of P and D together per GiB moved 0.84-0.85 s against 1.09-1.17 s with the torch
ops (0.91-0.93 s with the gather's stores cached).

Without the library, or for tensors it does not take (not contiguous, not on the CPU, shapes
or dtypes that differ), the torch ops run: ``index_select`` / ``index_copy_`` on 8-byte words.
"""

from __future__ import annotations

import ctypes
import math

import torch

from pagedkv.cpu_kernels import load_cpu_kernels

_PTR, _INT = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_PTR, _PTR, _INT, _INT, _PTR, _PTR, _INT, _INT, _INT, _INT, ctypes.c_int, ctypes.c_int]


class _Kernel:
    """The typed entry point; callers check operands before a pointer crosses."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._copy = library.copy_blocks
        self._copy.argtypes = _ARGTYPES
        self._copy.restype = _INT

    def copy(
        self,
        dst: torch.Tensor,
        dst_ids: torch.Tensor | None,
        src: torch.Tensor,
        src_ids: torch.Tensor | None,
        streaming: bool,
        num_threads: int,
    ) -> None:
        """``dst[dst_ids[i]] = src[src_ids[i]]`` (None: ``i``), rows of dim 0."""
        ids = dst_ids if dst_ids is not None else src_ids
        assert ids is not None
        row = math.prod(dst.shape[1:]) * dst.element_size()
        bad = self._copy(
            dst.data_ptr(), None if dst_ids is None else dst_ids.data_ptr(), dst.shape[0], row,
            src.data_ptr(), None if src_ids is None else src_ids.data_ptr(), src.shape[0], row,
            ids.numel(), row, int(streaming), num_threads,
        )  # fmt: skip
        if bad >= 0:
            side, i = (dst_ids, bad) if bad < ids.numel() else (src_ids, bad - ids.numel())
            assert side is not None
            raise IndexError(f"block id {int(side[i])} out of range (at {i})")


_UNLOADED = object()
_kernel: _Kernel | None | object = _UNLOADED


def _loaded() -> _Kernel | None:
    global _kernel
    if _kernel is _UNLOADED:
        library = load_cpu_kernels()
        _kernel = None if library is None else _Kernel(library)
    return _kernel  # type: ignore[return-value]


def load() -> bool:
    """Load the kernel now (built here on first use, which takes seconds): a connector calls
    this when it registers its caches, so no transfer waits for a build. False: torch ops."""
    return _loaded() is not None


def _takes(cache: torch.Tensor, ids: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether the kernel takes these: contiguous CPU tensors of one dtype, rows of one shape,
    one int64 id per packed row."""
    return (
        cache.is_cpu
        and packed.is_cpu
        and ids.is_cpu
        and cache.dtype == packed.dtype
        and ids.dtype == torch.int64
        and ids.dim() == 1
        and packed.shape[0] == ids.numel()
        and cache.shape[1:] == packed.shape[1:]
        and cache.is_contiguous()
        and packed.is_contiguous()
        and ids.is_contiguous()
    )


def _as_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as 8-byte words when both allow (one dtype, rows of whole words), else as they are:
    the torch ops move fp16/bf16 rows ~1.6x faster as int64 (fewer, wider elements)."""
    if a.dtype == b.dtype and a.element_size() < 8 and (a.shape[-1] * a.element_size()) % 8 == 0:
        try:
            return a.view(torch.int64), b.view(torch.int64)
        except RuntimeError:  # an odd storage offset or stride: keep the element views
            pass
    return a, b


def gather(
    cache: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    streaming: bool = True,
    num_threads: int = 1,
) -> None:
    """``out[i] = cache[ids[i]]``: blocks (rows of dim 0) packed in the order of ``ids``."""
    kernel = _loaded()
    if kernel is not None and _takes(cache, ids, out):
        kernel.copy(out, None, cache, ids, streaming, num_threads)
    else:
        source, packed = _as_words(cache, out)
        torch.index_select(source, 0, ids, out=packed)


def scatter(
    cache: torch.Tensor,
    ids: torch.Tensor,
    message: torch.Tensor,
    streaming: bool = True,
    num_threads: int = 1,
) -> None:
    """``cache[ids[i]] = message[i]``: the inverse of ``gather`` (``ids`` distinct)."""
    kernel = _loaded()
    if kernel is not None and _takes(cache, ids, message):
        kernel.copy(cache, ids, message, None, streaming, num_threads)
    else:
        target, packed = _as_words(cache, message)
        target.index_copy_(0, ids, packed)
