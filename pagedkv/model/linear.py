"""A dense layer whose weight is stored input-major (``[in_features, out_features]``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedkv.model.cpu_onednn import packed_matmul

if TYPE_CHECKING:
    from pagedkv.model.cpu_gemv import CpuGemv


class Linear(nn.Module):
    """``y = x @ weight + bias`` for 2-D ``x``.

    Checkpoints store ``[out_features, in_features]``; ``load_weights`` copies them transposed.
    On CPU, the single-row product of a decode step runs about twice as fast against this layout
    as against the checkpoint's (measured with MKL on the LM head, 256 x 32000: 1.0 vs 2.2 ms),
    and faster still through the compiled GEMV (``cpu_gemv``) when it is attached. Batches go
    through oneDNN against a packed copy of the weight where ``cpu_onednn.attach`` timed that
    faster than MKL (on AMD CPUs about twice as fast), else through MKL.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        #: The compiled fp32 CPU GEMV (``cpu_gemv.attach``), used for one row; None: torch.
        self.cpu_gemv: CpuGemv | None = None
        #: The weight reordered for oneDNN (``cpu_onednn.attach``); None: MKL.
        self.weight_packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemv = self.cpu_gemv
        if gemv is not None and gemv.supports(x):
            return gemv.input_major(x, self.weight, self.bias)
        if self.weight_packed is not None:
            return packed_matmul(x, self.weight_packed, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)
