"""KV events as they travel: vLLM's ZMQ publisher's message shape, decoded into typed structs.

A published message is three ZMQ frames::

    [topic, seq, payload]
     seq     = 8-byte big-endian batch number: 0, 1, 2, ... per publisher (a gap = batches lost)
     payload = msgpack KVEventBatch [ts, [event, ...]]; each event a map tagged by "type":
               {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
                "token_ids": [...], "block_size": 16, "lora_id": null, "medium": "GPU",
                "lora_name": null, "group_idx": 0}
               {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}
               {"type": "AllBlocksCleared"}

The replay socket (a ROUTER) answers vLLM's request, an 8-byte start seq, with every batch
still buffered from that seq on, as ``[topic, seq, payload]``, then ``END_SEQ`` (seq -1, empty
frames). Our one addition: the request ``SNAPSHOT_REQUEST`` is answered with one
``KVCacheSnapshot``, the pool's whole prefix cache and what each connector tier holds, taken
between two batches (``next_seq``: the first batch it does not include), then ``END_SEQ``.
Block hashes are bytes (chained xxh3-128 or sha256, equal across processes: see
``kv_cache/block_hash.py``). ``medium`` names the tier
(``kv_cache/kv_events.py``): "GPU" for the instance's own KV cache whatever its device (vLLM's
name for it), "CPU", "DISK" or "REMOTE" for the offloading connector's tiers.
"""

from __future__ import annotations

import msgspec

from pagedkv.kv_cache import kv_events

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"kv-snapshot"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A KV cache event, encoded as a map tagged with its class name (``"type"``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events. ``ts``: wall-clock time (seconds) the step handed them over."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


class KVCacheSnapshot(msgspec.Struct, array_like=True, gc=False):
    """The whole prefix cache between two batches: per KV cache group, the hash of every
    cached block (a hash twice when two blocks hold it); ``tiers``: the same per medium of the
    connector's tiers ("CPU", "DISK", ...; {} without any). Batches from ``next_seq`` on
    follow it. Encoded ``[ts, next_seq, block_hashes, tiers]``: a decoder that knows only the
    first three ignores the fourth, and a snapshot without it decodes with ``tiers`` {}."""

    ts: float
    next_seq: int
    block_hashes: list[list[bytes]]
    tiers: dict[str, list[list[bytes]]] = msgspec.field(default_factory=dict)


def to_wire(event: kv_events.KVCacheEvent) -> WireEvent:
    """The pool's event in vLLM's shape."""
    if isinstance(event, kv_events.BlockStored):
        return BlockStored(
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,
            event.medium,
            None,
            event.group_id,
        )
    if isinstance(event, kv_events.BlockRemoved):
        return BlockRemoved(list(event.block_hashes), event.medium, event.group_id)
    return AllBlocksCleared()


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """A seq frame (END_SEQ is -1); ValueError unless 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"a seq frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
SNAPSHOT_DECODER = msgspec.msgpack.Decoder(KVCacheSnapshot)
