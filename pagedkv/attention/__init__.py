"""Attention metadata, the paged KV cache write/read and the attention backends."""

from pagedkv.attention.backends import (
    AttentionBackend,
    available_attention_backends,
    get_attention_backend,
)
from pagedkv.attention.forward_context import ForwardContext
from pagedkv.attention.metadata import AttentionMetadata, DecodeBucket, PrefillChunk
from pagedkv.attention.paged_attention import GatherBuffer, paged_attention, reshape_and_cache

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "DecodeBucket",
    "ForwardContext",
    "GatherBuffer",
    "PrefillChunk",
    "available_attention_backends",
    "get_attention_backend",
    "paged_attention",
    "reshape_and_cache",
]
