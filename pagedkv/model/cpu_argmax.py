"""The compiled fp32 CPU argmax (``csrc/argmax.cpp``) behind the sampler's greedy tokens.

``torch.argmax`` over a row of logits is a slow reduction on CPU (64 x 32000: about 3 ms on
this project's 2 cores) and the sampler's chunked ``amax`` workaround costs several small ops
(1 row: about 70 us). The kernel reads each row once, vectorised, with ``torch.argmax``'s answer
on ties and NaNs: 1 row in about 12 us, 64 rows in 0.3-0.5 ms.
"""

from __future__ import annotations

import ctypes

import torch

from pagedkv.cpu_kernels import load_cpu_kernels


class CpuArgmax:
    """``argmax(values)`` for contiguous fp32 CPU ``values [num_rows, vocab]``, ``vocab >= 1``."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._argmax = library.argmax_float32
        self._argmax.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        self._argmax.restype = None

    @staticmethod
    def supports(values: torch.Tensor) -> bool:
        return (
            values.dtype is torch.float32
            and values.is_cpu
            and values.dim() == 2
            and values.shape[1] > 0
            and values.is_contiguous()
        )

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        if not self.supports(values):
            raise ValueError("argmax: values must be a contiguous fp32 CPU [rows, vocab >= 1]")
        num_rows, vocab = values.shape
        out = torch.empty(num_rows, dtype=torch.int64)
        self._argmax(out.data_ptr(), values.data_ptr(), num_rows, vocab, torch.get_num_threads())
        return out


def load_cpu_argmax() -> CpuArgmax | None:
    """The kernel, or None when the CPU kernels cannot be built (warned once per process)."""
    library = load_cpu_kernels()
    return None if library is None else CpuArgmax(library)
