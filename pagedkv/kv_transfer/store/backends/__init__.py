"""Store backends by URL scheme, imported on first use (each one's client stays optional)."""

from __future__ import annotations

import importlib

from pagedkv.kv_transfer.store.backends.base import (
    StoreBackend,
    StoreError,
    StoreUnavailable,
)
from pagedkv.kv_transfer.store.config import StoreConfig

# scheme -> "module:Class"; each class is built as ``Class(config, lookups_only)``.
_BACKENDS = {
    "redis": "pagedkv.kv_transfer.store.backends.redis_backend:RedisBackend",
    "rediss": "pagedkv.kv_transfer.store.backends.redis_backend:RedisBackend",
    "redis+cluster": "pagedkv.kv_transfer.store.backends.redis_backend:RedisBackend",
    "rediss+cluster": "pagedkv.kv_transfer.store.backends.redis_backend:RedisBackend",
    "file": "pagedkv.kv_transfer.store.backends.file_backend:FileBackend",
    "mooncake": "pagedkv.kv_transfer.store.backends.mooncake_backend:MooncakeBackend",
}


def create_backend(config: StoreConfig, lookups_only: bool = False) -> StoreBackend:
    """``lookups_only``: the caller only checks which keys exist (the scheduler half), so a
    backend whose clients lend memory to the store (Mooncake) lends none for it."""
    module, cls = _BACKENDS[config.scheme].split(":")
    return getattr(importlib.import_module(module), cls)(config, lookups_only)


__all__ = ["StoreBackend", "StoreError", "StoreUnavailable", "create_backend"]
