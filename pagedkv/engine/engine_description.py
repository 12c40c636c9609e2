"""EngineDescription: what an engine is, computed once when it starts. The server shows it and
registers it with proxies; nothing above the engine reads the engine's parts for it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
from pagedkv.kv_connector.config import KVRole
from pagedkv.transport.peer_addr import PeerAddr


@dataclass(frozen=True)
class ModelIdentity:
    #: Model, dtype and KV layout hashed: instances exchange KV only when these are equal.
    fingerprint: str
    #: What the fingerprint stands for, readable: ``llama (4 layers); float32; block_size 16;
    #: FullAttentionSpec x4 (4 KV heads x 64)``. Shown by a proxy when two instances do not pair.
    kv_layout: str

    @classmethod
    def of(
        cls,
        model_path: Path,
        dtype: str,
        kv_cache_config: KVCacheConfig,
        block_size: int,
        num_kv_heads: int,
    ) -> ModelIdentity:
        """``num_kv_heads``: the checkpoint's. A tensor-parallel rank's specs hold its own
        heads only; the identity names the whole model's, so instances of every TP size share
        it (one may load what another computed)."""
        config = json.loads((model_path / "config.json").read_text())
        groups = kv_cache_config.kv_cache_groups
        specs = [dataclasses.replace(g.kv_cache_spec, num_kv_heads=num_kv_heads) for g in groups]
        identity = json.dumps(
            [
                config,
                f"torch.{dtype}",
                repr([(spec, len(g.layer_names)) for spec, g in zip(specs, groups)]),
            ],
            sort_keys=True,
            default=str,
        )
        layout = "; ".join(
            f"{type(spec).__name__} x{len(g.layer_names)} "
            f"({num_kv_heads} KV heads x {spec.head_size})"
            for spec, g in zip(specs, groups)
        )
        return cls(
            hashlib.sha256(identity.encode()).hexdigest()[:32],
            f"{config.get('model_type', '?')} ({config.get('num_hidden_layers', '?')} layers); "
            f"{dtype}; block_size {block_size}; {layout}",
        )


@dataclass(frozen=True)
class EngineDescription:
    model_path: Path
    max_model_len: int
    identity: ModelIdentity
    #: How the engine hashes prompt blocks ("" and 0 without prefix caching): a KV-aware proxy
    #: hashes prompts the same way.
    hash_algo: str
    hash_block_size: int
    num_kv_cache_groups: int
    #: Where KV events are published ("": nowhere), and their topic.
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    #: The KV connector's role (None: no connector).
    kv_role: KVRole | None = None
    #: Where the connector pairs with peers through a proxy (None: it does not pair).
    kv_peer: PeerAddr | None = None
    #: The connector's KV tiers: medium -> capacity in blocks ({}: none).
    kv_tiers: dict[str, int] = field(default_factory=dict)
    #: Its tensor-parallel ranks (a P2P peer of another size splits the KV by head).
    tensor_parallel_size: int = 1
