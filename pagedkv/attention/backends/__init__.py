"""Pluggable attention backends behind one registry."""

from pagedkv.attention.backends.base import AttentionBackend
from pagedkv.attention.backends.registry import available_attention_backends, get_attention_backend

__all__ = ["AttentionBackend", "available_attention_backends", "get_attention_backend"]
