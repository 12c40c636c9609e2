"""InstanceRegistry: the proxy's side of service discovery (who is alive, and what each one
is), fed by the registry's listener thread. The messages are ``serving/registration.py``'s."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.entrypoints.serving.registration import (
    PLAIN_ROLE,
    Deregister,
    Refused,
    Register,
    Registered,
    registry_codec,
)
from pagedkv.kv_connector.config import KVRole
from pagedkv.transport.codec import ProtocolError
from pagedkv.transport.control_plane import ControlPlane
from pagedkv.transport.peer_addr import PeerAddr, warn_if_open
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)

#: Instances the proxy tracks at once: registrations from more engine ids are refused.
MAX_INSTANCES = 4096
#: Refused senders remembered for ``/instances`` (the most recent ones).
MAX_REFUSED = 64


@dataclass
class Instance:
    kv: PeerAddr
    info: Register
    last_seen: float

    @property
    def engine_id(self) -> str:
        return self.kv.engine_id

    @property
    def kv_role(self) -> KVRole | None:
        """None for a replica (never paired)."""
        return None if self.info.role == PLAIN_ROLE else KVRole(self.info.role)

    @property
    def is_prefill(self) -> bool:
        return self.kv_role is not None and self.kv_role.produces

    @property
    def is_decode(self) -> bool:
        return self.kv_role is not None and self.kv_role.consumes

    @property
    def is_replica(self) -> bool:
        """Serves requests whole, never paired (no P2P connector)."""
        return self.info.role == PLAIN_ROLE

    @property
    def answers(self) -> bool:
        """May be sent a request to answer (a replica, or a decode instance)."""
        return self.is_replica or self.is_decode

    def describe(self) -> dict:
        return {
            "engine_id": self.engine_id,
            "role": self.info.role,
            "http_url": self.info.http_url,
            "kv_address": f"{self.kv.host}:{self.kv.port}",
            "model": self.info.model,
            "fingerprint": self.info.fingerprint,
            "kv_layout": self.info.kv_layout,
            "signs": self.info.signs,
            "num_running": self.info.num_running,
            "num_waiting": self.info.num_waiting,
            "prefix_hashing": f"{self.info.hash_algo}, block_size {self.info.block_size}"
            if self.info.hash_algo
            else "off",
            "kv_events_endpoint": self.info.kv_events_endpoint or None,
            "kv_tiers": self.info.kv_tiers,
            "kv_paths": self.info.kv_paths,
            "tensor_parallel_size": self.info.tensor_parallel_size,
            "seconds_since_heartbeat": round(time.monotonic() - self.last_seen, 3),
        }


class InstanceRegistry:
    """The proxy's side: who is alive, fed by the registry listener thread."""

    def __init__(self, host: str, port: int, secret: bytes | None, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.signs = secret is not None
        self._instances: dict[str, Instance] = {}
        self._lock = threading.Lock()
        #: Registrations refused because MAX_INSTANCES instances were already tracked.
        self.num_refused = 0
        #: Claimed engine id -> (why it was refused, when): the latest MAX_REFUSED.
        self._refused: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        #: Reports the pairing problem of an instance (None: it pairs); set by the router.
        self.pairing_note: Callable[[Instance], str | None] = lambda instance: None
        #: Told (outside the lock) of an instance that joined, or came back as another process
        #: or with other KV event endpoints; and of one that left (by engine id).
        self.on_joined: Callable[[Instance], None] = lambda instance: None
        self.on_left: Callable[[str], None] = lambda engine_id: None
        self._log = RateLimitedLog(logger)
        warn_if_open(logger, "the proxy's registry", host, secret)
        self._plane = ControlPlane(
            registry_codec(secret),
            PeerAddr("proxy", host, port),
            {Register: self._on_register, Deregister: self._on_deregister},
            name="registry",
            on_rejected=self._on_rejected,
        )

    @property
    def rejected(self) -> dict[str, int]:
        return dict(self._plane.rejected)

    def start(self) -> None:
        self._plane.start()

    def close(self) -> None:
        self._plane.close()

    def _on_register(self, sender: PeerAddr, info: Register) -> Registered | Refused:
        now = time.monotonic()
        stale: list[Instance] = []
        with self._lock:
            known = self._instances.get(sender.engine_id)
            if known is None and len(self._instances) >= MAX_INSTANCES:
                stale = self._drop_stale_locked(now)
            full = known is None and len(self._instances) >= MAX_INSTANCES
            if full:
                self.num_refused += 1
            else:
                instance = self._instances[sender.engine_id] = Instance(sender, info, now)
                self._refused.pop(sender.engine_id, None)
        self._left(stale)
        if full:
            return self._refuse(sender, f"the proxy already tracks {MAX_INSTANCES} instances")
        if known is None or known.info.http_url != info.http_url:
            logger.info("registered %s %s at %s", info.role, sender.engine_id, info.http_url)
        if known is None or _identity(known.info) != _identity(info):
            self.on_joined(instance)
        return Registered(self.pairing_note(instance) or "")

    def _on_rejected(self, error: ProtocolError) -> Refused:
        """A registration the codec refused: remembered (by the sender it claims) and told."""
        claimed = error.claimed_sender
        if claimed is not None:
            self._remember_refusal(claimed.engine_id, str(error))
        return Refused(str(error))

    def _refuse(self, sender: PeerAddr, reason: str) -> Refused:
        self._remember_refusal(sender.engine_id, reason)
        self._log.warning(reason, "refused the registration of %s: %s", sender.engine_id, reason)
        return Refused(reason)

    def _remember_refusal(self, engine_id: str, reason: str) -> None:
        with self._lock:
            self._refused[engine_id] = (reason, time.monotonic())
            self._refused.move_to_end(engine_id)
            while len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)

    def refused(self) -> list[dict]:
        """Senders refused recently (the engine id each *claimed*, unverified), newest last."""
        now = time.monotonic()
        with self._lock:
            items = list(self._refused.items())
        return [
            {"claimed_engine_id": engine_id, "reason": reason, "seconds_ago": round(now - t, 1)}
            for engine_id, (reason, t) in items
        ]

    def _on_deregister(self, sender: PeerAddr, _: Deregister) -> None:
        self.evict(sender.engine_id, "deregistered")

    def evict(self, engine_id: str, reason: str) -> None:
        with self._lock:
            instance = self._instances.pop(engine_id, None)
        if instance is not None:
            logger.warning("dropped %s (%s): %s", engine_id, instance.info.http_url, reason)
            self.on_left(engine_id)

    def _left(self, stale: list[Instance]) -> None:
        now = time.monotonic()
        for instance in stale:
            logger.warning(
                "dropped %s (%s): no heartbeat for %.1fs",
                instance.engine_id,
                instance.info.http_url,
                now - instance.last_seen,
            )
            self.on_left(instance.engine_id)

    def _drop_stale_locked(self, now: float) -> list[Instance]:
        stale = [i for i in self._instances.values() if now - i.last_seen > self.timeout_s]
        for instance in stale:
            del self._instances[instance.engine_id]
        return stale

    def live(self) -> list[Instance]:
        """Instances heard from within ``timeout_s`` (the others are dropped, with a log line)."""
        now = time.monotonic()
        with self._lock:
            stale = self._drop_stale_locked(now)
            live = list(self._instances.values())
        self._left(stale)
        return live


def _identity(info: Register) -> tuple:
    """What makes a registration another process, or another event feed."""
    return (
        info.boot_id,
        info.kv_events_endpoint,
        info.kv_events_replay_endpoint,
        info.kv_events_topic,
        info.num_kv_cache_groups,
    )
