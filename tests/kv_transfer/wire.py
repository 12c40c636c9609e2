"""Hand-made control-plane frames: any kind, any payload (valid or not), signed like a peer
that holds the secret. For tests that feed listeners what a buggy or hostile peer would."""

from __future__ import annotations

from typing import Any

import msgspec

from pagedkv.transport.codec import PROTOCOL_VERSION, Codec


def raw_frames(
    codec: Codec,
    kind: str,
    payload: Any,
    sender: Any = ("peer", "127.0.0.1", 1),
    version: int = PROTOCOL_VERSION,
    compat_hash: str | None = None,
) -> list[bytes]:
    """``[envelope, payload, mac]`` for ``payload`` (any msgpack-able value) of ``kind``,
    with a valid MAC when ``codec`` has a secret. ``sender`` is ``[engine_id, host, port]``,
    checked by nothing here."""
    envelope = msgspec.msgpack.encode(
        [version, codec.compat_hash if compat_hash is None else compat_hash, kind, list(sender)]
    )
    body = payload if isinstance(payload, bytes) else msgspec.msgpack.encode(payload)
    mac = codec._mac(envelope, body) if codec.secret is not None else b""
    return [envelope, body, mac]
