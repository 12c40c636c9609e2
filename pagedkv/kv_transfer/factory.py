"""KV connectors by name, imported on first use (a connector's dependencies stay optional)."""

from __future__ import annotations

import importlib

from pagedkv.kv_connector.base import KVConnectorBase, KVConnectorWorker
from pagedkv.kv_connector.config import KVTransferConfig

# name -> (scheduler half, worker half), as "module:Class".
_CONNECTORS: dict[str, tuple[str, str]] = {}


def register_connector(name: str, scheduler_cls: str, worker_cls: str) -> None:
    _CONNECTORS[name] = (scheduler_cls, worker_cls)


def available_connectors() -> list[str]:
    return sorted(_CONNECTORS)


def _load(target: str) -> type:
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def create_connector(
    config: KVTransferConfig, kv_cache_config, model_fingerprint: str
) -> tuple[KVConnectorBase, KVConnectorWorker]:
    try:
        scheduler_target, worker_target = _CONNECTORS[config.kv_connector]
    except KeyError:
        raise ValueError(
            f"unknown kv_connector {config.kv_connector!r}; available: "
            f"{', '.join(available_connectors())}"
        ) from None
    return (
        _load(scheduler_target)(config, kv_cache_config, model_fingerprint),
        _load(worker_target)(config, kv_cache_config, model_fingerprint),
    )


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
)
