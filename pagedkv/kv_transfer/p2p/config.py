"""P2pConfig: the P2P connector's knobs, read once from ``kv_connector_extra_config``."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagedkv.known_keys import from_known_keys
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.transport.codec import SECRET_ENV

SEND_TYPES = ("PUT", "PUT_ASYNC", "GET")
SAME_HOST_TRANSPORTS = ("shm", "network")
#: Extra-config keys read by ``pagedkv serve`` (registration with ``pagedkv proxy``s:
#: ``proxies``, a list of "HOST:PORT", or one proxy as ``proxy_ip``/``proxy_port``).
SERVER_KEYS = ("proxies", "proxy_ip", "proxy_port", "proxy_heartbeat_s")


@dataclass(frozen=True)
class P2pConfig:
    #: PUT: sent layer by layer as the forward computes them, the step waiting until they left;
    #: PUT_ASYNC: the same from copies, the step not waiting; GET: P copies the KV into a
    #: bounded pool (``kv_buffer_size``) when the request finishes, D pulls (send_modes.py).
    send_type: str = "PUT_ASYNC"
    #: How long P keeps a transfer's KV without hearing from D (D's heartbeats renew it).
    lease_s: float = 30.0
    #: D renews its leases and both sides ping their peers this often.
    heartbeat_s: float = 2.0
    #: A peer with a pair group that is silent this long is lost: the group is torn down.
    peer_timeout_s: float = 10.0
    #: A pair group without a transfer for this long is torn down (set up again when needed).
    idle_ttl_s: float = 600.0
    #: Pair groups live at most (each holds sockets and threads): past it, the least recently
    #: used is torn down.
    max_pair_groups: int = 64
    #: Creating a pair group (rendezvous + connect) fails after this long.
    group_setup_timeout_s: float = 10.0
    #: Any one gloo send or receive fails after this long (a backstop for a dead or hung peer:
    #: gloo then closes the pair, and the pair group is torn down).
    transfer_timeout_s: float = 30.0
    #: KV travels in messages of at most this many bytes (whole blocks), several in flight.
    chunk_bytes: int = 8 << 20
    #: Bytes of messages in flight each way per pair group (D's staging ring holds as much).
    in_flight_bytes: int = 32 << 20
    #: Control messages larger than this are rejected before they are decoded.
    max_message_bytes: int = 1 << 20
    #: HMAC-SHA256 key for every control message; None = unauthenticated (loopback only!).
    shared_secret: str | None = None
    #: Between two instances of one host and boot: "shm" moves the KV through a shared-memory
    #: segment private to the pair (falling back to the network when it can't be set up),
    #: "network" always through the pair group's gloo sockets.
    same_host_transport: str = "shm"

    def __post_init__(self) -> None:
        if self.same_host_transport not in SAME_HOST_TRANSPORTS:
            raise ValueError(
                f"kv_connector_extra_config.same_host_transport must be one of "
                f"{SAME_HOST_TRANSPORTS}, got {self.same_host_transport!r}"
            )
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
            "idle_ttl_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"kv_connector_extra_config.{name} must be > 0, got {value!r}")
        for name in ("chunk_bytes", "in_flight_bytes", "max_pair_groups"):
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
        values = {"shared_secret": os.environ.get(SECRET_ENV) or None}
        values.update(config.kv_connector_extra_config)
        return from_known_keys(cls, values, "kv_connector_extra_config key(s)", SERVER_KEYS)

    @property
    def secret_bytes(self) -> bytes | None:
        return self.shared_secret.encode() if self.shared_secret else None
