"""OffloadingConnector: the scheduler half of the tiered KV cache (vLLM's ``OffloadingConnector``).

Tiers under the pool, top to bottom: host memory ("cpu"), a local directory ("disk"), a store
backend ("remote"; Redis, a shared directory, Mooncake). Every block that a step completes is
stored into each tier that lacks it (write-through, on completion): into the host tier during
the step (a copy within host memory), into the lower tiers by their writer threads, from a
snapshot; a writer that falls behind drops stores (counted), it never makes a step wait.

At admission a request's blocks past its local prefix hit are looked up top to bottom (pool ->
host -> disk -> remote; the host and disk tiers in this half's ``TierIndex``, the remote tier
with one ``exists_many``), and the longest prefix found anywhere is loaded back between steps
while the request waits in WAITING_FOR_REMOTE_KVS, holding only the blocks it will fill. A block
read from a lower tier is copied up into the host tier as well (promotion).

No convoy: a request whose prefix is being loaded for another request waits ("ask again next
step") and then hits that load's blocks in the pool, instead of loading them a second time.

A tier's faults (a full disk, a vanished store, a corrupt file) are misses: this connector's
``kv_load_failure_policy`` is ``recompute``.

Tensor parallelism: each rank keeps its own KV heads of a block in the host tier (its memory) and
writes its heads' values to the lower tiers (per KV head, so an instance of any TP size reads
them: ``store/rank_heads.py``). One entry of this half's index stands for every rank's part; it
is ready once every rank stored its part (``combine_worker_meta``, ``RankReports``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedkv.distributed.shard import SINGLE_LAYOUT, TPLayout
from pagedkv.kv_cache.kv_events import BlockStored, KVCacheEvent
from pagedkv.kv_connector.base import KVConnectorBase
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.histogram import Histogram, HistogramStat
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_connector.protocols import ConnectorRequest, ScheduledStep
from pagedkv.kv_transfer.offload.config import OffloadingConfig
from pagedkv.kv_transfer.offload.disk_store import DiskStore
from pagedkv.kv_transfer.offload.metadata import (
    OffloadingMetadata,
    OffloadLoad,
    OffloadReport,
    TierBlock,
)
from pagedkv.kv_transfer.offload.prefix_locator import PrefixLocator
from pagedkv.kv_transfer.offload.rank_reports import RankReports
from pagedkv.kv_transfer.offload.stats import LOAD_LATENCY_BUCKETS, TierCounters
from pagedkv.kv_transfer.offload.tier_index import TierIndex
from pagedkv.kv_transfer.offload.tier_sizes import slot_bytes, tier_capacity_blocks
from pagedkv.kv_transfer.store.backends import StoreBackend, StoreError, create_backend
from pagedkv.kv_transfer.store.block_codec import block_key, split_head_key
from pagedkv.kv_transfer.store.completed_blocks import CompletedBlocks
from pagedkv.kv_transfer.store.connector import block_geometry, num_kv_heads

if TYPE_CHECKING:
    from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
    from pagedkv.kv_cache.kv_cache_manager import KVCacheBlocks

logger = logging.getLogger(__name__)


class OffloadingConnector(KVConnectorBase):
    default_load_failure_policy = "recompute"

    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache_config: KVCacheConfig,
        model_fingerprint: str,
        tp: TPLayout = SINGLE_LAYOUT,
    ) -> None:
        super().__init__(config, kv_cache_config, model_fingerprint, tp)
        self.offload_config = OffloadingConfig.from_extra_config(config.kv_connector_extra_config)
        self.block_size, self.windows = block_geometry(kv_cache_config, "OffloadingConnector")
        self.num_groups = len(self.windows)
        self.num_kv_heads = num_kv_heads(kv_cache_config, tp)
        self.rank_reports = RankReports(tp.size)
        #: This step's plan (evictions while the disk tier is indexed at start go in the first).
        self._meta = OffloadingMetadata()
        self.tiers: dict[str, TierIndex] = {}
        self.counters: dict[str, TierCounters] = {}
        for tier in self.offload_config.tiers:
            self.counters[tier.medium] = TierCounters()
            if tier.medium != "remote":
                self._add_tier_index(tier.medium)
        remote = self.offload_config.tier("remote")
        self.remote: StoreBackend | None = None
        if remote is not None:
            assert remote.store is not None
            self.remote = create_backend(remote.store, lookups_only=True)
        self.locator = PrefixLocator(
            self.tiers,
            self.remote,
            self.counters.get("remote"),
            self._key,
            self.windows,
            range(self.num_kv_heads),
        )
        self.load_latency = Histogram(LOAD_LATENCY_BUCKETS)
        self.num_external_queries = 0
        self.num_external_hits = 0
        self._saves = CompletedBlocks(self.block_size)
        #: Loads in flight: request id -> the (tier, key) entries they pinned.
        self._loads: dict[str, list[tuple[str, str]]] = {}
        #: Keys being loaded, and for which request (a second request waits for that load).
        self._loading_keys: dict[str, str] = {}

    def _add_tier_index(self, name: str) -> None:
        tier = self.offload_config.tier(name)
        assert tier is not None
        capacity = tier_capacity_blocks(tier, self.kv_cache_config, self.num_kv_heads)
        index = TierIndex(
            name,
            tier.event_medium,
            capacity,
            tier.eviction,
            with_slots=name == "cpu",
            on_evict=lambda key, entry: self._meta.deletes.setdefault(name, []).append(key),
        )
        if name == "disk":
            self._recover_disk(index, tier.path, tier.fsync)
        self.tiers[name] = index

    def _recover_disk(self, index: TierIndex, path: str | None, fsync: bool) -> None:
        """Index the blocks a previous run left (same model and KV layout, any TP size): those
        with a file for every KV head, oldest first. A block some heads' files miss is
        deleted (in the first step)."""
        assert path is not None
        try:
            found = DiskStore(Path(path), self.model_fingerprint, fsync).scan()
        except StoreError as e:
            logger.warning("disk tier %s unusable, running without it: %s", path, e)
            index.capacity_blocks = 0
            return
        heads: dict[str, set[int]] = {}
        for value_key, _, _ in found:
            parsed = split_head_key(value_key)
            if parsed is not None:
                heads.setdefault(parsed[0], set()).add(parsed[1])
        for key, stored in heads.items():
            if len(stored) < self.num_kv_heads:
                self._meta.deletes.setdefault("disk", []).append(key)
                continue
            _, group, block_hash = key.rsplit(":", 2)
            index.add_ready(key, int(group.removeprefix("g")), bytes.fromhex(block_hash))
        if found:
            logger.info("disk tier %s: %d blocks from a previous run", path, len(index))

    def _key(self, group_id: int, block_hash: bytes) -> str:
        return block_key(self.model_fingerprint, group_id, block_hash)

    # ------------------------------------------------------------------ lookup
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.sampling_params.prompt_logprobs is not None:
            return 0, False
        start = num_computed_tokens // self.block_size
        end = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        if end <= start:
            self.locator.lookups.pop(request.request_id, None)
            return 0, False
        lookup = self.locator.locate(request, start, end)
        keys = (
            self._key(g, request.block_hashes[start + i])
            for i in range(lookup.num_blocks)
            for g in range(self.num_groups)
        )
        if any(key in self._loading_keys for key in keys):
            return None, False  # another request is loading these: hit them in the pool after
        num_tokens = lookup.num_blocks * self.block_size
        return num_tokens, num_tokens > 0

    # ------------------------------------------------------------------ loads
    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        lookup = self.locator.lookups.pop(request.request_id, None)
        self._saves.track(request)
        self.num_external_queries += request.num_tokens
        if num_external_tokens == 0:
            return
        assert lookup is not None, "external tokens without a lookup"
        self.num_external_hits += num_external_tokens
        load = OffloadLoad(request.request_id, {})
        pinned: list[tuple[str, str]] = []
        to_promote: list[tuple[int, TierBlock]] = []
        num_blocks = num_external_tokens // self.block_size
        credit: list[str | None] = [None] * num_blocks  # the tier each position's tokens hit
        for i in range(lookup.start_block, lookup.start_block + num_blocks):
            for g, group_blocks in enumerate(blocks.blocks):
                if group_blocks[i].is_null:
                    continue
                tier = lookup.sources[g][i - lookup.start_block]
                assert tier is not None
                block = self._load_block(request, i, g, group_blocks[i].block_id, tier, pinned)
                load.blocks.setdefault(tier, []).append(block)
                if tier != "cpu":
                    to_promote.append((i, block))
                credit[i - lookup.start_block] = credit[i - lookup.start_block] or tier
        self._credit_hits(credit)
        self._plan_promotions(request, load, to_promote)
        self._loads[request.request_id] = pinned
        self._meta.loads.append(load)

    def _credit_hits(self, credit: list[str | None]) -> None:
        """A position's tokens count as hits of the tier its first group's block came from; a
        position no group loads (outside every sliding window) counts for the first tier that
        served the request."""
        first = next(tier for tier in credit if tier is not None)
        for tier in credit:
            self.counters[tier or first].num_hit_tokens += self.block_size

    def _load_block(
        self,
        request: ConnectorRequest,
        i: int,
        group_id: int,
        block_id: int,
        tier: str,
        pinned: list[tuple[str, str]],
    ) -> TierBlock:
        """Block ``i`` of a group, read from ``tier``: its entry pinned until the load ends."""
        key = self._key(group_id, request.block_hashes[i])
        self._loading_keys[key] = request.request_id
        index = self.tiers.get(tier)
        if index is None:  # the remote tier: found by key
            return TierBlock(group_id, block_id, key)
        entry = index.ready(key)
        assert entry is not None, f"{key} left the {tier} tier since its lookup"
        index.pin(key)
        index.touch(key)
        pinned.append((tier, key))
        return TierBlock(group_id, block_id, key, entry.slot)

    def _plan_promotions(
        self, request: ConnectorRequest, load: OffloadLoad, blocks: list[tuple[int, TierBlock]]
    ) -> None:
        """Blocks read from below the host tier are copied into it too, where it has room."""
        host = self.tiers.get("cpu")
        if host is None:
            return
        for i, block in blocks:
            if block.key in host.entries:
                continue
            event = self._stored_event(request, i, block.group_id, host.medium)
            entry = host.reserve(block.key, block.group_id, request.block_hashes[i], event)
            if entry is not None:
                load.promotions.append(
                    TierBlock(block.group_id, block.block_id, block.key, entry.slot)
                )

    def _stored_event(
        self, request: ConnectorRequest, i: int, group_id: int, medium: str
    ) -> BlockStored:
        tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
        parent = request.block_hashes[i - 1] if i else None
        return BlockStored(
            (request.block_hashes[i],), parent, tuple(tokens), self.block_size, group_id, medium
        )

    def cancel_load(self, request: ConnectorRequest) -> None:
        self._meta.cancels.append(request.request_id)

    # ------------------------------------------------------------------ saves
    def build_connector_meta(self, scheduler_output: ScheduledStep) -> OffloadingMetadata:
        """Store the blocks this step completes into every tier lacking them."""
        for request, i, group_id, block_id in self._saves.step(scheduler_output):
            self._plan_save(request, i, group_id, block_id)
        meta, self._meta = self._meta, OffloadingMetadata()
        return meta

    def _plan_save(self, request: ConnectorRequest, i: int, group_id: int, block_id: int) -> None:
        key = self._key(group_id, request.block_hashes[i])
        for tier in self.offload_config.tiers:
            name = tier.medium
            index = self.tiers.get(name)
            slot = None
            if index is not None:
                if key in index.entries:
                    continue
                event = self._stored_event(request, i, group_id, index.medium)
                entry = index.reserve(key, group_id, request.block_hashes[i], event)
                if entry is None:
                    self.counters[name].num_stores_dropped += 1
                    continue
                slot = entry.slot
            self._meta.saves.setdefault(name, []).append(TierBlock(group_id, block_id, key, slot))

    # ------------------------------------------------------------------ the worker's report
    def combine_worker_meta(self, metas: Sequence[Any]) -> OffloadReport | None:
        """The ranks' ``OffloadReport``s of one step as one (``OffloadReport.combine``)."""
        return OffloadReport.combine(metas)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving:
            for tier, key in self._loads.pop(req_id, ()):
                self.tiers[tier].unpin(key)
        for key in [k for k, r in self._loading_keys.items() if r in output.finished_recving]:
            del self._loading_keys[key]
        report = output.worker_meta
        if not isinstance(report, OffloadReport):
            report = OffloadReport()
        for tier, key, ok in self.rank_reports.stores_ended(report.stores):
            if tier in self.tiers:
                self.tiers[tier].complete(key, ok)
                if not ok:
                    self._delete_files(tier, key)
        for tier, key in report.bad:
            if tier in self.tiers:
                self.tiers[tier].discard(key)
                if key not in self.tiers[tier].entries:
                    self._delete_files(tier, key)
        for seconds in self.rank_reports.loads_ended(report.load_seconds, output.finished_recving):
            self.load_latency.observe(seconds)

    def _delete_files(self, tier: str, key: str) -> None:
        """A disk block that is not (or no longer) an entry: its heads' files that some ranks
        may have written, or that a load left behind, are deleted."""
        if tier == "disk":
            self._meta.deletes.setdefault(tier, []).append(key)

    def request_finished(
        self, request: ConnectorRequest, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        """Never holds blocks: the host copy is made in the step, the lower tiers' from a
        snapshot."""
        self.locator.lookups.pop(request.request_id, None)
        self._saves.forget(request.request_id)
        return False, None

    # ------------------------------------------------------------------ events, stats
    def take_events(self) -> list[KVCacheEvent]:
        return [event for index in self.tiers.values() for event in index.take_events()]

    def tier_block_hashes(self) -> dict[str, list[list[bytes]]]:
        return {index.medium: index.block_hashes(self.num_groups) for index in self.tiers.values()}

    def tier_capacities(self) -> dict[str, int]:
        """The host and disk tiers' capacity in blocks (the remote tier's is the store's)."""
        return {index.medium: index.capacity_blocks for index in self.tiers.values()}

    def get_kv_connector_stats(self) -> dict[str, int | float | HistogramStat]:
        stats: dict[str, int | float | HistogramStat] = {
            "num_external_prefix_cache_queries": self.num_external_queries,
            "num_external_prefix_cache_hits": self.num_external_hits,
        }
        for name, counters in self.counters.items():
            stats.update(counters.as_stats(name))
            index = self.tiers.get(name)
            if index is not None:
                size = slot_bytes(name, self.kv_cache_config, self.num_kv_heads)
                stats[f"offload_{name}_capacity_bytes"] = index.capacity_blocks * size
                stats[f"offload_{name}_used_bytes"] = len(index) * size
                stats[f"num_offload_{name}_evictions"] = index.num_evictions
        stats["offload_load_seconds"] = self.load_latency.snapshot()
        return stats

    def shutdown(self) -> None:
        if self.remote is not None:
            self.remote.close()
