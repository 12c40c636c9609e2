"""The control-plane wire format (P2P, the registry): typed msgpack, checked before use.

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

import msgspec

from pagedkv.transport.peer_addr import PeerAddr

PROTOCOL_VERSION = 2
#: The shared secret's variable: every instance and proxy of a deployment signs with it.
SECRET_ENV = "PAGEDKV_KV_SECRET"
MAX_ENVELOPE_BYTES = 1024
MAC_BYTES = 32


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    version: int
    compat_hash: str
    kind: str
    sender: PeerAddr


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
        message_types: dict[str, type[msgspec.Struct]],
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
