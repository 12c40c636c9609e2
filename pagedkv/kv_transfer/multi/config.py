"""A MultiConnector's children, from its ``kv_connector_extra_config`` (vLLM's form)::

    {"kv_connector": "MultiConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"connectors": [
         {"kv_connector": "P2pConnector", "kv_port": 14579, ...},
         {"kv_connector": "StoreConnector", "kv_connector_extra_config": {...}}]}}

Each child is a whole kv_transfer_config. The fields it leaves out among ``INHERITED`` are the
MultiConnector's (one engine has one id and one role; a timeout or a failure policy set once
applies to every child that does not set its own).
"""

from __future__ import annotations

from typing import Any

from pagedkv.kv_connector.config import KVTransferConfig

MULTI_CONNECTOR = "MultiConnector"
#: Fields a child takes from its MultiConnector unless it sets them.
INHERITED = ("kv_role", "engine_id", "kv_load_failure_policy", "kv_load_timeout")
_FIELD = "kv_transfer_config.kv_connector_extra_config"


def child_configs(config: KVTransferConfig) -> list[KVTransferConfig]:
    """The children's configs, in order; ValueError naming the first bad field."""
    extra = config.kv_connector_extra_config
    unknown = sorted(set(extra) - {"connectors"})
    if unknown:
        raise ValueError(
            f"unknown {_FIELD} key(s) {unknown} of {MULTI_CONNECTOR}; known: ['connectors']"
        )
    connectors = extra.get("connectors")
    if not isinstance(connectors, list) or not connectors:
        raise ValueError(
            f"{_FIELD}.connectors must be a non-empty list of kv_transfer_configs, "
            f"got {connectors!r:.80}"
        )
    return [_child(config, i, child) for i, child in enumerate(connectors)]


def _child(parent: KVTransferConfig, index: int, child: Any) -> KVTransferConfig:
    where = f"{_FIELD}.connectors[{index}]"
    if not isinstance(child, dict):
        raise ValueError(f"{where} must be a kv_transfer_config object, got {child!r:.80}")
    if child.get("kv_connector") == MULTI_CONNECTOR:
        raise ValueError(f"{where}.kv_connector: a {MULTI_CONNECTOR} cannot hold another")
    values = {name: getattr(parent, name) for name in INHERITED} | child
    try:
        return KVTransferConfig.from_dict(values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
