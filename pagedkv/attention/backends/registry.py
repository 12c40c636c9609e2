"""Attention backends by name, imported on first use so a CPU-only install never loads GPU code."""

from __future__ import annotations

import importlib
from typing import NamedTuple

from pagedkv.attention.backends.base import AttentionBackend


class _BackendEntry(NamedTuple):
    target: str  # "module:Class"
    extra: str | None = None  # the pip extra that installs the backend's dependencies


_BACKENDS: dict[str, _BackendEntry] = {
    "torch": _BackendEntry("pagedkv.attention.backends.torch_backend:TorchAttentionBackend"),
    "triton": _BackendEntry(
        "pagedkv.attention.backends.triton_backend:TritonAttentionBackend", extra="gpu"
    ),
}


def available_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """Return a new instance of the backend registered as ``name``."""
    entry = _BACKENDS.get(name)
    if entry is None:
        raise ValueError(
            f"unknown attention backend {name!r}; available: "
            + ", ".join(available_attention_backends())
        )
    module_name, class_name = entry.target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if entry.extra is None or missing in ("", "pagedkv"):
            raise
        raise ImportError(
            f"attention backend {name!r} needs the {missing!r} package: "
            f"pip install 'pagedkv[{entry.extra}]'"
        ) from e
    backend_cls: type[AttentionBackend] = getattr(module, class_name)
    return backend_cls()
