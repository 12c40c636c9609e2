"""The stored value format: every way a value can be wrong is caught before it is loaded."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pagedkv.kv_transfer.store.block_codec import (
    HEADER_SIZE,
    MAX_KEY_BYTES,
    CorruptValue,
    ValueBatch,
    block_key,
    decode_value,
    read_header,
)

KEYS = ["pagedkv:fp:g0:aa", "pagedkv:fp:g1:bb"]
PAYLOAD = 64


def sealed() -> tuple[np.ndarray, list[bytes]]:
    batch = ValueBatch(len(KEYS), PAYLOAD)
    payloads = np.arange(len(KEYS) * PAYLOAD, dtype=np.uint8).reshape(len(KEYS), PAYLOAD)
    batch.payloads[:] = payloads
    return payloads, [bytes(v) for v in batch.seal(KEYS)]


def test_round_trip_returns_the_payload_without_copying() -> None:
    payloads, values = sealed()
    for key, value, payload in zip(KEYS, values, payloads):
        assert len(value) == HEADER_SIZE + PAYLOAD
        out = decode_value(key, value, PAYLOAD)
        assert isinstance(out, memoryview) and bytes(out) == payload.tobytes()
        assert out.obj is value


def test_block_key_names_model_group_and_hash() -> None:
    assert block_key("f00d", 2, bytes([1, 171])) == "pagedkv:f00d:g2:01ab"


def _set(value: bytes, offset: int, raw: bytes) -> bytes:
    return value[:offset] + raw + value[offset + len(raw) :]


CORRUPTIONS = {
    "empty": lambda v: b"",
    "header only": lambda v: v[:HEADER_SIZE],
    "truncated payload": lambda v: v[:-1],
    "extra byte": lambda v: v + b"\0",
    "magic": lambda v: _set(v, 0, b"XKVB"),
    "version": lambda v: _set(v, 4, bytes([9])),
    "key length": lambda v: _set(v, 6, struct.pack("<H", 3)),
    "payload length": lambda v: _set(v, 8, struct.pack("<Q", PAYLOAD - 1)),
    "checksum": lambda v: _set(v, 16, bytes([v[16] ^ 1])),
    "key byte": lambda v: _set(v, 24, b"X"),
    "payload byte": lambda v: _set(v, HEADER_SIZE + 5, bytes([v[HEADER_SIZE + 5] ^ 0x80])),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corruption_is_detected(corruption: str) -> None:
    _, values = sealed()
    with pytest.raises(CorruptValue):
        decode_value(KEYS[0], CORRUPTIONS[corruption](values[0]), PAYLOAD)


def test_a_value_read_under_another_key_or_layout_is_rejected() -> None:
    _, values = sealed()
    with pytest.raises(CorruptValue, match="another key"):
        decode_value(KEYS[1], values[0], PAYLOAD)
    with pytest.raises(CorruptValue, match="expected"):
        decode_value(KEYS[0], values[0], PAYLOAD * 2)


def test_overlong_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="longer than"):
        ValueBatch(1, 8).seal(["k" * (MAX_KEY_BYTES + 1)])


def test_read_header_names_key_and_payload_size_of_well_formed_headers_only() -> None:
    _, values = sealed()
    assert read_header(values[0][:HEADER_SIZE]) == (KEYS[0], PAYLOAD)
    assert read_header(values[1]) == (KEYS[1], PAYLOAD)
    assert read_header(values[0][: HEADER_SIZE - 1]) is None
    assert read_header(_set(values[0], 0, b"XKVB")) is None
    assert read_header(_set(values[0], 4, bytes([9]))) is None
    assert read_header(_set(values[0], 6, struct.pack("<H", MAX_KEY_BYTES + 1))) is None
    assert read_header(_set(values[0], 24, b"\xff")) is None  # not UTF-8
