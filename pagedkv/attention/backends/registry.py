"""Attention backends by name, imported on first use so a CPU-only install never loads GPU code."""

from __future__ import annotations

import importlib

from pagedkv.attention.backends.base import AttentionBackend

_BACKENDS: dict[str, str] = {
    "torch": "pagedkv.attention.backends.torch_backend:TorchAttentionBackend",
}


def available_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """Return a new instance of the backend registered as ``name``."""
    target = _BACKENDS.get(name)
    if target is None:
        raise ValueError(
            f"unknown attention backend {name!r}; available: "
            + ", ".join(available_attention_backends())
        )
    module_name, class_name = target.split(":")
    backend_cls: type[AttentionBackend] = getattr(importlib.import_module(module_name), class_name)
    return backend_cls()
