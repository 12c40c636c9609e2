"""P2pConfig: the P2P connector's knobs, read once from ``kv_connector_extra_config``."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from pagedkv.kv_transfer.kv_transfer_config import KVTransferConfig

SEND_TYPES = ("PUT", "PUT_ASYNC", "GET")
SECRET_ENV = "PAGEDKV_KV_SECRET"
#: Extra-config keys read by ``pagedkv serve`` (registration with a ``pagedkv proxy``).
SERVER_KEYS = ("proxy_ip", "proxy_port", "proxy_heartbeat_s")


@dataclass(frozen=True)
class P2pConfig:
    #: PUT: P sends on its engine thread; PUT_ASYNC: from a sender thread, layer by layer as the
    #: forward pass computes them; GET: P copies the KV into a bounded pool, D pulls.
    send_type: str = "PUT_ASYNC"
    #: How long P keeps a transfer's KV without hearing from D (D's heartbeats renew it).
    lease_s: float = 30.0
    #: D renews its leases and both sides ping their peers this often.
    heartbeat_s: float = 2.0
    #: A peer silent this long (while transfers with it are pending) is gone.
    peer_timeout_s: float = 10.0
    #: Creating a pair group (rendezvous + connect) fails after this long.
    group_setup_timeout_s: float = 10.0
    #: Any one gloo send or receive fails after this long.
    transfer_timeout_s: float = 30.0
    #: KV travels in messages of at most this many bytes (whole blocks), several in flight.
    chunk_bytes: int = 8 << 20
    #: Bytes of messages in flight each way (many small messages or a few large ones).
    in_flight_bytes: int = 32 << 20
    #: D receives straight into its blocks (no staging, no scatter) when its blocks form runs
    #: whose messages average at least this many bytes; else it stages and scatters.
    direct_min_bytes: int = 1 << 20
    #: Threads that send for PUT_ASYNC / serve GET pulls (P), and that receive (D).
    num_send_threads: int = 2
    num_recv_threads: int = 4
    #: Control messages larger than this are rejected before they are decoded.
    max_message_bytes: int = 1 << 20
    #: HMAC-SHA256 key for every control message; None = unauthenticated (loopback only!).
    shared_secret: str | None = None

    def __post_init__(self) -> None:
        if self.send_type not in SEND_TYPES:
            raise ValueError(
                f"kv_connector_extra_config.send_type must be one of {SEND_TYPES}, "
                f"got {self.send_type!r}"
            )
        for name in (
            "lease_s",
            "heartbeat_s",
            "peer_timeout_s",
            "group_setup_timeout_s",
            "transfer_timeout_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"kv_connector_extra_config.{name} must be > 0, got {value!r}")
        if not isinstance(self.direct_min_bytes, int) or self.direct_min_bytes < 0:
            raise ValueError("kv_connector_extra_config.direct_min_bytes must be an integer >= 0")
        for name in ("chunk_bytes", "in_flight_bytes", "num_send_threads", "num_recv_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"kv_connector_extra_config.{name} must be an integer >= 1, got {value!r}"
                )
        if not isinstance(self.max_message_bytes, int) or self.max_message_bytes < 1024:
            raise ValueError("kv_connector_extra_config.max_message_bytes must be >= 1024")
        if self.shared_secret is not None and (
            not isinstance(self.shared_secret, str) or not self.shared_secret
        ):
            raise ValueError("kv_connector_extra_config.shared_secret must be a non-empty string")

    @classmethod
    def from_kv_transfer_config(cls, config: KVTransferConfig) -> P2pConfig:
        """Our keys from the extra config (``proxy_*`` belong to the server; any other key is
        an error); the secret falls back to ``$PAGEDKV_KV_SECRET``."""
        if config.kv_port == 0:
            raise ValueError("the P2P connector needs a fixed kv_transfer_config.kv_port (not 0)")
        extra = config.kv_connector_extra_config
        known = {f.name for f in fields(cls)} | set(SERVER_KEYS)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config key(s) {unknown} for the P2P connector; "
                f"known: {sorted(known)}"
            )
        values: dict[str, Any] = {f.name: extra[f.name] for f in fields(cls) if f.name in extra}
        values.setdefault("shared_secret", os.environ.get(SECRET_ENV) or None)
        return cls(**values)

    @property
    def secret_bytes(self) -> bytes | None:
        return self.shared_secret.encode() if self.shared_secret else None
