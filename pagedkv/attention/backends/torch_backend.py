"""The torch attention backend: runs everywhere, the CPU production path."""

from __future__ import annotations

import torch

from pagedkv.attention.backends.base import AttentionBackend
from pagedkv.attention.cpu_paged_attention import CpuAttentionKernels, load_cpu_attention
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged_attention import GatherBuffer, paged_attention, reshape_and_cache


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    reshape_and_cache = staticmethod(reshape_and_cache)

    def __init__(self) -> None:
        self._buffer = GatherBuffer()
        self._kernels: CpuAttentionKernels | None = None

    def load_kernels(self, device: torch.device) -> None:
        """On CPU, the compiled decode and prefill kernels (the gather + SDPA path when they
        cannot be built)."""
        if device.type == "cpu":
            self._kernels = load_cpu_attention()

    def check_device(self, device: torch.device) -> None:
        """Any device torch runs on."""

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        kernels = self._kernels if kv_cache.is_cpu else None
        return paged_attention(query, kv_cache, metadata, scale, self._buffer, kernels)
