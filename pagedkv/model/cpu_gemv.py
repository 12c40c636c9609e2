"""The compiled fp32 CPU GEMV (``csrc/gemv.cpp``): one row times a weight, for decode steps
with one request.

A step with one request reads every weight once and does two flops per weight: it is bound by
memory. MKL's ``torch.mm`` for one row reads this project's small layer weights at about half of
what the machine delivers. The kernels stream the weights with software prefetch, the LM head's
with the non-temporal hint. Measured on this project's 2 cores (AMD EPYC, Zen 4; HF-peer tiny
Llama): the LM head then the 16 layer projections of a step, in sequence, 0.86-0.90 + 0.30 ms
against MKL's 1.26-1.37 + 0.99 ms; in the engine, one request's inter-token time 2.86 against
3.80 ms (interleaved, 5 pairs).

``Linear`` (input-major weight) and ``LMHead`` (whichever of its layouts it timed faster) use
them for one fp32 row once ``attach`` gives them the kernel; the model runner does that for an
fp32 model on CPU unless ``--enforce-eager``. Values equal torch's up to fp32 rounding (sums
in another order).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pagedkv.cpu_kernels import load_cpu_kernels

_PTR, _INT = ctypes.c_void_p, ctypes.c_int64


class CpuGemv:
    """Typed entry points into the library; each checks its operands before a pointer crosses."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._input_major = library.gemv_input_major_float32
        self._input_major.argtypes = [_PTR] * 4 + [_INT] * 2 + [ctypes.c_int]
        self._output_major = library.gemv_output_major_float32
        self._output_major.argtypes = [_PTR] * 3 + [_INT] * 2 + [ctypes.c_int]
        for function in (self._input_major, self._output_major):
            function.restype = None

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """One contiguous fp32 CPU row ``[1, in_features]``: the case the kernels are for."""
        return (
            x.shape[0] == 1
            and x.dim() == 2
            and x.dtype is torch.float32
            and x.is_cpu
            and x.is_contiguous()
        )

    def input_major(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ weight + bias`` for ``x [1, K]``, ``weight [K, N]``, ``bias [N]`` or None."""
        _check_weight(weight)
        in_features, out_features = weight.shape
        if not self.supports(x) or x.shape[1] != in_features:
            raise ValueError(f"gemv: x must be one contiguous fp32 CPU row of {in_features}")
        if bias is not None:
            _check_weight(bias)
            if bias.shape != (out_features,):
                raise ValueError(f"gemv: bias must have shape ({out_features},)")
        out = torch.empty(1, out_features)
        self._input_major(
            out.data_ptr(), weight.data_ptr(), x.data_ptr(),
            None if bias is None else bias.data_ptr(), in_features, out_features,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def output_major(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for ``x [1, K]``, ``weight [N, K]``."""
        _check_weight(weight)
        out_features, in_features = weight.shape
        if not self.supports(x) or x.shape[1] != in_features:
            raise ValueError(f"gemv: x must be one contiguous fp32 CPU row of {in_features}")
        out = torch.empty(1, out_features)
        self._output_major(
            out.data_ptr(), weight.data_ptr(), x.data_ptr(), out_features, in_features,
            torch.get_num_threads(),
        )  # fmt: skip
        return out


def _check_weight(t: torch.Tensor) -> None:
    if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous() or t.numel() == 0:
        raise ValueError("gemv: weights must be non-empty contiguous fp32 CPU tensors")


def load_cpu_gemv() -> CpuGemv | None:
    """The kernels, or None when the CPU kernels cannot be built (warned once per process)."""
    library = load_cpu_kernels()
    return None if library is None else CpuGemv(library)


def attach(model: nn.Module, gemv: CpuGemv) -> int:
    """Give ``gemv`` to every module of ``model`` with a ``cpu_gemv`` slot (each ``Linear``, the
    LM head included), which must run in fp32 on the CPU; returns how many took it. The LM head
    then chooses which of its layouts the GEMV reads (``LMHead.choose_gemv_layout``)."""
    modules = [m for m in model.modules() if hasattr(m, "cpu_gemv")]
    for module in modules:
        module.cpu_gemv = gemv
    return len(modules)
