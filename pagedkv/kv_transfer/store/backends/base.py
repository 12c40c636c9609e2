"""The store backend interface: batched calls, each bounded by a timeout.

Values travel as bytes-like objects (``put_many`` / ``get_many``) or, on the connector's hot
path, as rows of a numpy buffer the caller reuses (``put_from`` / ``get_into``): a backend whose
transport moves memory without copies (Mooncake) registers that buffer once
(``register_buffer``) and puts from or fetches into it directly; the others fall back on the
bytes-like calls with views of the rows, so nothing is copied there either.

``exists_all`` answers for sets of keys at once (a block's values, one per KV head): one
command per set where the store counts them (Redis's ``EXISTS k1 k2 ...``).

Every failure surfaces as ``StoreError``; ``StoreUnavailable`` (connection refused, timeout,
shared directory gone) also opens the backend's circuit breaker, so that for the next
``backoff`` seconds every call fails at once instead of each waiting for its own timeout.
The connector turns both into cache misses.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")


class StoreError(Exception):
    """A store call failed; its keys count as missing."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (or the circuit breaker is open)."""


class CircuitBreaker:
    """Closed until a ``StoreUnavailable``; then open for a backoff that doubles with each
    consecutive failure (``base_s`` .. ``max_s``). The first call after the backoff probes the
    store: success closes the breaker, failure reopens it."""

    def __init__(self, base_s: float = 0.25, max_s: float = 5.0) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self._lock = threading.Lock()
        self._num_failures = 0
        self._open_until = 0.0

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self._open_until

    def call(self, fn: Callable[[], T]) -> T:
        if self.is_open:
            raise StoreUnavailable(
                f"store unavailable; retrying in {self._open_until - time.monotonic():.2f}s"
            )
        try:
            result = fn()
        except StoreUnavailable:
            with self._lock:
                self._num_failures += 1
                backoff = min(self.base_s * 2 ** (self._num_failures - 1), self.max_s)
                self._open_until = time.monotonic() + backoff
            raise
        if self._num_failures:
            with self._lock:
                self._num_failures = 0
        return result


class StoreBackend(ABC):
    """Batched key-value calls. Implementations raise ``StoreUnavailable`` when the store cannot
    be reached and ``StoreError`` for any other failure; never anything else."""

    def __init__(self, ttl_s: float | None) -> None:
        #: Stored values expire after this many seconds (None: only the store's own eviction).
        self.ttl_s = ttl_s
        self.breaker = CircuitBreaker()

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return self.breaker.call(lambda: self._exists_many(keys))

    def exists_all(self, key_sets: Sequence[Sequence[str]]) -> list[bool]:
        """Per set of keys (a block's values, one per KV head): whether every key is stored."""
        if not key_sets:
            return []
        return self.breaker.call(lambda: self._exists_all(key_sets))

    def _exists_all(self, key_sets: Sequence[Sequence[str]]) -> list[bool]:
        exists = iter(self._exists_many([key for keys in key_sets for key in keys]))
        return [all([next(exists) for _ in keys]) for keys in key_sets]

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> None:
        if items:
            self.breaker.call(lambda: self._put_many(items))

    def get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        """Values in ``keys`` order, None where a key is missing. Values may be memoryviews
        into buffers the caller owns from then on."""
        if not keys:
            return []
        values = self.breaker.call(lambda: self._get_many(keys))
        if len(values) != len(keys):
            raise StoreError(f"{len(values)} values returned for {len(keys)} keys")
        return values

    def delete_many(self, keys: Sequence[str]) -> None:
        if keys:
            self.breaker.call(lambda: self._delete_many(keys))

    def register_buffer(self, buffer: np.ndarray) -> None:
        """``buffer`` (uint8, C-contiguous) will be put from and fetched into again and again,
        until ``unregister_buffer``. Nothing to do for a backend that moves bytes objects."""
        return None

    def unregister_buffer(self, buffer: np.ndarray) -> None:
        """Undo ``register_buffer`` (before the caller frees or replaces ``buffer``)."""
        return None

    def put_from(self, keys: Sequence[str], rows: np.ndarray) -> None:
        """Store ``rows[i]`` (one value per row of a 2-D uint8 array, best inside a registered
        buffer) under ``keys[i]``. The rows are only read, and only during the call."""
        if keys:
            assert rows.ndim == 2 and len(rows) == len(keys) and rows.flags.c_contiguous
            self.breaker.call(lambda: self._put_from(keys, rows))

    def get_into(self, keys: Sequence[str], rows: np.ndarray) -> list[Buffer | None]:
        """Like ``get_many``, with ``rows`` (2-D uint8, one row per key, each as long as the
        longest value expected) to fetch into: the values returned may be views of those rows
        (valid until the caller reuses them) or buffers of the backend's own."""
        if not keys:
            return []
        assert rows.ndim == 2 and len(rows) >= len(keys) and rows.flags.c_contiguous
        values = self.breaker.call(lambda: self._get_into(keys, rows))
        if len(values) != len(keys):
            raise StoreError(f"{len(values)} values returned for {len(keys)} keys")
        return values

    def _put_from(self, keys: Sequence[str], rows: np.ndarray) -> None:
        self._put_many([(key, memoryview(row)) for key, row in zip(keys, rows)])

    def _get_into(self, keys: Sequence[str], rows: np.ndarray) -> list[Buffer | None]:
        return self._get_many(keys)

    @abstractmethod
    def _exists_many(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def _put_many(self, items: Sequence[tuple[str, Buffer]]) -> None: ...

    @abstractmethod
    def _get_many(self, keys: Sequence[str]) -> list[Buffer | None]: ...

    @abstractmethod
    def _delete_many(self, keys: Sequence[str]) -> None: ...

    def close(self) -> None:
        return None
