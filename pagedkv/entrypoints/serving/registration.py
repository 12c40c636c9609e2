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
cache groups, where its KV events are published, its KV tiers (medium and capacity), the path
its KV takes with each peer it is paired with (shared memory or gloo), and a boot id (a new
one: a restarted process, whose cache is new). Messages use the connector's Codec (size
limits, version, namespace check, HMAC-SHA256 when a secret is set), so a rogue process
without the secret can't
register itself and receive prompts. An instance not heard from for ``timeout_s`` drops out;
one that says ``Deregister`` drops at once.

The registry answers every heartbeat on its connection: ``Registered``, or ``Refused`` with the
reason (a secret on one side only, a malformed registration, too many instances). Both sides
log a refusal at WARNING, so a misconfigured deployment is visible from either end; refused
senders are listed (by the engine id they claim) in the proxy's ``/instances``.
"""

from __future__ import annotations

import httpx
import msgspec

from pagedkv.kv_cache.block_hash import HASH_FUNCTIONS
from pagedkv.kv_connector.config import KVRole
from pagedkv.transport.codec import Codec
from pagedkv.transport.peer_addr import check_host, check_port

#: The registry's namespace in the envelope (the KV control plane uses the model fingerprint).
REGISTRY_NAMESPACE = "pagedkv-registry-v1"
MAX_REGISTRY_MESSAGE_BYTES = 16 << 10
#: An instance without a pairing KV connector: it serves requests whole (data parallel).
PLAIN_ROLE = "plain"
#: KV tiers a registration may name.
MAX_KV_TIERS = 8
#: Peers whose KV path a registration lists at most (the most recently set up are kept), and
#: the longest path description.
MAX_KV_PATHS = 32
MAX_KV_PATH_CHARS = 96
#: What an instance registers as: plain, or its connector's ``kv_role``.
ROLES = (PLAIN_ROLE, *map(str, KVRole))


#: More ranks than any host has cores: a heartbeat claiming more is malformed.
MAX_TENSOR_PARALLEL_SIZE = 1024


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
    #: Its connector's KV tiers below the pool: medium ("CPU", "DISK", ...) -> capacity in
    #: blocks.
    kv_tiers: dict[str, int] = {}
    #: Peer engine id -> the path KV takes between the two ("shm", "gloo", with why not shm
    #: when the pair could have used it).
    kv_paths: dict[str, str] = {}
    #: Its ranks (``--tensor-parallel-size``): a peer of another size splits the KV by head.
    tensor_parallel_size: int = 1

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
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(
                f"tensor_parallel_size must be in [1, {MAX_TENSOR_PARALLEL_SIZE}], "
                f"got {self.tensor_parallel_size!r:.20}"
            )
        if self.hash_algo and (self.hash_algo not in HASH_FUNCTIONS or not self.block_size):
            raise ValueError(
                f"hash_algo must be one of {sorted(HASH_FUNCTIONS)} with a block_size, "
                f"got {self.hash_algo!r:.40}"
            )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            check_zmq_endpoint(name, getattr(self, name))
        check_kv_tiers(self.kv_tiers)
        check_kv_paths(self.kv_paths)


def check_kv_tiers(kv_tiers: dict[str, int]) -> None:
    """At most ``MAX_KV_TIERS`` tiers, each a short name and a capacity >= 0."""
    if len(kv_tiers) > MAX_KV_TIERS or not all(
        0 < len(medium) <= 32 and medium.isprintable() and capacity >= 0
        for medium, capacity in kv_tiers.items()
    ):
        raise ValueError(
            f"kv_tiers must be at most {MAX_KV_TIERS} media (names of 1-32 characters) with a "
            f"capacity >= 0, got {str(kv_tiers):.80}"
        )


def check_kv_paths(kv_paths: dict[str, str]) -> None:
    """At most ``MAX_KV_PATHS`` peers, each an engine id and a short printable description."""
    if len(kv_paths) > MAX_KV_PATHS or not all(
        0 < len(peer) <= 128 and 0 < len(path) <= MAX_KV_PATH_CHARS and path.isprintable()
        for peer, path in kv_paths.items()
    ):
        raise ValueError(
            f"kv_paths must be at most {MAX_KV_PATHS} peers with descriptions of 1-"
            f"{MAX_KV_PATH_CHARS} characters, got {str(kv_paths):.80}"
        )


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
