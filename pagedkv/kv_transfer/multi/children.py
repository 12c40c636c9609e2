"""Building and stopping a MultiConnector's children (either half): all or none, every one."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from pagedkv.kv_connector.base import KVConnectorHalf
from pagedkv.kv_connector.config import KVTransferConfig

logger = logging.getLogger(__name__)

H = TypeVar("H", bound=KVConnectorHalf)


def build_children(
    create: Callable[[KVTransferConfig, object, str], H],
    configs: Sequence[KVTransferConfig],
    kv_cache_config: object,
    model_fingerprint: str,
) -> list[H]:
    """Each child's half, in order; if one fails to start, those already started are shut
    down before the error propagates."""
    children: list[H] = []
    try:
        for config in configs:
            children.append(create(config, kv_cache_config, model_fingerprint))
    except BaseException:
        shutdown_all(children, reraise=False)
        raise
    return children


def shutdown_all(children: Sequence[KVConnectorHalf], reraise: bool = True) -> None:
    """Shut every child down, even when one raises; then raise the first error (when
    ``reraise``)."""
    first: Exception | None = None
    for child in children:
        try:
            child.shutdown()
        except Exception as e:
            logger.exception("shutting down %s failed", type(child).__name__)
            first = first or e
    if first is not None and reraise:
        raise first
