"""Mooncake Store (kvcache-ai/Mooncake) through its Python client, when it is installed.

``mooncake://<master host>:<port>`` (the master service, default port 50051), with the client's
``setup()`` arguments in ``kv_connector_extra_config.mooncake``::

    {"store_url": "mooncake://10.0.0.5:50051",
     "mooncake": {"local_hostname": "10.0.0.7", "metadata_server": "P2PHANDSHAKE",
                  "global_segment_size": 3355443200, "local_buffer_size": 1073741824,
                  "protocol": "tcp", "device_name": ""}}

Install ``mooncake-transfer-engine`` and run ``mooncake_master``. Calls map onto the client's
batch API: ``batch_is_exist`` (1 / 0 / -1 per key), ``put_batch`` (0 = ok), ``get_batch``
(empty bytes for a missing key), ``remove``. Mooncake has no per-key TTL: ``ttl_s`` is rejected;
the master evicts (approximate LRU at its high watermark) and evicted blocks become misses.
Objects are immutable once put; a put racing another instance's put of the same key fails and
is counted, which is harmless (equal keys mean equal KV). The client's exceptions are not
documented: any it raises is a ``StoreError`` (``StoreUnavailable`` from ``setup()``).

Not exercised against a real Mooncake by the test suite (none here; a stand-in client checks
the error mapping); written against the documented client API.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pagedkv.kv_transfer.store.backends.base import (
    Buffer,
    StoreBackend,
    StoreError,
    StoreUnavailable,
)
from pagedkv.kv_transfer.store.config import StoreConfig

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_SETUP: dict[str, Any] = {
    "local_hostname": "127.0.0.1",
    "metadata_server": "P2PHANDSHAKE",
    "global_segment_size": 3355443200,
    "local_buffer_size": 1073741824,
    "protocol": "tcp",
    "device_name": "",
}


def _store_errors(method: F) -> F:
    """A call through the client (and the check of its answer): any exception is a
    StoreError, so that it is a miss."""

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except StoreError:
            raise
        except Exception as e:
            raise StoreError(f"mooncake: {type(e).__name__}: {e}") from e

    return wrapped  # type: ignore[return-value]


class MooncakeBackend(StoreBackend):
    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config.ttl_s)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ValueError(
                "store_url mooncake:// needs Mooncake's Python client: "
                "pip install mooncake-transfer-engine"
            ) from e
        if config.ttl_s is not None:
            raise ValueError("the mooncake backend has no per-key TTL: leave ttl_s unset")
        unknown = sorted(set(config.mooncake) - set(DEFAULT_SETUP))
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config.mooncake option(s) {unknown}; "
                f"known: {sorted(DEFAULT_SETUP)}"
            )
        url = urlsplit(config.store_url)
        self._setup = {**DEFAULT_SETUP, **config.mooncake}
        self._master = f"{url.hostname}:{url.port or 50051}"
        self._store = MooncakeDistributedStore()
        self._ready = False
        self._lock = threading.Lock()

    def _client(self):
        """Set the client up on first use, so a master that is down at startup is a miss."""
        with self._lock:
            if not self._ready:
                s = self._setup
                try:
                    rc = self._store.setup(
                        s["local_hostname"],
                        s["metadata_server"],
                        s["global_segment_size"],
                        s["local_buffer_size"],
                        s["protocol"],
                        s["device_name"],
                        self._master,
                    )
                except Exception as e:
                    raise StoreUnavailable(
                        f"mooncake: setup with master {self._master}: {e}"
                    ) from e
                if rc != 0:
                    raise StoreUnavailable(f"mooncake: setup with master {self._master} -> {rc}")
                self._ready = True
        return self._store

    @_store_errors
    def _exists_many(self, keys: Sequence[str]) -> list[bool]:
        codes = self._client().batch_is_exist(list(keys))
        if len(codes) != len(keys) or any(c < 0 for c in codes):
            raise StoreError(f"mooncake: batch_is_exist -> {codes[:8]}")
        return [c == 1 for c in codes]

    @_store_errors
    def _put_many(self, items: Sequence[tuple[str, Buffer]]) -> None:
        rc = self._client().put_batch([k for k, _ in items], [v for _, v in items])
        codes = rc if isinstance(rc, list) else [rc]  # one code, or one per key
        if any(code != 0 for code in codes):
            raise StoreError(f"mooncake: put_batch -> {codes[:8]}")

    @_store_errors
    def _get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        values = self._client().get_batch(list(keys))
        if len(values) != len(keys):
            raise StoreError(f"mooncake: get_batch returned {len(values)} values")
        return [v if len(v) else None for v in values]

    @_store_errors
    def _delete_many(self, keys: Sequence[str]) -> None:
        client = self._client()
        for key in keys:
            client.remove(key)

    def close(self) -> None:
        with self._lock:
            if self._ready:
                self._store.close()
                self._ready = False
