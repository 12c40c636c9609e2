"""OffloadingConnectorWorker: the worker half of the tiered KV cache. Copies this step's
completed blocks into the host tier and snapshots them for the lower tiers' writers
(``wait_for_save``), runs loads on up to ``max_parallel_loads`` threads (``start_load_kv``),
and reports what ended (``get_finished``).

Every load ends exactly once, in ``finished_recving``, with the blocks it could not fill in
``invalid_block_ids`` (the scheduler recomputes them) and the tier entries found bad in the
``OffloadReport``. Every store the scheduler planned is reported once, stored or not.

Tensor parallelism: a rank's host tier holds its own KV heads of each block (the same slots on
every rank); to the lower tiers it writes the heads no lower rank holds and reads every head it
holds (``HeadLayout``). A rank that writes no head of a block reports its store done at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pagedkv.distributed.shard import SINGLE_LAYOUT, TPLayout
from pagedkv.kv_connector.base import KVConnectorWorker
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer.offload.config import OffloadingConfig, TierConfig
from pagedkv.kv_transfer.offload.disk_store import DiskStore
from pagedkv.kv_transfer.offload.host_buffer import HostBuffer
from pagedkv.kv_transfer.offload.lower_tier import LowerTier
from pagedkv.kv_transfer.offload.metadata import (
    OffloadingMetadata,
    OffloadLoad,
    OffloadReport,
    TierBlock,
)
from pagedkv.kv_transfer.offload.stats import TierIOCounters
from pagedkv.kv_transfer.offload.tier_sizes import payload_bytes, tier_capacity_blocks
from pagedkv.kv_transfer.store.backends import StoreBackend, StoreError, create_backend
from pagedkv.kv_transfer.store.block_layout import GroupLayout
from pagedkv.kv_transfer.store.connector import num_kv_heads
from pagedkv.kv_transfer.store.head_layout import HeadLayout
from pagedkv.kv_transfer.store.metadata import BlockRef
from pagedkv.kv_transfer.store.writer import PutJob

logger = logging.getLogger(__name__)


class OffloadingConnectorWorker(KVConnectorWorker):
    signals_progress = True

    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache_config,
        model_fingerprint: str,
        tp: TPLayout = SINGLE_LAYOUT,
    ) -> None:
        super().__init__(config, kv_cache_config, model_fingerprint, tp)
        self.offload_config = OffloadingConfig.from_extra_config(config.kv_connector_extra_config)
        self.host: HostBuffer | None = None
        self.host_counters = TierIOCounters()
        self.lower: dict[str, LowerTier] = {}
        heads = num_kv_heads(kv_cache_config, tp)
        for tier in self.offload_config.tiers:
            if tier.medium == "cpu":
                capacity = tier_capacity_blocks(tier, kv_cache_config, heads)
                self.host = HostBuffer(capacity, payload_bytes(kv_cache_config))
                continue
            backend = self._open_backend(tier)
            if backend is not None:
                on_stored = self._on_stored_callback(tier.medium)
                self.lower[tier.medium] = LowerTier(
                    tier.medium, backend, self.offload_config.write_queue_bytes, on_stored
                )
        self._lock = threading.Lock()
        self._report = OffloadReport()
        self._finished: set[str] = set()
        self._invalid: set[int] = set()
        #: Loads submitted and not ended yet, and those of them cancelled.
        self._pending: set[str] = set()
        self._cancelled: set[str] = set()
        self._loads = ThreadPoolExecutor(
            self.offload_config.max_parallel_loads, thread_name_prefix="pagedkv-offload-load"
        )

    def _open_backend(self, tier: TierConfig) -> StoreBackend | None:
        if tier.medium == "remote":
            assert tier.store is not None
            return create_backend(tier.store)
        assert tier.path is not None
        try:
            return DiskStore(Path(tier.path), self.model_fingerprint, tier.fsync).backend
        except StoreError as e:
            logger.warning("disk tier %s unusable, running without it: %s", tier.path, e)
            return None

    def _on_stored_callback(self, tier: str):
        def on_stored(keys: list[str], ok: bool) -> None:
            with self._lock:
                self._report.stores.extend((tier, key, ok) for key in keys)

        return on_stored

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layer_groups: list[int]) -> None:
        super().register_kv_caches(kv_caches, layer_groups)
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        #: The host tier's (this rank's whole blocks) and the lower tiers' (per KV head).
        self.layouts = [
            GroupLayout.of_group(gid, layer_groups, kv_caches) for gid in range(num_groups)
        ]
        self.head_layouts = HeadLayout.of_groups(self.tp, kv_caches, layer_groups, num_groups)

    @property
    def _meta(self) -> OffloadingMetadata:
        assert isinstance(self._metadata, OffloadingMetadata)
        return self._metadata

    # ------------------------------------------------------------------ loads
    def start_load_kv(self) -> None:
        meta = self._meta
        for tier, keys in meta.deletes.items():
            if tier in self.lower:
                self.lower[tier].writer.submit_delete(keys, self.head_layouts[0].write_keys(keys))
        with self._lock:
            self._pending.update(load.req_id for load in meta.loads)
            self._cancelled.update(self._pending.intersection(meta.cancels))
        for load in meta.loads:
            self._loads.submit(self._run_load, load, time.monotonic())

    def _run_load(self, load: OffloadLoad, submitted_at: float) -> None:
        """One request's load, on a load thread; ends it whatever happens."""
        invalid: set[int] = set()
        bad: list[tuple[str, str]] = []
        stores: list[tuple[str, str, bool]] = []
        try:
            for tier, blocks in load.blocks.items():
                invalid |= self._load_from(tier, blocks, load.req_id, bad)
            stores = self._promote(load.promotions, invalid)
        except Exception:  # a bug here must still end the load, or the request waits forever
            logger.exception("offload load of %s: unexpected error", load.req_id)
            invalid = {b.block_id for blocks in load.blocks.values() for b in blocks}
            stores = [("cpu", b.key, False) for b in load.promotions]
        with self._lock:
            self._pending.discard(load.req_id)
            self._cancelled.discard(load.req_id)
            self._finished.add(load.req_id)
            self._invalid |= invalid
            self._report.bad.extend(bad)
            self._report.stores.extend(stores)
            self._report.load_seconds[load.req_id] = time.monotonic() - submitted_at
        self.notify_progress()

    def _is_cancelled(self, req_id: str) -> bool:
        return req_id in self._cancelled

    def _load_from(
        self, tier: str, blocks: list[TierBlock], req_id: str, bad: list[tuple[str, str]]
    ) -> set[int]:
        """Fill ``blocks`` from ``tier``; the ids not filled. Bad entries go to ``bad``."""
        if self._is_cancelled(req_id):
            return {b.block_id for b in blocks}
        if tier == "cpu":
            assert self.host is not None
            for group_id, group_blocks in _by_group(blocks).items():
                slots = [b.slot for b in group_blocks]
                ids = [b.block_id for b in group_blocks]
                self.host.load(self.layouts[group_id], self.kv_caches, ids, slots)  # type: ignore[arg-type]
                self.host_counters.num_bytes_out += len(ids) * self.layouts[group_id].payload_size
            return set()
        lower = self.lower.get(tier)
        if lower is None:
            bad.extend((tier, b.key) for b in blocks)
            return {b.block_id for b in blocks}
        fetcher = lower.fetcher(self.head_layouts, self.kv_caches)
        refs = [BlockRef(b.group_id, b.block_id, b.key) for b in blocks]
        invalid = fetcher.load(refs, lambda: self._is_cancelled(req_id))
        if invalid and not self._is_cancelled(req_id):
            bad.extend((tier, b.key) for b in blocks if b.block_id in invalid)
        return invalid

    def _promote(
        self, promotions: list[TierBlock], invalid: set[int]
    ) -> list[tuple[str, str, bool]]:
        """Copy blocks loaded from a lower tier into their reserved host slots."""
        stores = [("cpu", b.key, False) for b in promotions if b.block_id in invalid]
        good = [b for b in promotions if b.block_id not in invalid]
        if self.host is not None:
            for group_id, group_blocks in _by_group(good).items():
                self._store_host(group_id, group_blocks)
        return stores + [("cpu", b.key, True) for b in good]

    def _store_host(self, group_id: int, blocks: list[TierBlock]) -> None:
        assert self.host is not None
        layout = self.layouts[group_id]
        ids = [b.block_id for b in blocks]
        self.host.store(layout, self.kv_caches, ids, [b.slot for b in blocks])  # type: ignore[misc]
        self.host_counters.num_bytes_in += len(ids) * layout.payload_size

    # ------------------------------------------------------------------ saves
    def wait_for_save(self) -> None:
        """Copy this step's completed blocks into the host tier, and snapshot them for each
        lower tier whose writer has room (the others drop them). Never waits for a store."""
        report: list[tuple[str, str, bool]] = []
        for tier, blocks in self._meta.saves.items():
            for group_id, group_blocks in _by_group(blocks).items():
                if tier == "cpu":
                    self._store_host(group_id, group_blocks)
                    report.extend(("cpu", b.key, True) for b in group_blocks)
                else:
                    report.extend(self._queue_lower(tier, group_id, group_blocks))
        if report:
            with self._lock:
                self._report.stores.extend(report)

    def _queue_lower(
        self, tier: str, group_id: int, blocks: list[TierBlock]
    ) -> list[tuple[str, str, bool]]:
        """Queue a snapshot of ``blocks`` for ``tier``'s writer; the stores that ended now."""
        lower = self.lower.get(tier)
        layout = self.head_layouts[group_id]
        if lower is not None and not layout.num_written:  # a lower rank writes these heads
            return [(tier, b.key, True) for b in blocks]
        if lower is None or not lower.writer.has_room(len(blocks) * layout.write_bytes):
            if lower is not None:
                lower.num_backpressured += len(blocks)
            return [(tier, b.key, False) for b in blocks]
        device = self.kv_caches[layout.group.layer_indices[0]].device
        ids = torch.tensor([b.block_id for b in blocks], device=device)
        snapshot = layout.group.snapshot(self.kv_caches, ids)
        lower.writer.submit(PutJob(layout, [b.key for b in blocks], set(), snapshot))
        return []

    # ------------------------------------------------------------------ report
    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            finished, self._finished = self._finished, set()
            invalid, self._invalid = self._invalid, set()
            report, self._report = self._report, OffloadReport()
        return KVConnectorOutput(
            finished_recving=finished,
            invalid_block_ids=invalid,
            worker_meta=None if report.is_empty else report,
        )

    def get_kv_connector_stats(self) -> dict[str, int | float]:
        stats: dict[str, int | float] = {}
        if self.host is not None:
            stats.update(self.host_counters.as_stats("cpu"))
        for name, lower in self.lower.items():
            stats.update(lower.counters().as_stats(name))
        return stats

    def shutdown(self) -> None:
        with self._lock:
            self._cancelled.update(self._pending)  # stop at the next batch boundary
        self._loads.shutdown(wait=True, cancel_futures=False)
        for lower in self.lower.values():
            lower.close()


def _by_group(blocks: list[TierBlock]) -> dict[int, list[TierBlock]]:
    groups: dict[int, list[TierBlock]] = defaultdict(list)
    for block in blocks:
        groups[block.group_id].append(block)
    return groups
