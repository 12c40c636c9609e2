"""The torch attention backend: runs everywhere, the CPU production path."""

from __future__ import annotations

import torch

from pagedkv.attention.backends.base import AttentionBackend
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged_attention import GatherBuffer, paged_attention, reshape_and_cache


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    reshape_and_cache = staticmethod(reshape_and_cache)

    def __init__(self) -> None:
        self._buffer = GatherBuffer()

    def check_device(self, device: torch.device) -> None:
        """Any device torch runs on."""

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention(query, kv_cache, metadata, scale, self._buffer)
