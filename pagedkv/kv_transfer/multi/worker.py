"""MultiConnectorWorker, worker half: each hook goes to every child, in order.

Children share one progress event (the MultiConnector's): any child's transfer ending wakes an
idle engine. The engine sleeps until then only if every child signals its progress; else it
polls (``KVConnectorWorker.wait_for_progress``).

A request held by several children (``MultiConnectorMetadata.holders``) is reported in
``finished_sending`` once each of them has reported it; a request loaded by several
(``loaders``), in ``finished_recving`` once each has; any other request, when its child
reports it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import TYPE_CHECKING

from pagedkv.distributed.shard import SINGLE_LAYOUT, TPLayout
from pagedkv.kv_connector.base import KVConnectorMetadata, KVConnectorWorker
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_connector.protocols import LayerAttentionMetadata
from pagedkv.kv_transfer.factory import create_worker_connector
from pagedkv.kv_transfer.multi.children import build_children, shutdown_all
from pagedkv.kv_transfer.multi.config import child_configs
from pagedkv.kv_transfer.multi.metadata import MultiConnectorMetadata
from pagedkv.kv_transfer.multi.stats import child_prefixes, merged_stats

if TYPE_CHECKING:
    import torch

    from pagedkv.kv_cache.kv_cache_config import KVCacheConfig


class MultiConnectorWorker(KVConnectorWorker):
    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache_config: KVCacheConfig,
        model_fingerprint: str,
        tp: TPLayout = SINGLE_LAYOUT,
    ) -> None:
        super().__init__(config, kv_cache_config, model_fingerprint, tp)
        configs = child_configs(config)
        self.stats_prefixes = child_prefixes(configs)
        self.workers: list[KVConnectorWorker] = build_children(
            functools.partial(create_worker_connector, tp=tp),
            configs,
            kv_cache_config,
            model_fingerprint,
        )
        self.signals_progress = all(worker.signals_progress for worker in self.workers)
        for worker in self.workers:
            worker.set_progress_event(self.progress_event)
        #: Request id -> positions of the children still to report its send ended ...
        self._holders: dict[str, set[int]] = {}
        #: ... and its load ended.
        self._loaders: dict[str, set[int]] = {}

    def set_progress_event(self, event: threading.Event) -> None:
        super().set_progress_event(event)
        for worker in self.workers:
            worker.set_progress_event(event)

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layer_groups: list[int]) -> None:
        super().register_kv_caches(kv_caches, layer_groups)
        for worker in self.workers:
            worker.register_kv_caches(kv_caches, layer_groups)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, MultiConnectorMetadata)
        super().bind_connector_metadata(metadata)
        for request_id, holders in metadata.holders.items():
            self._holders[request_id] = set(holders)
        for request_id, loaders in metadata.loaders.items():
            self._loaders[request_id] = set(loaders)
        for worker, child in zip(self.workers, metadata.children, strict=True):
            worker.bind_connector_metadata(child)

    def clear_connector_metadata(self) -> None:
        for worker in self.workers:
            worker.clear_connector_metadata()
        super().clear_connector_metadata()

    def start_load_kv(self) -> None:
        for worker in self.workers:
            worker.start_load_kv()

    def wait_for_layer_load(self, layer_idx: int) -> None:
        for worker in self.workers:
            worker.wait_for_layer_load(layer_idx)

    def save_kv_layer(
        self, layer_idx: int, kv_cache: torch.Tensor, attn_metadata: LayerAttentionMetadata
    ) -> None:
        for worker in self.workers:
            worker.save_kv_layer(layer_idx, kv_cache, attn_metadata)

    def wait_for_save(self) -> None:
        for worker in self.workers:
            worker.wait_for_save()

    def get_finished(self) -> KVConnectorOutput:
        outputs = []
        for position, worker in enumerate(self.workers):
            output = worker.get_finished()
            sent = {r for r in output.finished_sending if _ended(self._holders, r, position)}
            loaded = {r for r in output.finished_recving if _ended(self._loaders, r, position)}
            outputs.append(
                dataclasses.replace(output, finished_sending=sent, finished_recving=loaded)
            )
        return KVConnectorOutput.merge(outputs)

    def get_kv_connector_stats(self) -> dict[str, int | float]:
        stats = [worker.get_kv_connector_stats() for worker in self.workers]
        return merged_stats(self.stats_prefixes, stats)

    def kv_paths(self) -> dict[str, str]:
        return {peer: path for worker in self.workers for peer, path in worker.kv_paths().items()}

    def shutdown(self) -> None:
        shutdown_all(self.workers)


def _ended(waiting: dict[str, set[int]], request_id: str, position: int) -> bool:
    """Child ``position`` reports ``request_id``'s transfer ended: is every child that
    ``waiting`` lists for it done now? (A request not listed has one child.)"""
    children = waiting.get(request_id)
    if children is None:
        return True
    children.discard(position)
    if children:
        return False
    del waiting[request_id]
    return True
