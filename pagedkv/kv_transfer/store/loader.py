"""Loading stored blocks into the paged cache: ``BlockFetcher`` (fetch, verify, scatter) and
``BlockLoader`` (a background thread running async loads one request at a time).

A block is fetched as the values of every KV head this rank holds (``HeadLayout.read_keys``),
whatever TP size wrote them. Every block of a load ends either loaded or in the returned invalid
set: a value missing (evicted or expired since the existence check, or never written), corrupt
(bad header, wrong key, wrong length, checksum mismatch), failed (store down, timeout) or
cancelled. A corrupt value is also deleted from the store, so the instance that recomputes the
block can write it again.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pagedkv.kv_transfer.store.backends.base import StoreBackend, StoreError
from pagedkv.kv_transfer.store.block_codec import HEADER_SIZE, CorruptValue, decode_value
from pagedkv.kv_transfer.store.head_layout import HeadLayout
from pagedkv.kv_transfer.store.metadata import BlockRef, StoreLoad
from pagedkv.kv_transfer.store.recent_keys import RecentKeys
from pagedkv.kv_transfer.store.stats import StoreStats
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)
_failures = RateLimitedLog(logger)

#: Blocks per ``get_into`` call: bounds the memory one call holds (64 MiB at 2 MiB per block).
GET_BATCH_BLOCKS = 32


class BlockFetcher:
    def __init__(
        self,
        backend: StoreBackend,
        layouts: Sequence[HeadLayout],
        kv_caches: Sequence[torch.Tensor],
        stats: StoreStats,
        recent_keys: RecentKeys,
    ) -> None:
        self.backend = backend
        self.layouts = layouts
        self.kv_caches = kv_caches
        self.stats = stats
        self.recent_keys = recent_keys
        #: Where a zero-copy backend fetches a batch: one row per value, as long as the longest
        #: value (allocated once, so pages are touched only by a backend that writes them).
        num_values = GET_BATCH_BLOCKS * max(len(layout.heads.read) for layout in layouts)
        payload_size = max(layout.payload_size for layout in layouts)
        self.rows = np.empty((num_values, HEADER_SIZE + payload_size), dtype=np.uint8)
        #: Where verified payloads are gathered before they are scattered into the cache.
        self.staging = np.empty((num_values, payload_size), dtype=np.uint8)
        backend.register_buffer(self.rows)

    def load(
        self, blocks: Sequence[BlockRef], is_cancelled: Callable[[], bool] = lambda: False
    ) -> set[int]:
        """Load ``blocks`` into the cache; returns the ids of those that were not loaded."""
        invalid: set[int] = set()
        for start in range(0, len(blocks), GET_BATCH_BLOCKS):
            invalid |= self._load_chunk(blocks[start : start + GET_BATCH_BLOCKS], is_cancelled)
        return invalid

    def _load_chunk(self, chunk: Sequence[BlockRef], is_cancelled: Callable[[], bool]) -> set[int]:
        stats = self.stats
        if is_cancelled():
            stats.num_load_cancelled += len(chunk)
            return {ref.block_id for ref in chunk}
        value_keys = [self.layouts[ref.group_id].read_keys([ref.key]) for ref in chunk]
        try:
            values = self.backend.get_into([k for keys in value_keys for k in keys], self.rows)
        except StoreError as e:
            stats.num_load_errors += len(chunk)
            _failures.warning(
                "fetch", "store: %d blocks not fetched (computing them): %s", len(chunk), e
            )
            return {ref.block_id for ref in chunk}
        if is_cancelled():  # cancelled while fetching: nothing more lands in the blocks
            stats.num_load_cancelled += len(chunk)
            return {ref.block_id for ref in chunk}
        invalid: set[int] = set()
        corrupt: list[str] = []
        verified: dict[int, tuple[list[int], list[memoryview]]] = {}
        position = 0
        for ref, keys in zip(chunk, value_keys):
            block_values = values[position : position + len(keys)]
            position += len(keys)
            payloads = self._verify(ref, keys, block_values, corrupt)
            if payloads is None:
                invalid.add(ref.block_id)
                continue
            ids, group_payloads = verified.setdefault(ref.group_id, ([], []))
            ids.append(ref.block_id)
            group_payloads.extend(payloads)
        for group_id, (ids, payloads) in verified.items():
            self.layouts[group_id].unpack(self.kv_caches, ids, payloads, self.staging)
            stats.num_blocks_loaded += len(ids)
            stats.num_bytes_loaded += len(payloads) * self.layouts[group_id].payload_size
        self.recent_keys.add_many(ref.key for ref in chunk if ref.block_id not in invalid)
        if corrupt:
            self._discard(corrupt)
        return invalid

    def _verify(
        self, ref: BlockRef, keys: list[str], values: Sequence, corrupt: list[str]
    ) -> list[memoryview] | None:
        """The payloads of a block's values (one per head), or None (counted) if one is
        missing or corrupt (those go to ``corrupt``)."""
        if any(value is None for value in values):
            self.stats.num_load_missing += 1
            return None
        payload_size = self.layouts[ref.group_id].payload_size
        payloads = []
        for key, value in zip(keys, values):
            try:
                payloads.append(decode_value(key, value, payload_size))
            except CorruptValue as e:
                _failures.warning("corrupt", "store: discarding the value of %s: %s", key, e)
                corrupt.append(key)
        if len(payloads) < len(keys):
            self.stats.num_load_corrupt += 1
            self.recent_keys.discard_many([ref.key])
            return None
        return payloads

    def _discard(self, corrupt: list[str]) -> None:
        try:
            self.backend.delete_many(corrupt)
        except StoreError as e:
            _failures.warning("delete", "store: could not delete corrupt values: %s", e)


class BlockLoader:
    """Runs async loads in submission order. Each ends exactly once, in ``take_finished``,
    together with its invalid blocks; a cancelled load stops at the next batch boundary."""

    def __init__(self, fetcher: BlockFetcher) -> None:
        self.fetcher = fetcher
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._cancelled: set[str] = set()
        self._finished: set[str] = set()
        self._invalid: set[int] = set()
        self._queue: queue.SimpleQueue[StoreLoad | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pagedkv-store-loader", daemon=True)
        self._thread.start()

    def submit(self, spec: StoreLoad) -> None:
        with self._lock:
            self._pending.add(spec.req_id)
        self._queue.put(spec)

    def cancel(self, req_id: str) -> None:
        with self._lock:
            if req_id in self._pending:
                self._cancelled.add(req_id)

    def take_finished(self) -> tuple[set[str], set[int]]:
        with self._lock:
            finished, self._finished = self._finished, set()
            invalid, self._invalid = self._invalid, set()
        return finished, invalid

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._cancelled |= self._pending
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (spec := self._queue.get()) is not None:
            invalid: set[int] = set()
            try:
                invalid = self.fetcher.load(spec.blocks, lambda: spec.req_id in self._cancelled)
            except Exception:  # a bug here must still end the load, or the request waits
                logger.exception("store loader: unexpected error")
                invalid = {ref.block_id for ref in spec.blocks}
            finally:
                with self._lock:
                    self._pending.discard(spec.req_id)
                    self._cancelled.discard(spec.req_id)
                    self._finished.add(spec.req_id)
                    self._invalid |= invalid
