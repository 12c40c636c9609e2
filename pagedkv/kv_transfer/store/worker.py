"""StoreConnectorWorker: the worker half. Snapshots computed blocks for the background writer,
loads stored blocks (async through the loader thread, or sync before the forward pass), and
reports what ended each step.

Under tensor parallelism each rank has its own worker half: it writes the KV heads of its cache
that no lower rank holds, and reads every head it holds (``rank_heads.py``); a rank that writes
no head (a replica) snapshots nothing. Every rank reports every flush and load it was handed.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from pagedkv.distributed.shard import SINGLE_LAYOUT, TPLayout
from pagedkv.kv_connector.base import KVConnectorWorker
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer.store.backends import create_backend
from pagedkv.kv_transfer.store.config import StoreConfig
from pagedkv.kv_transfer.store.head_layout import HeadLayout
from pagedkv.kv_transfer.store.loader import BlockFetcher, BlockLoader
from pagedkv.kv_transfer.store.metadata import BlockRef, StoreConnectorMetadata
from pagedkv.kv_transfer.store.recent_keys import RecentKeys
from pagedkv.kv_transfer.store.stats import LOOKUP_STATS, StoreStats
from pagedkv.kv_transfer.store.writer import BlockWriter, PutJob


class StoreConnectorWorker(KVConnectorWorker):
    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache_config,
        model_fingerprint: str,
        tp: TPLayout = SINGLE_LAYOUT,
    ) -> None:
        super().__init__(config, kv_cache_config, model_fingerprint, tp)
        self.store_config = StoreConfig.from_extra_config(config.kv_connector_extra_config)
        self.backend = create_backend(self.store_config)
        self.stats = StoreStats()
        # A remembered key is trusted for a minute, or half its TTL: then checked again.
        ttl_s = self.store_config.ttl_s
        self.recent_keys = RecentKeys(max_age_s=60.0 if ttl_s is None else min(60.0, ttl_s / 2))
        self.writer: BlockWriter | None = None
        if config.kv_role.produces:
            self.writer = BlockWriter(
                self.backend, self.stats, self.recent_keys, self.store_config.put_queue_bytes
            )
        self.fetcher: BlockFetcher | None = None
        self.loader: BlockLoader | None = None
        #: Blocks whose synchronous load failed this step (reported by this step's output).
        self._invalid_block_ids: set[int] = set()
        #: Requests whose synchronous load failed this step: their new KV is not saved, since
        #: it was computed over the missing blocks (the scheduler recomputes them).
        self._failed_sync_req_ids: set[str] = set()

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layer_groups: list[int]) -> None:
        super().register_kv_caches(kv_caches, layer_groups)
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        self.layouts = HeadLayout.of_groups(self.tp, kv_caches, layer_groups, num_groups)
        if self.config.kv_role.consumes:
            self.fetcher = BlockFetcher(
                self.backend, self.layouts, kv_caches, self.stats, self.recent_keys
            )
            if self.store_config.load_mode == "async":
                self.loader = BlockLoader(self.fetcher)

    @property
    def _meta(self) -> StoreConnectorMetadata:
        assert isinstance(self._metadata, StoreConnectorMetadata)
        return self._metadata

    def start_load_kv(self) -> None:
        meta = self._meta
        if self.writer is not None:
            for req_id in meta.flushes:
                self.writer.await_flush(req_id, self.store_config.flush_timeout_s)
        if self.loader is not None:
            for req_id in meta.cancels:
                self.loader.cancel(req_id)
        for spec in meta.loads:
            if spec.is_async:
                assert self.loader is not None
                self.loader.submit(spec)
                continue
            assert self.fetcher is not None
            invalid = self.fetcher.load(spec.blocks)
            if invalid:
                self._invalid_block_ids |= invalid
                self._failed_sync_req_ids.add(spec.req_id)

    def wait_for_save(self) -> None:
        """Snapshot this step's newly computed blocks and queue them for the writer. Costs one
        ``index_select`` per layer; never waits for the store."""
        meta = self._meta
        writer = self.writer
        failed, self._failed_sync_req_ids = self._failed_sync_req_ids, set()
        if writer is None or not meta.saves or not self.layouts[0].num_written:
            return
        by_group: dict[int, list[tuple[str, BlockRef]]] = defaultdict(list)
        for req_id, ref in meta.saves:
            if req_id in failed:
                continue
            if ref.key in self.recent_keys:
                self.stats.num_puts_skipped_recent += 1
                continue
            by_group[ref.group_id].append((req_id, ref))
        for group_id, saves in by_group.items():
            layout = self.layouts[group_id]
            if not writer.has_room(len(saves) * layout.write_bytes):
                self.stats.num_puts_dropped += len(saves)
                continue
            device = self.kv_caches[layout.group.layer_indices[0]].device
            block_ids = torch.tensor([ref.block_id for _, ref in saves], device=device)
            writer.submit(
                PutJob(
                    layout,
                    [ref.key for _, ref in saves],
                    {req_id for req_id, _ in saves},
                    layout.group.snapshot(self.kv_caches, block_ids),
                )
            )

    def get_kv_connector_stats(self) -> dict[str, int | float]:
        """This half's put and load counters (the scheduler half has the lookups)."""
        return {f: getattr(self.stats, f) for f in StoreStats.__slots__ if f not in LOOKUP_STATS}

    def get_finished(self) -> KVConnectorOutput:
        output = KVConnectorOutput(invalid_block_ids=self._invalid_block_ids)
        self._invalid_block_ids = set()
        if self.writer is not None:
            output.finished_sending = self.writer.take_flushed()
        if self.loader is not None:
            finished, invalid = self.loader.take_finished()
            output.finished_recving = finished
            output.invalid_block_ids |= invalid
        return output

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.loader is not None:
            self.loader.close()
        self.backend.close()
