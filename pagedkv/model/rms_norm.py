"""RMSNorm as Llama-family checkpoints define it (normalise in fp32, then scale), with vLLM's
fused residual add."""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedkv.model.cpu_layer_ops import CpuLayerOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        #: The compiled fp32 CPU ops (``cpu_layer_ops.attach``); None: torch ops.
        self.cpu_ops: CpuLayerOps | None = None

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``rms_norm(x)``; with ``residual``, ``(rms_norm(x + residual), x + residual)``, the
        residual stream's next value alongside. The compiled ops reuse ``x`` and ``residual``
        for these two results (both are the caller's to give up)."""
        ops = self.cpu_ops
        if residual is None:
            return self._norm(x) if ops is None else ops.rms_norm(x, self.weight, self.eps)
        if ops is not None:
            ops.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # 16-bit: transformers' roundings (normalise in fp32, round, then scale in 16 bits), so
        # bf16 greedy outputs match theirs.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
