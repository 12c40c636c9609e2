"""LowerTier: a tier below host memory (the disk tier's directory, or a remote store) as the
worker half uses it: its store backend, one writer thread, and a fetcher per load thread.

Values are the store's (``store/block_codec.py``: key, length and checksum in a header), so
what one instance wrote another reads, and a value that does not verify is a miss.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from pagedkv.kv_transfer.offload.stats import TierIOCounters
from pagedkv.kv_transfer.store.backends import StoreBackend
from pagedkv.kv_transfer.store.head_layout import HeadLayout
from pagedkv.kv_transfer.store.loader import BlockFetcher
from pagedkv.kv_transfer.store.recent_keys import RecentKeys
from pagedkv.kv_transfer.store.stats import StoreStats
from pagedkv.kv_transfer.store.writer import BlockWriter


class LowerTier:
    def __init__(
        self,
        name: str,
        backend: StoreBackend,
        max_queued_bytes: int,
        on_stored: Callable[[list[str], bool], None],
    ) -> None:
        self.name = name
        self.backend = backend
        self.recent_keys = RecentKeys()
        self.write_stats = StoreStats()
        self.writer = BlockWriter(
            backend,
            self.write_stats,
            self.recent_keys,
            max_queued_bytes,
            on_stored,
            background=True,
        )
        self.num_backpressured = 0
        self._local = threading.local()
        #: Each fetcher's stats (one writer thread each), summed when read.
        self._fetch_stats: list[StoreStats] = []
        self._lock = threading.Lock()

    def fetcher(
        self, layouts: Sequence[HeadLayout], kv_caches: Sequence[torch.Tensor]
    ) -> BlockFetcher:
        """The calling load thread's fetcher (each has its own receive buffer)."""
        fetcher = getattr(self._local, "fetcher", None)
        if fetcher is None:
            stats = StoreStats()
            with self._lock:
                self._fetch_stats.append(stats)
            fetcher = BlockFetcher(self.backend, layouts, kv_caches, stats, self.recent_keys)
            self._local.fetcher = fetcher
        return fetcher

    def counters(self) -> TierIOCounters:
        with self._lock:
            fetched = list(self._fetch_stats)
        return TierIOCounters(
            num_bytes_in=self.write_stats.num_bytes_put,
            num_bytes_out=sum(s.num_bytes_loaded for s in fetched),
            num_stores_backpressured=self.num_backpressured,
            num_store_failures=self.write_stats.num_put_failures,
            num_load_misses=sum(s.num_load_invalid - s.num_load_cancelled for s in fetched),
        )

    def close(self) -> None:
        self.writer.close()
        self.backend.close()
