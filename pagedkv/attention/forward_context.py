"""What one model forward needs besides token ids and positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.attention.backends.base import AttentionBackend
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.kv_connector.base import KVConnectorWorker


@dataclass(slots=True)
class ForwardContext:
    """Passed explicitly to ``model.forward``; nothing about a step lives in a global.

    ``kv_caches[i]`` and ``attn_metadata[i]`` belong to layer ``i``; layers of one KV-cache
    group share the same metadata object. When ``kv_connector`` is set, each attention layer
    calls ``kv_connector.wait_for_layer_load(i)`` before touching its cache and
    ``kv_connector.save_kv_layer(i, kv_cache, attn_metadata)`` right after writing the step's
    keys and values.
    """

    kv_caches: list[torch.Tensor]
    attn_metadata: list[AttentionMetadata]
    backend: AttentionBackend
    kv_connector: KVConnectorWorker | None = None
