"""Store keys and the value format of one stored KV block.

A block's key: ``pagedkv:<model fingerprint>:g<KV cache group id>:<chained block hash, hex>``.
The chained hash covers the whole prefix up to the block's last token (and the cache salt), and
the fingerprint covers model, dtype and KV layout, so equal keys mean interchangeable KV. A value
holds one KV head of a block, under ``<block key>:h<head>`` (``head_key``; the checkpoint's head
index): instances of any tensor-parallel size write and read the same values (``rank_heads.py``).

Value: a fixed 256-byte header, then the payload (all layers of the group for that block)::

    offset  size  field
    0       4     magic b"PKVB"
    4       1     version (1)
    5       1     zero
    6       2     key length (little-endian)
    8       8     payload length
    16      8     xxh3-64 of the payload
    24      n     the key, UTF-8 (n <= 232), then zeros up to offset 256
    256     ...   payload: [layers, 2 (K, V), block_size, head_size] of one head, in the cache dtype

A value is accepted only if the magic, version, key, lengths and checksum all match what the
reader expects; anything else (truncated, corrupted, written under another key, from another
layout) is a ``CorruptValue``, which the connector treats as a cache miss.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

MAGIC = b"PKVB"
VERSION = 1
HEADER_SIZE = 256
_FIXED = struct.Struct("<4sBxHQQ")
MAX_KEY_BYTES = HEADER_SIZE - _FIXED.size


class CorruptValue(ValueError):
    """A stored value that must not be loaded."""


def block_key(model_fingerprint: str, group_id: int, block_hash: bytes) -> str:
    return f"pagedkv:{model_fingerprint}:g{group_id}:{block_hash.hex()}"


def head_key(key: str, head: int) -> str:
    """The key of the value holding KV head ``head`` (the checkpoint's index) of block ``key``."""
    return f"{key}:h{head}"


def head_keys(keys: Sequence[str], heads: range) -> list[str]:
    """The value keys of ``heads`` of each block of ``keys``, block-major."""
    return [head_key(key, head) for key in keys for head in heads]


def split_head_key(key: str) -> tuple[str, int] | None:
    """``(block key, head)`` of a value key; None if ``key`` names no head."""
    block, _, head = key.rpartition(":h")
    return (block, int(head)) if block and head.isdigit() else None


class ValueBatch:
    """``num_values`` values of one payload size in one buffer: fill ``payloads`` (one row per
    value), then ``seal(keys)`` writes the headers and returns one memoryview per value.

    ``storage`` (uint8, at least ``num_values * value_size`` bytes) is used instead of a fresh
    allocation: a writer reuses one buffer and skips the page faults of a new one."""

    def __init__(
        self, num_values: int, payload_size: int, storage: np.ndarray | None = None
    ) -> None:
        shape = (num_values, HEADER_SIZE + payload_size)
        if storage is None:
            self.buffer = np.empty(shape, dtype=np.uint8)
        else:
            self.buffer = storage[: shape[0] * shape[1]].reshape(shape)
        self.buffer[:, :HEADER_SIZE] = 0

    @staticmethod
    def nbytes_for(num_values: int, payload_size: int) -> int:
        return num_values * (HEADER_SIZE + payload_size)

    @property
    def payloads(self) -> np.ndarray:
        return self.buffer[:, HEADER_SIZE:]

    def seal(self, keys: Sequence[str]) -> list[memoryview]:
        assert len(keys) == len(self.buffer)
        payload_size = self.buffer.shape[1] - HEADER_SIZE
        values = []
        for row, key in zip(self.buffer, keys):
            raw_key = key.encode()
            if len(raw_key) > MAX_KEY_BYTES:
                raise ValueError(f"store key longer than {MAX_KEY_BYTES} bytes: {key!r}")
            view = memoryview(row)
            checksum = xxhash.xxh3_64_intdigest(view[HEADER_SIZE:])
            _FIXED.pack_into(view, 0, MAGIC, VERSION, len(raw_key), payload_size, checksum)
            view[_FIXED.size : _FIXED.size + len(raw_key)] = raw_key
            values.append(view)
        return values


def read_header(header: bytes | bytearray | memoryview) -> tuple[str, int] | None:
    """The key and payload size that a value's header names, or None if ``header`` (the first
    ``HEADER_SIZE`` bytes of a value, or more) is not a well-formed header. Only the header is
    checked: a value still goes through ``decode_value`` when it is loaded."""
    view = memoryview(header).cast("B")
    if len(view) < HEADER_SIZE:
        return None
    magic, version, key_len, payload_size, _ = _FIXED.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION or key_len > MAX_KEY_BYTES:
        return None
    try:
        return bytes(view[_FIXED.size : _FIXED.size + key_len]).decode(), payload_size
    except UnicodeDecodeError:
        return None


def decode_value(key: str, value: bytes | bytearray | memoryview, payload_size: int) -> memoryview:
    """The payload of ``value`` (no copy), after checking it is the value of ``key``."""
    view = memoryview(value).cast("B")
    if len(view) < HEADER_SIZE:
        raise CorruptValue(f"{len(view)} bytes: shorter than the {HEADER_SIZE}-byte header")
    magic, version, key_len, stored_size, checksum = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptValue(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise CorruptValue(f"unsupported value version {version}")
    raw_key = key.encode()
    if key_len != len(raw_key) or view[_FIXED.size : _FIXED.size + key_len] != raw_key:
        raise CorruptValue("the value was stored under another key")
    if stored_size != payload_size:
        raise CorruptValue(f"payload of {stored_size} bytes, expected {payload_size}")
    if len(view) != HEADER_SIZE + payload_size:
        raise CorruptValue(f"{len(view)} bytes, expected {HEADER_SIZE + payload_size}")
    payload = view[HEADER_SIZE:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptValue("payload checksum mismatch")
    return payload
