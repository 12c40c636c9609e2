"""A connector's plain data through the executor's channels: every connector's metadata and
worker_meta come back equal, composites by child; nothing but a connector dataclass is built."""

from __future__ import annotations

import msgspec
import pytest

from pagedkv.executor.connector_codec import (
    decode_output,
    decode_plain,
    encode_output,
    encode_plain,
)
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer.multi.metadata import MultiConnectorMetadata
from pagedkv.kv_transfer.offload.metadata import (
    OffloadingMetadata,
    OffloadLoad,
    OffloadReport,
    TierBlock,
)
from pagedkv.kv_transfer.p2p.connector import (
    LoadSpec,
    P2pConnectorMetadata,
    RemoteLoad,
    SendSpec,
)
from pagedkv.kv_transfer.store.metadata import BlockRef, StoreConnectorMetadata, StoreLoad
from pagedkv.transport.peer_addr import PeerAddr

PEER = PeerAddr("engine-p", "127.0.0.1", 14579)
P2P = P2pConnectorMetadata(
    queued=[RemoteLoad("t1", PEER, None)],
    loads=[LoadSpec("r1", "t1", PEER, None, 40, "h", ([1, 2, 3], [4]), [[0, 1], [0]])],
    cancels=["r2"],
    abandons=[RemoteLoad("t3", None, "no peer")],
    computing=[SendSpec("r4", "t4", 16, "h4", ([5, 6],), "engine-d")],
    holds=[SendSpec("r5", "t5", 8, "h5", ([7],), None)],
    releases=["t6"],
    arrivals=[("r7", "t7")],
    departures=["r7"],
)
OFFLOAD = OffloadingMetadata(
    saves={"cpu": [TierBlock(0, 3, "k3", 2)]},
    loads=[OffloadLoad("r1", {"disk": [TierBlock(0, 1, "k1")]}, [TierBlock(0, 1, "k1", 5)])],
    deletes={"disk": ["k9"]},
    cancels=["r8"],
)
STORE = StoreConnectorMetadata(
    saves=[("r1", BlockRef(0, 1, "k1"))],
    loads=[StoreLoad("r2", [BlockRef(1, 2, "k2")], True)],
    flushes=["r3"],
    cancels=["r4"],
)


def _round_trip(obj: object) -> object:
    return decode_plain(msgspec.msgpack.decode(msgspec.msgpack.encode(encode_plain(obj))))


@pytest.mark.parametrize(
    "obj",
    [
        None,
        P2P,
        OFFLOAD,
        STORE,
        MultiConnectorMetadata((OFFLOAD, P2P), {"r1": (0, 1)}, {"r2": (0, 1)}),
        OffloadReport(stores=[("cpu", "k", True)], bad=[("disk", "k2")], load_seconds={"r": 0.5}),
        (OffloadReport(stores=[("cpu", "k", False)]), None),
    ],
    ids=["none", "p2p", "offload", "store", "multi", "report", "composite-report"],
)
def test_connector_data_comes_back_equal(obj: object) -> None:
    assert _round_trip(obj) == obj


@pytest.mark.parametrize(
    "name",
    ["os:system", "pagedkv.kv_transfer.p2p.connector:prompt_hash", "builtins:dict"],
)
def test_only_connector_dataclasses_are_built(name: str) -> None:
    with pytest.raises(ValueError, match="not a KV connector"):
        decode_plain([name, {}])


def test_a_ranks_kv_connector_output_comes_back_equal() -> None:
    output = KVConnectorOutput(
        finished_sending={"a"},
        finished_recving={"b"},
        invalid_block_ids={3, 4},
        load_errors={"b": "the peer went away"},
        loads_in_progress={"c"},
        worker_meta=(OffloadReport(stores=[("cpu", "k", True)]), None),
    )
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(encode_output(output)))
    assert decode_output(wire) == output
    assert decode_output(encode_output(None)) is None
