"""A directory (local or on shared storage) as the store: one file per value.

``file:///path/to/dir``. A key's file is ``<dir>/<h[:2]>/<h>.kv`` with ``h`` the xxh3-128 hex of
the key: safe on every filesystem, and a name collision cannot load wrong KV because each value
carries its key (checked on load). A value appears atomically: it is written to a temporary file
in the same directory (optionally fsynced) and renamed over the final name, so a reader sees
the old value, the new one, or none, never a partial file.

``ttl_s`` makes files older than that count as missing (their mtime is the put time); reclaim
their space with e.g. ``find DIR -name '*.kv' -mmin +60 -delete`` from cron.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import xxhash

from pagedkv.kv_transfer.store.backends.base import (
    Buffer,
    StoreBackend,
    StoreError,
    StoreUnavailable,
)
from pagedkv.kv_transfer.store.config import StoreConfig

_STORE_FULL = (errno.ENOSPC, errno.EDQUOT)


def _as_store_error(e: OSError) -> StoreError:
    if e.errno in _STORE_FULL:
        return StoreError(f"file store: {e}")
    return StoreUnavailable(f"file store: {e}")


class FileBackend(StoreBackend):
    def __init__(self, config: StoreConfig, lookups_only: bool = False) -> None:
        """``lookups_only`` changes nothing here (see ``create_backend``)."""
        super().__init__(config.ttl_s)
        self.root = Path(unquote(urlsplit(config.store_url).path))
        self.fsync = config.fsync

    def path_of(self, key: str) -> Path:
        digest = xxhash.xxh3_128_hexdigest(key.encode())
        return self.root / digest[:2] / f"{digest}.kv"

    def _is_fresh(self, mtime: float) -> bool:
        return self.ttl_s is None or time.time() - mtime < self.ttl_s

    def _exists_many(self, keys: Sequence[str]) -> list[bool]:
        found = []
        for key in keys:
            try:
                found.append(self._is_fresh(self.path_of(key).stat().st_mtime))
            except FileNotFoundError:
                found.append(False)
            except OSError as e:
                raise _as_store_error(e) from e
        return found

    def _put_many(self, items: Sequence[tuple[str, Buffer]]) -> None:
        for key, value in items:
            path = self.path_of(key)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
            except OSError as e:
                raise _as_store_error(e) from e
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(value)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as e:
                Path(tmp).unlink(missing_ok=True)
                raise _as_store_error(e) from e

    def _get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        values: list[Buffer | None] = []
        for key in keys:
            try:
                with open(self.path_of(key), "rb") as f:
                    stat = os.fstat(f.fileno())
                    if not self._is_fresh(stat.st_mtime):
                        values.append(None)
                        continue
                    buffer = bytearray(stat.st_size)
                    num_read = f.readinto(buffer)
                    values.append(memoryview(buffer)[:num_read])
            except FileNotFoundError:
                values.append(None)
            except OSError as e:
                raise _as_store_error(e) from e
        return values

    def _get_into(self, keys: Sequence[str], rows: np.ndarray) -> list[Buffer | None]:
        """Each value read straight into its row: no allocation (and no page faults) per value.
        A file longer than its row is read up to the row's end; the value's checks decide."""
        values: list[Buffer | None] = []
        for key, row in zip(keys, rows):
            try:
                with open(self.path_of(key), "rb", buffering=0) as f:
                    if not self._is_fresh(os.fstat(f.fileno()).st_mtime):
                        values.append(None)
                        continue
                    view = memoryview(row)
                    values.append(view[: f.readinto(view)])
            except FileNotFoundError:
                values.append(None)
            except OSError as e:
                raise _as_store_error(e) from e
        return values

    def _delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            try:
                self.path_of(key).unlink(missing_ok=True)
            except OSError as e:
                raise _as_store_error(e) from e
