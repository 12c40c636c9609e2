"""KV connectors by name, imported on first use (a connector's dependencies stay optional).

Each half is built on its own (``create_scheduler_connector``, ``create_worker_connector``): a
composite connector's halves build their children's halves.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from pagedkv.distributed.shard import SINGLE_LAYOUT, TPLayout
from pagedkv.kv_connector.base import KVConnectorBase, KVConnectorWorker
from pagedkv.kv_connector.config import KVTransferConfig


class _Registered(NamedTuple):
    #: Each half, as "module:Class".
    scheduler_cls: str
    worker_cls: str
    #: The word that names this connector's stats inside a MultiConnector.
    stats_prefix: str


_CONNECTORS: dict[str, _Registered] = {}


def register_connector(
    name: str, scheduler_cls: str, worker_cls: str, stats_prefix: str | None = None
) -> None:
    """``stats_prefix``: by default ``name`` without its ``Connector`` suffix, lowercased
    (``P2pConnector`` -> ``p2p``)."""
    prefix = stats_prefix or name.removesuffix("Connector").lower() or name.lower()
    _CONNECTORS[name] = _Registered(scheduler_cls, worker_cls, prefix)


def available_connectors() -> list[str]:
    return sorted(_CONNECTORS)


def _registered(config: KVTransferConfig) -> _Registered:
    try:
        return _CONNECTORS[config.kv_connector]
    except KeyError:
        raise ValueError(
            f"unknown kv_connector {config.kv_connector!r}; available: "
            f"{', '.join(available_connectors())}"
        ) from None


def stats_prefix(config: KVTransferConfig) -> str:
    return _registered(config).stats_prefix


def _load(target: str) -> type:
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def create_scheduler_connector(
    config: KVTransferConfig,
    kv_cache_config,
    model_fingerprint: str,
    tp: TPLayout = SINGLE_LAYOUT,
) -> KVConnectorBase:
    """The scheduler half of ``config.kv_connector`` for an instance of ``tp.size`` ranks
    (``tp``: rank 0's layout)."""
    scheduler_cls = _load(_registered(config).scheduler_cls)
    return scheduler_cls(config, kv_cache_config, model_fingerprint, tp)


def create_worker_connector(
    config: KVTransferConfig,
    kv_cache_config,
    model_fingerprint: str,
    tp: TPLayout = SINGLE_LAYOUT,
) -> KVConnectorWorker:
    """The worker half of ``config.kv_connector`` for tensor-parallel rank ``tp`` (each rank
    builds its own)."""
    worker_cls = _load(_registered(config).worker_cls)
    return worker_cls(config, kv_cache_config, model_fingerprint, tp)


def create_connector(
    config: KVTransferConfig, kv_cache_config, model_fingerprint: str
) -> tuple[KVConnectorBase, KVConnectorWorker]:
    """Both halves (the scheduler half is shut down if the worker half fails to start)."""
    scheduler = create_scheduler_connector(config, kv_cache_config, model_fingerprint)
    try:
        worker = create_worker_connector(config, kv_cache_config, model_fingerprint)
    except BaseException:
        scheduler.shutdown()
        raise
    return scheduler, worker


register_connector(
    "StoreConnector",
    "pagedkv.kv_transfer.store.connector:StoreConnector",
    "pagedkv.kv_transfer.store.worker:StoreConnectorWorker",
)
register_connector(
    "P2pConnector",
    "pagedkv.kv_transfer.p2p.connector:P2pConnector",
    "pagedkv.kv_transfer.p2p.worker:P2pConnectorWorker",
)
register_connector(
    "OffloadingConnector",
    "pagedkv.kv_transfer.offload.connector:OffloadingConnector",
    "pagedkv.kv_transfer.offload.worker:OffloadingConnectorWorker",
    stats_prefix="offload",
)
register_connector(
    "MultiConnector",
    "pagedkv.kv_transfer.multi.connector:MultiConnector",
    "pagedkv.kv_transfer.multi.worker:MultiConnectorWorker",
)
