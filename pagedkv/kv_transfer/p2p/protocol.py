"""The P2P control plane's wire format: typed msgpack messages, checked before they are used.

A message is three ZMQ frames::

    [envelope, payload, mac]
     envelope = msgpack Envelope(version, compat_hash, kind, sender engine_id/host/port)
     payload  = msgpack of the Struct that ``kind`` names
     mac      = HMAC-SHA256(secret, len(envelope) || envelope || payload), or b"" without secret

Decoding is defensive and ordered so that nothing from an unchecked message is used:
frame count and sizes (before any parsing) -> MAC (constant-time compare) -> envelope ->
version -> compatibility hash -> kind -> the typed payload. Any failure raises
``ProtocolError`` naming the reason; the listener logs it and drops the message. No pickle:
msgspec decodes into the declared types only.

Both ends must agree on signing: a signed message to an instance without a secret, or an
unsigned one to an instance with a secret, is an ``auth_mismatch`` (refused either way, so a
deployment with the secret on some processes only fails loudly on both sides, not silently on
one). Such an error, a wrong MAC and an incompatible message carry the sender the envelope
*claims* (unverified: only for saying who is misconfigured, never for trusting them).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re

import msgspec

PROTOCOL_VERSION = 2
MAX_ENVELOPE_BYTES = 1024
MAC_BYTES = 32
MAX_ENGINE_ID_LEN = 256
#: Host names: dot-separated labels of letters, digits, inner hyphens (RFC 1123) and
#: underscores (container service names use them).
_LABEL = r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)"
_HOST_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")


def check_host(host: str) -> None:
    """ValueError unless ``host`` is an IP address or a host name. A ZMQ endpoint is built from
    it, and ZMQ raises on a malformed one (``"a b"``, ``"*"``, NUL): such a host must be refused
    where it enters (kv_transfer_params, an envelope), never reach a socket call."""
    if not isinstance(host, str) or not 0 < len(host) <= 253:
        raise ValueError(f"host must be an IP address or a host name, got {host!r:.80}")
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        return
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(host):
        raise ValueError(f"host must be an IP address or a host name, got {host!r:.80}")


def check_engine_id(engine_id: str) -> None:
    if not isinstance(engine_id, str) or not 0 < len(engine_id) <= MAX_ENGINE_ID_LEN:
        raise ValueError(f"engine id must be a string of 1 to {MAX_ENGINE_ID_LEN} characters")


def check_port(port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an integer in 1..65535, got {port!r:.80}")


def parse_host_ports(text: str) -> list[tuple[str, int]]:
    """``HOST:PORT[,HOST:PORT...]`` as (host, port) pairs: each host passes ``check_host``, each
    port ``check_port``, none is listed twice; a ValueError names the bad entry."""
    addresses: list[tuple[str, int]] = []
    for entry in (part.strip() for part in text.split(",")):
        host, sep, port = entry.rpartition(":")
        try:
            if not sep or not (port.isascii() and port.isdigit()):
                raise ValueError("not HOST:PORT")
            check_host(host)
            check_port(int(port))
        except ValueError as e:
            raise ValueError(f"{entry!r:.80}: {e}") from None
        if (host, int(port)) in addresses:
            raise ValueError(f"{entry!r:.80} is listed twice")
        addresses.append((host, int(port)))
    return addresses


def is_loopback(host: str) -> bool:
    """``host`` only reaches this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def warn_if_open(logger, what: str, host: str, secret: bytes | None) -> None:
    """Without a shared secret, anyone who reaches ``host`` is trusted: say so when that is
    more than this machine."""
    if secret is None and not is_loopback(host):
        logger.warning(
            "%s listens on %s without a shared secret: anyone who can reach it is trusted "
            "(set $PAGEDKV_KV_SECRET on every instance and the proxy)",
            what,
            host,
        )


class PeerAddr(msgspec.Struct, frozen=True, array_like=True):
    """Where an instance's control plane listens, and who it is. Checked on construction and
    on decoding (msgspec runs ``__post_init__``): a bad address is a ValueError, or a
    ``malformed`` envelope."""

    engine_id: str
    host: str
    port: int

    def __post_init__(self) -> None:
        check_engine_id(self.engine_id)
        check_host(self.host)
        check_port(self.port)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    version: int
    compat_hash: str
    kind: str
    sender: PeerAddr


# ---------------------------------------------------------------------- pair group setup
class Hello(msgspec.Struct, frozen=True):
    """Create pair group ``group`` with me (rank 0 = the smaller engine id)."""

    group: str


class StoreSet(msgspec.Struct, frozen=True):
    """One rendezvous key of pair group ``group`` (``PairStore.set`` on the other side)."""

    group: str
    key: str
    value: bytes


# ---------------------------------------------------------------------- transfers
class Want(msgspec.Struct, frozen=True):
    """D -> P: send me these blocks of ``transfer_id`` over pair group ``group``.

    ``block_indices[g]`` are positions in the request's block table of KV cache group ``g``
    (D lacks them; D never asks for a position it holds as the null block). ``segments[g]``
    cut them into messages (lengths, summing to ``len(block_indices[g])``; see transfer.py)."""

    transfer_id: str
    group: str
    num_prompt_tokens: int
    prompt_hash: str
    block_indices: list[list[int]]
    segments: list[list[int]]


class XferPart(msgspec.Struct, frozen=True, array_like=True):
    """One transfer of a wire batch: its id and the segments of its WANT (per KV cache group,
    blocks per message), so D can size every message even of a transfer it forgot."""

    transfer_id: str
    segments: list[list[int]]


class XferBegin(msgspec.Struct, frozen=True):
    """P -> D: a wire batch follows on pair group ``group`` with gloo tag ``tag``. Layer-major:
    for each layer, for each part in order, each segment of that layer's KV cache group as a K
    message then a V message. P sends its batches to one D one after another, in the order of
    their XFER_BEGINs, and D receives them in that order (see lanes.py)."""

    group: str
    tag: int
    parts: list[XferPart]


class Done(msgspec.Struct, frozen=True):
    """D -> P: the transfer ended on D (``ok``: every wanted block landed)."""

    transfer_id: str
    ok: bool
    reason: str = ""


class Nack(msgspec.Struct, frozen=True):
    """P -> D: P will not send this transfer (unknown, expired, pool full, aborted...).
    ``group_lost``: P has no pair group of that generation any more; D should start anew."""

    transfer_id: str
    reason: str
    group_lost: bool = False


class Cancel(msgspec.Struct, frozen=True):
    """D -> P: D no longer wants this transfer (aborted, or past its deadline)."""

    transfer_id: str
    reason: str


#: Transfers one heartbeat names as still being computed, at most (with transfer ids of up to
#: 256 characters, 1024 of them fit well within the default ``max_message_bytes``).
MAX_COMPUTING = 1024


class Heartbeat(msgspec.Struct, frozen=True):
    """Liveness, both ways, while a pair group exists. From D it also renews the leases of
    ``transfer_ids`` (loads D has asked for: P NACKs the ones it does not hold for D) and of
    ``queued`` (requests D has not admitted yet: P keeps their KV, ignoring ids it does not
    know yet). From P, ``computing`` names the transfers D asked for whose request is still
    queued or in prefill on P: D's deadline for those loads counts from when it hears this.
    At most ``MAX_COMPUTING`` of them, the oldest on P first (the ones P computes next); one
    named in no heartbeat keeps the deadline it had (counted from its last naming)."""

    transfer_ids: list[str] = []
    queued: list[str] = []
    computing: list[str] = []


class Bye(msgspec.Struct, frozen=True):
    """Pair group ``group`` is torn down on the sender's side (shutting down, idle, or the
    receiver stopped answering): tear yours down too, and fail what was in flight on it."""

    group: str
    reason: str


MESSAGE_TYPES: dict[str, type[msgspec.Struct]] = {
    "hello": Hello,
    "store_set": StoreSet,
    "want": Want,
    "xfer_begin": XferBegin,
    "done": Done,
    "nack": Nack,
    "cancel": Cancel,
    "heartbeat": Heartbeat,
    "bye": Bye,
}


class ProtocolError(ValueError):
    """A message that must be dropped; ``reason`` is a short label (for logs and counters).
    ``claimed_sender``: for ``auth_mismatch``, ``unauthenticated`` and ``incompatible``, who the
    envelope says sent it (unverified: for telling that peer, never for trusting it)."""

    def __init__(
        self, reason: str, detail: str = "", claimed_sender: PeerAddr | None = None
    ) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.claimed_sender = claimed_sender


class Codec:
    """Encodes and checks messages of one namespace (``compat_hash``) and message set."""

    def __init__(
        self,
        compat_hash: str,
        secret: bytes | None,
        max_message_bytes: int,
        message_types: dict[str, type[msgspec.Struct]] = MESSAGE_TYPES,
    ) -> None:
        self.compat_hash = compat_hash
        self.secret = secret
        self.max_message_bytes = max_message_bytes
        self._kinds = {cls: kind for kind, cls in message_types.items()}
        self._decoders = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in message_types.items()}
        self._envelope_decoder = msgspec.msgpack.Decoder(Envelope)
        self._encoder = msgspec.msgpack.Encoder()

    def _mac(self, envelope: bytes, payload: bytes) -> bytes:
        assert self.secret is not None
        mac = hmac.new(self.secret, len(envelope).to_bytes(4, "big"), hashlib.sha256)
        mac.update(envelope)
        mac.update(payload)
        return mac.digest()

    def _mac_ok(self, envelope: bytes, payload: bytes, mac: bytes) -> bool:
        """Constant-time check (``hmac.compare_digest``)."""
        return len(mac) == MAC_BYTES and hmac.compare_digest(mac, self._mac(envelope, payload))

    def encode(self, message: msgspec.Struct, sender: PeerAddr) -> list[bytes]:
        kind = self._kinds[type(message)]
        envelope = self._encoder.encode(Envelope(PROTOCOL_VERSION, self.compat_hash, kind, sender))
        payload = self._encoder.encode(message)
        mac = self._mac(envelope, payload) if self.secret is not None else b""
        return [envelope, payload, mac]

    def _claimed_sender(self, envelope_bytes: bytes) -> PeerAddr | None:
        try:
            return self._envelope_decoder.decode(envelope_bytes).sender
        except msgspec.DecodeError:
            return None

    def decode(self, frames: list[bytes]) -> tuple[Envelope, msgspec.Struct]:
        if len(frames) != 3:
            raise ProtocolError("malformed", f"{len(frames)} frames, expected 3")
        envelope_bytes, payload, mac = frames
        if len(envelope_bytes) > MAX_ENVELOPE_BYTES or len(payload) > self.max_message_bytes:
            raise ProtocolError("oversized", f"{len(envelope_bytes)} + {len(payload)} bytes")
        if bool(mac) != (self.secret is not None):
            raise ProtocolError(
                "auth_mismatch",
                "authentication mismatch: the sender signs its messages and this instance has "
                "no shared secret"
                if mac
                else "authentication mismatch: the sender does not sign its messages and this "
                "instance requires a shared secret",
                self._claimed_sender(envelope_bytes),
            )
        if self.secret is not None and not self._mac_ok(envelope_bytes, payload, mac):
            raise ProtocolError(
                "unauthenticated",
                "wrong HMAC (another shared secret?)",
                self._claimed_sender(envelope_bytes),
            )
        try:
            envelope = self._envelope_decoder.decode(envelope_bytes)
        except msgspec.DecodeError as e:
            raise ProtocolError("malformed", f"envelope: {e}") from None
        if envelope.version != PROTOCOL_VERSION:
            raise ProtocolError(
                "wrong_version", f"version {envelope.version}, expected {PROTOCOL_VERSION}"
            )
        if envelope.compat_hash != self.compat_hash:  # not a secret: plain compare
            raise ProtocolError(
                "incompatible",
                f"compatibility hash {envelope.compat_hash[:12]!r} from "
                f"{envelope.sender.engine_id!r} differs from ours (another model, dtype or KV "
                "layout)",
                envelope.sender,
            )
        decoder = self._decoders.get(envelope.kind)
        if decoder is None:
            raise ProtocolError("malformed", f"unknown kind {envelope.kind!r}")
        try:
            return envelope, decoder.decode(payload)
        except msgspec.DecodeError as e:
            raise ProtocolError("malformed", f"{envelope.kind} payload: {e}") from None
