"""Service discovery for the proxy: instances announce themselves over ZMQ with heartbeats.

Each ``pagedkv serve --registry HOST:PORT[,HOST:PORT...]`` (or, with the P2P connector,
``kv_connector_extra_config.proxies``, or ``proxy_ip``/``proxy_port``) runs a
``RegistrationClient`` (``registration_client.py``) per proxy that sends a ``Register`` every
``proxy_heartbeat_s`` (2 s) to that proxy's registry ROUTER. Every heartbeat is a whole
registration, so a proxy that restarts knows every live instance after one heartbeat, and
several proxies can serve the same instances. The envelope's
sender is the instance's KV address (engine id, kv_ip, kv_port), or for an instance without the
P2P connector (role ``plain``: a replica, never paired) its HTTP address; the message adds its
role, HTTP URL, model, model fingerprint and KV layout (the proxy pairs only equal
fingerprints, and says why others do not pair), whether it signs its messages, its load, and
what a KV-aware router needs: the prefix-cache hash algorithm and block size, the number of KV
cache groups, where its KV events are published, and a boot id (a new one: a restarted
process, whose cache is new). Messages use the connector's Codec (size limits, version,
namespace check, HMAC-SHA256 when a secret is set), so a rogue process without the secret can't
register itself and receive prompts. An instance not heard from for ``timeout_s`` drops out;
one that says ``Deregister`` drops at once.

The registry answers every heartbeat on its connection: ``Registered``, or ``Refused`` with the
reason (a secret on one side only, a malformed registration, too many instances). Both sides
log a refusal at WARNING, so a misconfigured deployment is visible from either end; refused
senders are listed (by the engine id they claim) in the proxy's ``/instances``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import msgspec

from pagedkv.kv_cache.block_hash import HASH_FUNCTIONS
from pagedkv.kv_connector.config import KV_ROLES
from pagedkv.transport.codec import Codec, ProtocolError
from pagedkv.transport.control_plane import ControlPlane
from pagedkv.transport.peer_addr import PeerAddr, check_host, check_port, warn_if_open
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)

#: The registry's namespace in the envelope (the KV control plane uses the model fingerprint).
REGISTRY_NAMESPACE = "pagedkv-registry-v1"
MAX_REGISTRY_MESSAGE_BYTES = 16 << 10
#: Instances the proxy tracks at once: registrations from more engine ids are refused.
MAX_INSTANCES = 4096
#: Refused senders remembered for ``/instances`` (the most recent ones).
MAX_REFUSED = 64
PREFILL_ROLES = ("kv_producer", "kv_both")
DECODE_ROLES = ("kv_consumer", "kv_both")
#: An instance without the P2P connector: it serves requests whole (data parallel).
PLAIN_ROLE = "plain"
ROLES = (PLAIN_ROLE, *KV_ROLES)


class Register(msgspec.Struct, frozen=True):
    """I am alive (a heartbeat). The KV address and engine id are the envelope's sender.
    Checked on construction and decoding (a bad one is a ``malformed`` message): the proxy
    builds request URLs from ``http_url``, and httpx raises on a malformed one."""

    role: str  # plain, or the P2P connector's kv_role: kv_producer | kv_consumer | kv_both
    http_url: str
    model: str
    #: Model, dtype and KV layout: the proxy pairs P and D only when these are equal.
    fingerprint: str
    num_running: int = 0
    num_waiting: int = 0
    #: What the fingerprint stands for, readable ("llama, 4 layers; float32; block_size 16;
    #: ..."): the proxy shows it when two instances do not pair.
    kv_layout: str = ""
    #: The instance signs its messages (it has the shared secret).
    signs: bool = False
    #: Prefix caching: how the instance hashes full blocks ("": prefix caching off).
    hash_algo: str = ""
    block_size: int = 0
    num_kv_cache_groups: int = 1
    #: Where its KV events are published ("": not published).
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    #: Random per process: a new one means the instance restarted (its cache is new).
    boot_id: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r:.40}")
        try:
            url = httpx.URL(self.http_url)
        except httpx.InvalidURL as e:
            raise ValueError(f"http_url: {e}") from None
        if url.scheme not in ("http", "https") or not url.host or url.query or url.fragment:
            raise ValueError(f"http_url must be http(s)://host[:port][/path], got {url!s:.80}")
        if self.num_running < 0 or self.num_waiting < 0:
            raise ValueError("num_running and num_waiting must be >= 0")
        if self.block_size < 0 or self.num_kv_cache_groups < 1:
            raise ValueError("block_size must be >= 0 and num_kv_cache_groups >= 1")
        if self.hash_algo and (self.hash_algo not in HASH_FUNCTIONS or not self.block_size):
            raise ValueError(
                f"hash_algo must be one of {sorted(HASH_FUNCTIONS)} with a block_size, "
                f"got {self.hash_algo!r:.40}"
            )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            check_zmq_endpoint(name, getattr(self, name))


def check_zmq_endpoint(name: str, endpoint: str) -> None:
    """``tcp://host:port`` (host checked as a P2P host is) or empty: the proxy connects to it."""
    if not endpoint:
        return
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    try:
        if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
            raise ValueError("not tcp://host:port")
        check_host(host)
        check_port(int(port))
    except ValueError as e:
        raise ValueError(f"{name} must be tcp://host:port, got {endpoint!r:.80}: {e}") from None


class Deregister(msgspec.Struct, frozen=True):
    """I am shutting down."""


class Registered(msgspec.Struct, frozen=True):
    """Proxy -> instance: your heartbeat is in (``note``: why you cannot be paired, if so)."""

    note: str = ""


class Refused(msgspec.Struct, frozen=True):
    """Proxy -> instance: your registration was refused, and why."""

    reason: str


REGISTRY_MESSAGES: dict[str, type[msgspec.Struct]] = {
    "register": Register,
    "deregister": Deregister,
    "registered": Registered,
    "refused": Refused,
}


def registry_codec(secret: bytes | None) -> Codec:
    return Codec(REGISTRY_NAMESPACE, secret, MAX_REGISTRY_MESSAGE_BYTES, REGISTRY_MESSAGES)


@dataclass
class Instance:
    kv: PeerAddr
    info: Register
    last_seen: float

    @property
    def engine_id(self) -> str:
        return self.kv.engine_id

    @property
    def is_prefill(self) -> bool:
        return self.info.role in PREFILL_ROLES

    @property
    def is_decode(self) -> bool:
        return self.info.role in DECODE_ROLES

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
