"""The disk tier's data plane: a local directory of block values in the store's format.

Values are written, read and deleted through the store's ``FileBackend`` (``backend``): one
file per KV head of a block (``block_codec.head_key``: any TP size's ranks write and read the
same files), ``<root>/<h[:2]>/<h>.kv`` with ``h`` the xxh3-128 of the value's key, each file
a whole value (256-byte header with key and checksum, then the payload), made visible
atomically (temporary ``.*.tmp`` file, then rename). So a reader finds a whole value or none,
and ``decode_value`` rejects any file damaged since.

After a restart, ``scan`` rebuilds the tier's contents from the files' headers alone. Several
models may share one directory: each sees only the files of its own fingerprint. The directory
belongs to one engine: ``scan`` deletes every leftover temporary file it finds.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pagedkv.kv_transfer.store.backends.base import StoreError
from pagedkv.kv_transfer.store.backends.file_backend import FileBackend
from pagedkv.kv_transfer.store.block_codec import HEADER_SIZE, read_header, split_head_key
from pagedkv.kv_transfer.store.config import StoreConfig

#: Length of the hex digest prefix naming the backend's subdirectories.
_SUBDIR_NAME_LEN = 2


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def _unlink_quietly(path: Path) -> None:
    """Best effort: a file scan cannot delete stays, and the scan goes on."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


class DiskStore:
    """The value files of one model (``model_fingerprint``) under ``root``."""

    def __init__(self, root: Path, model_fingerprint: str, fsync: bool = False) -> None:
        """Creates ``root`` (mode 0o700) if missing. ``StoreError`` naming the directory if it
        cannot be created or written: the caller then runs without a disk tier."""
        self.root = Path(root).absolute()
        self.key_prefix = f"pagedkv:{model_fingerprint}:"
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.root, prefix=".", suffix=".tmp")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise StoreError(f"disk tier: cannot use directory {self.root}: {e}") from e
        self.backend = FileBackend(StoreConfig(store_url=self.root.as_uri(), fsync=fsync))

    def scan(self) -> list[tuple[str, int, float]]:
        """``(key, value bytes, mtime)`` of every value file of this model, oldest first, read
        from the headers only. Deletes leftover temporary files and this model's files whose
        size disagrees with their header (cut short: they could never load). Skips any other
        file; only an unreadable ``root`` raises (``StoreError``)."""
        entries = []
        for path in self._files(delete_temps=True):
            found = self._own_file(path)
            if found is None:
                continue
            key, value_size, stat = found
            if stat.st_size == value_size:
                entries.append((key, value_size, stat.st_mtime))
            else:
                _unlink_quietly(path)
        entries.sort(key=lambda entry: entry[2])
        return entries

    def usage_bytes(self) -> int:
        """Bytes of this model's value files on disk now."""
        total = 0
        for path in self._files(delete_temps=False):
            found = self._own_file(path)
            if found is not None:
                total += found[2].st_size
        return total

    def _files(self, delete_temps: bool) -> Iterator[Path]:
        """The path of each candidate value file in the backend's subdirectories."""
        try:
            subdirs = [entry for entry in os.scandir(self.root) if entry.is_dir()]
        except OSError as e:
            raise StoreError(f"disk tier: cannot read directory {self.root}: {e}") from e
        for subdir in subdirs:
            if len(subdir.name) != _SUBDIR_NAME_LEN:
                continue
            try:
                names = os.listdir(subdir.path)
            except OSError:
                continue
            for name in names:
                path = Path(subdir.path, name)
                if _is_temp(name):
                    if delete_temps:
                        _unlink_quietly(path)
                elif name.endswith(".kv"):
                    yield path

    def _is_own_key(self, key: str) -> bool:
        """``pagedkv:<this fingerprint>:g<group>:<hash>:h<head>``: a fingerprint ``a`` must not
        claim the keys of a fingerprint ``a:b``."""
        rest = key[len(self.key_prefix) :] if key.startswith(self.key_prefix) else ""
        return rest.startswith("g") and rest.count(":") == 2 and split_head_key(key) is not None

    def _own_file(self, path: Path) -> tuple[str, int, os.stat_result] | None:
        """``(key, value size its header names, stat)`` if ``path`` is a value file of this
        model where a load of its key looks; None for any other file."""
        try:
            with open(path, "rb") as f:
                header = f.read(HEADER_SIZE)
                stat = os.fstat(f.fileno())
        except OSError:
            return None
        parsed = read_header(header)
        if parsed is None or not self._is_own_key(parsed[0]):
            return None
        key, payload_size = parsed
        if self.backend.path_of(key) != path:
            return None
        return key, HEADER_SIZE + payload_size, stat
