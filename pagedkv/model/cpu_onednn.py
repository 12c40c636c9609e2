"""oneDNN's fp32 GEMM against a prepacked weight, for the batches of a ``Linear`` on CPU.

torch's ``torch.mm`` on CPU is MKL, and MKL runs its AVX2 code on AMD CPUs: on this project's
2-core AMD EPYC (Zen 5, two 512-bit FMA pipes) it reached 180-200 GFLOP/s on the tiny Llama's
shapes, where oneDNN, against a weight reordered once into its blocked layout, reached 360-450
(64 x 256 x 32000, the LM head of a 64-request decode step: 8.1 vs 2.9 ms). vLLM's CPU backend
also prepacks linear weights for oneDNN; torch's inductor does it with these two ops
(``mkldnn._reorder_linear_weight``, ``mkldnn._linear_pointwise``).

``attach`` gives each ``Linear`` (the LM head included) a packed copy of its weight where one
batch of ``TUNE_ROWS`` rows ran faster through it than through MKL, timed once per weight shape
and machine (``tuning.KernelChoices``); elsewhere (a CPU where MKL is as fast) nothing
changes. The copy costs the weight's size again (the input-major weight stays, for the one-row
GEMV and ``--enforce-eager``), so nothing is packed where the copies would take more than half
of the memory available.
Values equal MKL's up to fp32 rounding (sums in another order).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from pagedkv.model.tuning import TUNE_ROWS, KernelChoices

logger = logging.getLogger(__name__)


def onednn_available() -> bool:
    """torch was built with oneDNN and has the two ops this module uses."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An input-major fp32 CPU weight ``[in, out]`` reordered for oneDNN (an opaque mkldnn
    tensor, ``[out, in]`` as ``nn.Linear`` holds it)."""
    if weight.dtype is not torch.float32 or not weight.is_cpu or weight.dim() != 2:
        raise ValueError("onednn: weights must be 2-D fp32 CPU tensors")
    return torch.ops.mkldnn._reorder_linear_weight(weight.t().contiguous(), TUNE_ROWS)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight + bias`` through oneDNN, ``packed`` from ``pack_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_is_faster(
    module: nn.Module, packed: torch.Tensor, choices: KernelChoices, repeats: int = 3
) -> bool:
    """One ``TUNE_ROWS`` batch through ``packed`` and through ``module``'s MKL path: whether
    the packed copy has the smaller median, as ``choices`` holds it or times it now. Leaves
    ``module`` without a packed copy."""
    module.weight_packed = None
    x = torch.full((TUNE_ROWS, module.weight.shape[0]), 0.5)
    in_features, out_features = module.weight.shape
    bias = "" if module.bias is None else " + bias"
    return choices.first_is_faster(
        f"oneDNN over MKL: {type(module).__name__} {in_features}x{out_features}{bias}",
        lambda: packed_matmul(x, packed, module.bias),
        lambda: module(x),
        repeats,
    )


def _available_memory() -> int | None:
    """Bytes of physical memory available now (Linux), or None where the OS does not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def attach(model: nn.Module, choices: KernelChoices) -> int:
    """Give every module of ``model`` with a ``weight_packed`` slot (each ``Linear``; fp32 on the
    CPU, weights loaded) a packed copy of its
    weight where oneDNN is faster for its shape (``choices``' answer); returns how many took
    one. Shapes are timed (where ``choices`` has no answer) once each, without touching the
    global RNG. None is packed where torch has no oneDNN, or where the copies would take more
    than half of the memory available."""
    if not onednn_available():
        return 0
    linears = [m for m in model.modules() if hasattr(m, "weight_packed")]

    def shape(module: nn.Module) -> tuple:
        return (type(module), *module.weight.shape, module.bias is None)

    faster: dict[tuple, bool] = {}
    packed: dict[int, torch.Tensor] = {}  # the copy each shape was timed with, by module
    for module in linears:
        if shape(module) not in faster:
            packed[id(module)] = pack_weight(module.weight.detach())
            faster[shape(module)] = _packed_is_faster(module, packed[id(module)], choices)
    chosen = [m for m in linears if faster[shape(m)]]
    needed = sum(m.weight.numel() * m.weight.element_size() for m in chosen)
    available = _available_memory()
    if available is not None and needed > available // 2:
        logger.warning(
            "oneDNN not used: packed weights (%.0f MB) would take more than half of the "
            "%.0f MB available; batches run through MKL",
            needed / 2**20, available / 2**20,
        )  # fmt: skip
        return 0
    for module in chosen:
        timed_copy = packed.get(id(module))
        module.weight_packed = (
            timed_copy if timed_copy is not None else pack_weight(module.weight.detach())
        )
    return len(chosen)
