"""The Triton attention backend: one kernel launch per layer for the whole mixed batch."""

from __future__ import annotations

import torch

from pagedkv.attention.backends.base import AttentionBackend
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.triton_paged_attention import triton_paged_attention
from pagedkv.attention.triton_reshape_and_cache import check_device, triton_reshape_and_cache


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    reshape_and_cache = staticmethod(triton_reshape_and_cache)

    def check_device(self, device: torch.device) -> None:
        check_device(device)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return triton_paged_attention(query, kv_cache, metadata, scale)
