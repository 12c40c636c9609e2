"""SiLU-and-mul: the gated MLP's activation over the fused gate/up projection's output."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedkv.model.cpu_layer_ops import CpuLayerOps


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` (``[num_tokens, 2 * intermediate_size]``)."""

    def __init__(self) -> None:
        super().__init__()
        #: The compiled fp32 CPU ops (``cpu_layer_ops.attach``); None: torch ops.
        self.cpu_ops: CpuLayerOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None:
            return self.cpu_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
