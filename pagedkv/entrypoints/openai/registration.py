"""This server's registration with ``pagedkv proxy``s: its settings read once (before the model
loads, so a bad one fails early), and the ``Register`` heartbeat built from the engine's
``EngineDescription`` and its live load, one ``RegistrationClient`` per proxy."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.engine_description import EngineDescription
from pagedkv.entrypoints.openai.registration_client import RegistrationClient, proxy_addresses
from pagedkv.entrypoints.serving.registration import (
    MAX_KV_PATH_CHARS,
    MAX_KV_PATHS,
    PLAIN_ROLE,
    Register,
)
from pagedkv.transport.codec import SECRET_ENV
from pagedkv.transport.peer_addr import PeerAddr

logger = logging.getLogger(__name__)
_ANY_INTERFACE = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class RegistrationConfig:
    #: The proxies: ``--registry``, else ``kv_connector_extra_config``'s ``proxies`` or
    #: ``proxy_ip``/``proxy_port`` (``proxy_addresses``).
    proxies: list[tuple[str, int]]
    #: ``kv_connector_extra_config.proxy_heartbeat_s``.
    heartbeat_s: float = 2.0
    #: ``kv_connector_extra_config.shared_secret``, else ``$PAGEDKV_KV_SECRET``.
    secret: bytes | None = None

    @classmethod
    def from_args(
        cls, registry: list[tuple[str, int]] | None, extra: Mapping[str, Any]
    ) -> RegistrationConfig:
        heartbeat_s = extra.get("proxy_heartbeat_s", 2.0)
        if isinstance(heartbeat_s, bool) or not isinstance(heartbeat_s, int | float):
            heartbeat_s = 0
        if not heartbeat_s > 0:
            raise ValueError(
                "kv_connector_extra_config.proxy_heartbeat_s must be a number > 0, "
                f"got {extra.get('proxy_heartbeat_s')!r:.40}"
            )
        secret = extra.get("shared_secret") or os.environ.get(SECRET_ENV)
        secret_bytes = secret.encode() if secret else None
        return cls(proxy_addresses(registry, extra), float(heartbeat_s), secret_bytes)


def registration_extra_config(kv_transfer_config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The ``kv_connector_extra_config`` the registration reads: the connector's; for a
    MultiConnector, its children's merged (an earlier child's key wins: the child that pairs
    comes first, as its peer address is the MultiConnector's)."""
    config = kv_transfer_config or {}
    extra = config.get("kv_connector_extra_config") or {}
    if config.get("kv_connector") != "MultiConnector":
        return extra
    merged: dict[str, Any] = {}
    for child in reversed(extra.get("connectors") or []):
        child_extra = child.get("kv_connector_extra_config") if isinstance(child, dict) else None
        merged.update(child_extra if isinstance(child_extra, dict) else {})
    return merged


def start_registration(
    description: EngineDescription,
    load: Callable[[], tuple[int, int]],
    kv_paths: Callable[[], dict[str, str]],
    config: RegistrationConfig,
    served_model_name: str,
    http_host: str,
    http_port: int,
) -> list[RegistrationClient]:
    """Announce this instance to each proxy of ``config``: as its KV connector's role and peer
    address when the connector pairs, else as a plain replica named by its HTTP address."""
    if not config.proxies:
        return []
    kv_peer = description.kv_peer
    host = http_host
    if http_host in _ANY_INTERFACE:  # the address peers reach: the KV one, or this machine
        host = kv_peer.host if kv_peer is not None else "127.0.0.1"
    if kv_peer is not None:
        role, me = str(description.kv_role), kv_peer
    else:
        role, me = PLAIN_ROLE, PeerAddr(f"{host}:{http_port}", host, http_port)
    fixed = dict(
        role=role,
        http_url=f"http://{host}:{http_port}",
        model=served_model_name,
        fingerprint=description.identity.fingerprint,
        kv_layout=description.identity.kv_layout,
        signs=config.secret is not None,
        hash_algo=description.hash_algo,
        block_size=description.hash_block_size,
        num_kv_cache_groups=description.num_kv_cache_groups,
        kv_events_endpoint=_reachable(description.kv_events_endpoint, host),
        kv_events_replay_endpoint=_reachable(description.kv_events_replay_endpoint, host),
        kv_events_topic=description.kv_events_topic,
        kv_tiers=description.kv_tiers,
        tensor_parallel_size=description.tensor_parallel_size,
        boot_id=uuid.uuid4().hex,
    )

    def describe() -> Register:
        num_running, num_waiting = load()
        recent = list(kv_paths().items())[-MAX_KV_PATHS:]  # the most recently set up pairs
        paths = {peer[:128]: path[:MAX_KV_PATH_CHARS] for peer, path in recent}
        return Register(num_running=num_running, num_waiting=num_waiting, kv_paths=paths, **fixed)

    where = ", ".join(f"{proxy_host}:{proxy_port}" for proxy_host, proxy_port in config.proxies)
    try:
        describe()  # a registration the proxies would refuse fails here, at startup
    except ValueError as e:
        raise ValueError(f"registering with {where}: {e}") from None
    clients = [
        RegistrationClient(proxy_host, proxy_port, me, describe, config.secret, config.heartbeat_s)
        for proxy_host, proxy_port in config.proxies
    ]
    for client in clients:
        client.start()
    logger.info("registering as %s with the proxies at %s", role, where)
    return clients


def _reachable(endpoint: str, host: str) -> str:
    """A bound ``tcp://0.0.0.0:PORT`` (any interface) as the address peers connect to."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint.removeprefix(wildcard)}"
    return endpoint
