"""The P2P connector's pieces in one process: wire format, control plane, leases, send pool,
rendezvous store, pair groups and the chunked data path."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
import torch.distributed as dist
import zmq

from pagedkv.kv_transfer.p2p import worker as p2p_worker
from pagedkv.kv_transfer.p2p.connector import LoadSpec, P2pConnectorMetadata, SendSpec
from pagedkv.kv_transfer.p2p.control_plane import ControlPlane
from pagedkv.kv_transfer.p2p.lease import LeaseTable
from pagedkv.kv_transfer.p2p.pair_group import PairGroup, PairGroups
from pagedkv.kv_transfer.p2p.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Codec,
    Done,
    Envelope,
    Heartbeat,
    Hello,
    Nack,
    PeerAddr,
    ProtocolError,
    StoreSet,
    Want,
    XferBegin,
)
from pagedkv.kv_transfer.p2p.send_pool import SendPool
from pagedkv.kv_transfer.p2p.store import PairStore
from pagedkv.kv_transfer.p2p.transfer import (
    BlockSender,
    LayerBlocks,
    plan_segments,
    receive_layers,
    runs,
)
from pagedkv.kv_transfer.p2p.transfer_state import Inbound, Outbound, TransferState
from tests.ports import free_port

SECRET = b"unit-secret"
ME = PeerAddr("engine-a", "127.0.0.1", 1)
WANT = Want("t1", "g", 40, "h", [[1, 2]], [[2]])


def codec(secret: bytes | None = SECRET, compat: str = "fp", limit: int = 4096) -> Codec:
    return Codec(compat, secret, limit)


# ---------------------------------------------------------------------------- wire format
def test_a_message_round_trips_with_its_sender() -> None:
    envelope, message = codec().decode(codec().encode(WANT, ME))
    assert message == WANT and envelope.sender == ME and envelope.kind == "want"


def _reason(frames: list[bytes], receiver: Codec | None = None) -> str:
    with pytest.raises(ProtocolError) as e:
        (receiver or codec()).decode(frames)
    return e.value.reason


def test_every_kind_of_bad_message_is_rejected_with_its_reason() -> None:
    good = codec().encode(WANT, ME)
    encoder = msgspec.msgpack.Encoder()
    assert _reason(good[:2]) == "malformed"
    assert _reason([b"\xc1garbage", good[1], b""], codec(None)) == "malformed"
    assert _reason(codec(limit=1 << 20).encode(Heartbeat(["x" * 5000]), ME)) == "oversized"
    assert _reason([good[0], good[1], b""]) == "auth_mismatch"
    assert _reason(codec(b"other secret").encode(WANT, ME)) == "unauthenticated"
    assert _reason(codec(compat="another model").encode(WANT, ME)) == "incompatible"
    old = encoder.encode(Envelope(PROTOCOL_VERSION + 1, "fp", "want", ME))
    assert _reason([old, good[1], b""], codec(None)) == "wrong_version"
    unknown = encoder.encode(Envelope(PROTOCOL_VERSION, "fp", "pickle", ME))
    assert _reason([unknown, good[1], b""], codec(None)) == "malformed"
    # A payload of the wrong shape for its kind: typed decoding refuses it.
    hello = codec(None).encode(Hello("g"), ME)
    assert _reason([good[0], hello[1], b""], codec(None)) == "malformed"


BAD_HOSTS = ["foo bar", "*", "", "\x00", "a" * 254, "-lead", "évil", "h:1", 5, None]


def test_a_bad_peer_address_is_refused_where_it_enters() -> None:
    """Hosts ZMQ would raise on never reach a socket: not from kv_transfer_params (the load
    fails by policy) and not from an envelope (dropped as malformed). A host of "a b" from a
    client once killed a D's engine thread (ZMQError out of start_load_kv)."""
    from pagedkv.kv_transfer.p2p.connector import parse_remote_load

    good = {"transfer_id": "t", "remote_host": "127.0.0.1", "remote_port": 5,
            "remote_engine_id": "P"}  # fmt: skip
    assert parse_remote_load(good).remote == PeerAddr("P", "127.0.0.1", 5)
    for host in ("::1", "[::1]", "p-0.pods.local", "my_service"):
        assert parse_remote_load({**good, "remote_host": host}).error is None
    for field, values in (
        ("remote_host", BAD_HOSTS),
        ("remote_port", [0, 65536, -1, True, "5", 5.0]),
        ("remote_engine_id", ["", "e" * 257, 7]),
    ):
        for value in values:
            load = parse_remote_load({**good, field: value})
            assert load.remote is None and field in load.error, (field, value)
    for host in BAD_HOSTS[:-2]:
        with pytest.raises(ValueError):
            PeerAddr("e", host, 1)  # type: ignore[arg-type]
        sender = ["e", host, 1]
        envelope = msgspec.msgpack.encode([PROTOCOL_VERSION, "fp", "want", sender])
        assert _reason([envelope, codec(None).encode(WANT, ME)[1], b""], codec(None)) == "malformed"


def test_signing_must_agree_and_a_mismatch_names_the_claimed_sender() -> None:
    """A secret on one side only is refused by both sides as an authentication mismatch
    (an instance without a secret once accepted signed messages, so a half-configured
    deployment failed on one side only, and as "P silent")."""
    for sender, receiver in ((codec(), codec(None)), (codec(None), codec())):
        with pytest.raises(ProtocolError) as e:
            receiver.decode(sender.encode(WANT, ME))
        assert e.value.reason == "auth_mismatch"
        assert "authentication mismatch" in str(e.value)
        assert e.value.claimed_sender == ME
    with pytest.raises(ProtocolError) as e:
        codec().decode([b"\xc1", b"", b""])
    assert e.value.reason == "auth_mismatch" and e.value.claimed_sender is None


def test_the_mac_covers_envelope_and_payload() -> None:
    env, payload, mac = codec().encode(WANT, ME)
    other = codec().encode(Want("t2", "g", 40, "h", [[1, 2]], [[2]]), ME)
    assert _reason([env, other[1], mac]) == "unauthenticated"


def test_the_listener_survives_bad_input_and_keeps_serving() -> None:
    received: list[msgspec.Struct] = []
    address = PeerAddr("listener", "127.0.0.1", free_port())
    plane = ControlPlane(codec(), address, {Want: lambda _, m: received.append(m)})
    plane.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address.endpoint)
    try:
        dealer.send_multipart([b"one frame"])
        dealer.send_multipart([b"\x00" * 10, b"\x00", b"\x00"])  # checked: MAC first
        dealer.send_multipart(codec(None).encode(WANT, ME))  # no MAC
        dealer.send_multipart(codec().encode(Hello("g"), ME))  # valid, but no handler
        dealer.send_multipart(codec().encode(WANT, ME))
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert received == [WANT]
        assert plane.rejected == {
            "malformed": 1,
            "unauthenticated": 1,
            "auth_mismatch": 1,
            "unexpected": 1,
        }
    finally:
        dealer.close(linger=0)
        ctx.term()
        plane.close()


def test_senders_claiming_many_addresses_cost_bounded_sockets_and_threads() -> None:
    """Replies go to the address an envelope claims, and a Hello starts a pair-group setup:
    2000 spoofed senders once opened 2000 DEALERs (the process ran out of descriptors) and
    300 Hellos held 300 setup threads. Both are bounded now, and real peers still work."""
    import os

    from pagedkv.kv_transfer.p2p.pair_group import MAX_PENDING_SETUPS

    address = PeerAddr("victim", "127.0.0.1", free_port())
    groups: list[PairGroups] = []
    plane = ControlPlane(
        codec(),
        address,
        {
            Heartbeat: lambda peer, m: plane.send(peer, Heartbeat()),  # answers, as P does
            Hello: lambda peer, m: groups[0].on_hello(peer, m),
        },
        max_peers=16,
    )
    groups.append(PairGroups(address, plane.send, setup_timeout_s=1, op_timeout_s=1))
    plane.start()
    fds_before = len(os.listdir("/proc/self/fd"))
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address.endpoint)
    try:
        for i in range(600):
            spoofed = PeerAddr(f"spoof-{i}", "127.0.0.1", 20000 + i)
            dealer.send_multipart(codec().encode(Heartbeat(), spoofed))
        for i in range(3 * MAX_PENDING_SETUPS):
            dealer.send_multipart(codec().encode(Hello(f"g{i}"), PeerAddr(f"h{i}", "h", 1)))
        wait_until(lambda: plane.num_evicted_peers >= 600 - 16)
        assert len(plane._dealers) <= 16
        assert groups[0].num_pending <= MAX_PENDING_SETUPS
        # ~4 descriptors per pending setup; closed DEALERs let theirs go after their linger.
        wait_until(lambda: len(os.listdir("/proc/self/fd")) - fds_before < 200)
        # A real message still gets through and is answered.
        reply_port = free_port()
        inbox = ctx.socket(zmq.ROUTER)
        inbox.bind(f"tcp://127.0.0.1:{reply_port}")
        dealer.send_multipart(
            codec().encode(Heartbeat(), PeerAddr("real", "127.0.0.1", reply_port))
        )
        assert inbox.poll(5000), "no answer to a real peer"
        _, *frames = inbox.recv_multipart()
        assert isinstance(codec().decode(frames)[1], Heartbeat)
        inbox.close(linger=0)
    finally:
        dealer.close(linger=0)
        ctx.term()
        groups[0].close()
        plane.close()


def wait_until(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


# ---------------------------------------------------------------------------- leases, pool
def test_expiry_scans_every_lease_not_insertion_order() -> None:
    leases = LeaseTable(lease_s=10)
    leases.grant("early", now=0)
    leases.grant("late", now=1)
    leases.renew("early", now=5)  # now due at 15; "late" is due at 11
    assert leases.expired(now=12) == ["late"]
    assert not leases.renew("unknown", now=0)
    leases.release("late")
    assert leases.expired(now=16) == ["early"]


def test_a_full_send_pool_refuses_and_never_evicts() -> None:
    pool = SendPool(capacity_bytes=100)
    assert pool.reserve("a", 60)
    assert not pool.reserve("b", 60)
    assert pool.get("a") is not None and pool.used_bytes == 60
    pool.pop("a")
    assert pool.used_bytes == 0 and pool.reserve("b", 60)
    pool.pop("b")
    assert not pool.fill("b", [])  # its transfer ended meanwhile: nothing to fill


# ---------------------------------------------------------------------------- rendezvous
def test_the_pair_store_waits_with_a_timeout_and_can_be_abandoned() -> None:
    published = []
    store = PairStore(lambda k, v: published.append((k, v)), timeout_s=0.2)
    store.set("mine", b"1")
    assert published == [("mine", b"1")] and store.get("mine") == b"1"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        store.get("theirs")
    assert time.monotonic() - t0 < 2
    threading.Timer(0.05, store.deliver, args=("theirs", b"2")).start()
    store.wait(["theirs"])
    assert store.check(["mine", "theirs"])
    # A peer can't grow the mirror without bound: 64 keys, 16 KiB values.
    assert not store.deliver("big", b"x" * ((16 << 10) + 1))
    assert all(store.deliver(f"k{i}", b"v") for i in range(62))
    assert not store.deliver("one-too-many", b"v")
    store.abort("shutdown")
    with pytest.raises(RuntimeError, match="abandoned"):
        store.get("never")


def _two_instances():
    """Two control planes that route Hello/StoreSet to their PairGroups."""
    groups: dict[str, PairGroups] = {}
    planes = []
    for name in ("engine-a", "engine-b"):
        address = PeerAddr(name, "127.0.0.1", free_port())
        handlers = {
            Hello: lambda peer, m, n=name: groups[n].on_hello(peer, m),
            StoreSet: lambda peer, m, n=name: groups[n].on_store_set(peer, m),
        }
        plane = ControlPlane(codec(), address, handlers, name=name)
        groups[name] = PairGroups(address, plane.send, setup_timeout_s=10, op_timeout_s=10)
        plane.start()
        planes.append(plane)
    return planes, groups


class Guard:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_a_pair_group_moves_blocks_in_planned_messages(direct: bool) -> None:
    planes, groups = _two_instances()
    a, b = groups["engine-a"], groups["engine-b"]
    try:
        group_a = a.ensure(planes[1].address)
        pg_a = group_a.wait(10)
        group_b = b.get("engine-a")
        assert group_b is not None and group_b.name == group_a.name
        pg_b = group_b.wait(10)
        assert (group_a.rank, group_b.rank) == (0, 1)  # rank 0: the smaller engine id
        assert not dist.is_initialized()  # no global world

        torch.manual_seed(0)
        src = [torch.randn(2, 16, 4, 2, 8).half() for _ in range(3)]  # 3 layers, 16 blocks
        dst = [torch.zeros_like(c) for c in src]
        src_ids = [3, 7, 1, 9, 4, 5, 6]  # P: scattered, then a run (5, 6)
        dst_ids = [2, 3, 4, 10, 11, 12, 13] if direct else [13, 2, 8, 5, 11, 1, 14]
        segments = plan_segments(dst_ids, chunk_blocks=2, direct=direct)
        assert segments == ([2, 1, 2, 2] if direct else [2, 2, 2, 1])
        src_t, dst_t = torch.tensor(src_ids), torch.tensor(dst_ids)
        result = {}
        receiver = threading.Thread(
            target=lambda: result.update(
                n=receive_layers(
                    pg_b, 0, 5, [LayerBlocks(c, dst_t, segments) for c in dst], direct, 2048, 10,
                    Guard(), deadline=time.monotonic() + 10,
                )
            )
        )  # fmt: skip
        receiver.start()
        sender = BlockSender(pg_a, 1, 5, in_flight_bytes=2048, timeout_s=10)
        for cache in src:
            sender.send_layer(LayerBlocks(cache, src_t, segments))
        sender.finish()
        receiver.join(10)
        for s, d in zip(src, dst):
            assert torch.equal(d[:, dst_t], s[:, src_t])
            untouched = [i for i in range(16) if i not in dst_ids]
            assert not d[:, untouched].any()
        assert result["n"] == sender.num_bytes == 3 * 7 * src[0][:, 0].numel() * 2
    finally:
        for g in groups.values():
            g.close()
        for plane in planes:
            plane.close()


def test_runs_and_segments() -> None:
    assert runs([4, 5, 6, 9, 2, 3]) == [3, 1, 2] and runs([]) == []
    assert plan_segments([4, 5, 6, 9, 2, 3], chunk_blocks=2, direct=True) == [2, 1, 1, 2]
    assert plan_segments([4, 5, 6, 9, 2, 3], chunk_blocks=4, direct=False) == [4, 2]
    layer = LayerBlocks(torch.arange(2 * 8.0).view(2, 8, 1, 1, 1), torch.tensor([2, 3, 6]), [2, 1])
    assert list(layer.messages()) == [(0, 0, 2), (1, 0, 2), (0, 2, 3), (1, 2, 3)]
    assert layer.run_start(0, 2) == 2 and layer.run_start(1, 3) is None
    view = layer.pack(1, 0, 2, copy=False)  # a run: the cache itself, no copy
    assert view.data_ptr() == layer.cache[1, 2].data_ptr() and view.flatten().tolist() == [10, 11]
    assert layer.pack(0, 1, 3, copy=False).flatten().tolist() == [3.0, 6.0]


def test_simultaneous_group_setup_from_both_sides_settles_on_one_generation() -> None:
    planes, groups = _two_instances()
    try:
        first = groups["engine-a"].ensure(planes[1].address)
        second = groups["engine-b"].ensure(planes[0].address)
        winner = min(first.name, second.name)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ga, gb = groups["engine-a"].get("engine-b"), groups["engine-b"].get("engine-a")
            if ga and gb and ga.name == gb.name == winner and ga.pg and gb.pg:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the two sides did not agree on one pair group")
    finally:
        for g in groups.values():
            g.close()
        for plane in planes:
            plane.close()


# ---------------------------------------------------------------------------- config
def test_extra_config_is_validated_naming_the_key() -> None:
    from pagedkv.kv_transfer.kv_transfer_config import KVTransferConfig
    from pagedkv.kv_transfer.p2p.config import P2pConfig

    def config(**extra) -> P2pConfig:
        return P2pConfig.from_kv_transfer_config(
            KVTransferConfig("P2pConnector", "kv_producer", kv_connector_extra_config=extra)
        )

    assert config(send_type="GET", proxy_ip="127.0.0.1").send_type == "GET"
    for bad, match in (
        ({"sendtype": "GET"}, "unknown kv_connector_extra_config key"),
        ({"send_type": "PUSH"}, "send_type"),
        ({"lease_s": 0}, "lease_s"),
        ({"chunk_bytes": 0.5}, "chunk_bytes"),
        ({"shared_secret": ""}, "shared_secret"),
    ):
        with pytest.raises(ValueError, match=match):
            config(**bad)
    with pytest.raises(ValueError, match="kv_port"):
        P2pConfig.from_kv_transfer_config(KVTransferConfig("P2pConnector", "kv_both", kv_port=0))


def test_listening_beyond_loopback_without_a_secret_is_warned_about(caplog) -> None:
    import logging

    from pagedkv.kv_transfer.p2p.protocol import warn_if_open

    log = logging.getLogger("test")
    for host, secret in (("127.0.0.1", None), ("localhost", None), ("10.1.2.3", b"s")):
        warn_if_open(log, "the plane", host, secret)
    assert not caplog.records
    warn_if_open(log, "the plane", "0.0.0.0", None)
    assert "without a shared secret" in caplog.text


# ---------------------------------------------------------------------------- the worker
def p2p_worker_for(role: str, send_type: str = "PUT_ASYNC") -> p2p_worker.P2pConnectorWorker:
    """A real connector worker on loopback: one layer, one KV cache group of 16 blocks of 4."""
    from pagedkv.kv_cache.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
    from pagedkv.kv_cache.kv_cache_spec import FullAttentionSpec
    from pagedkv.kv_transfer.kv_transfer_config import KVTransferConfig

    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    config = KVTransferConfig(
        "P2pConnector", role, kv_port=free_port(),
        kv_connector_extra_config={"send_type": send_type, "shared_secret": SECRET.decode()},
    )  # fmt: skip
    kv_cache_config = KVCacheConfig(16, (KVCacheGroupSpec(("layers.0",), spec),))
    worker = p2p_worker.P2pConnectorWorker(config, kv_cache_config, "fp")
    worker.register_kv_caches([torch.randn(2, 16, 4, 2, 8)], [0])
    return worker


@pytest.mark.parametrize("end", ["cancel", "lease_expiry"])
def test_a_get_transfer_ended_while_p_copies_it_to_the_pool_frees_its_blocks(end) -> None:
    """GET: P copies a finished request's blocks into the pool on the engine thread, outside
    the lock (reserve, gather, fill). D's CANCEL (listener) or the lease expiring (maintenance)
    in between pops the reserved entry: fill once raised KeyError out of start_load_kv."""
    p = p2p_worker_for("kv_producer", send_type="GET")

    class EndedWhileCopying(SendPool):
        def reserve(self, key: str, num_bytes: int) -> bool:
            reserved = super().reserve(key, num_bytes)
            if end == "cancel":
                p._on_cancel(PeerAddr("D", "127.0.0.1", 1), Cancel(key, "client gone"))
            else:
                with p._lock:
                    p._expire_leases(time.monotonic() + 2 * p._leases.lease_s)
            return reserved

    try:
        pool = p._pool = EndedWhileCopying(capacity_bytes=1 << 20)
        hold = SendSpec("r1", "t1", 10, "h", ([3, 5, 7],), None)
        p.bind_connector_metadata(P2pConnectorMetadata(holds=[hold]))
        p.start_load_kv()
        assert p.get_finished().finished_sending == {"r1"}  # its blocks, freed once
        assert pool.get("t1") is None and pool.used_bytes == 0 and not p._outbound
        assert "t1" in p._ended
    finally:
        p.shutdown()


@pytest.fixture
def peer() -> Iterator[tuple[PeerAddr, queue.Queue]]:
    """A bare control plane as the other side: (its address, the DONEs and NACKs it hears)."""
    heard: queue.Queue = queue.Queue()
    address = PeerAddr("peer", "127.0.0.1", free_port())
    plane = ControlPlane(codec(), address, {Done: lambda _, m: heard.put(m),
                                             Nack: lambda _, m: heard.put(m)})  # fmt: skip
    plane.start()
    yield address, heard
    plane.close()


def test_an_error_before_a_receive_starts_still_ends_the_load(peer) -> None:
    """_receive runs on a pool whose Future swallows exceptions: one raised while it set up
    (before its try) once left the load RECEIVING for good, so its cancel was a no-op and D's
    request waited for its deadline. Now the load fails, is reported once, and P hears DONE."""
    address, heard = peer
    d = p2p_worker_for("kv_consumer")
    try:
        spec = LoadSpec("r1", "t1", address, None, 12, "h", ([0, 5, 6],), [[1, 2]])
        rec = Inbound(spec)  # never planned (no segments): building the receive raises
        with d._lock:
            d._inbound["r1"] = d._inbound_by_tid["t1"] = rec
        d._on_xfer_begin(address, XferBegin("t1", "g", 1))
        wait_until(lambda: rec.state.is_terminal)
        assert rec.state is TransferState.FAILED
        finished = d.get_finished()  # reported under the lock that ended it
        assert finished.finished_recving == {"r1"} and finished.invalid_block_ids == {5, 6}
        done = heard.get(timeout=5)
        assert isinstance(done, Done) and done.transfer_id == "t1" and not done.ok
    finally:
        d.shutdown()


def test_an_error_before_a_stream_send_starts_still_ends_the_send(peer) -> None:
    """_send_stream (PUT_ASYNC) runs on a pool whose Future swallows exceptions: its sender was
    built before its try, so an error there left the send SENDING for good. Now it fails, and
    D hears a NACK (group lost)."""
    address, heard = peer
    p = p2p_worker_for("kv_producer")
    try:
        want = Want("t1", "g", 8, "h", [[0, 1]], [[2]])
        rec = Outbound("t1", TransferState.SENDING, want, address)
        never_set_up = PairGroup(address, "g", 0, PairStore(lambda k, v: None, 1))  # no gloo
        with p._lock:
            p._outbound["t1"] = rec
        p._senders.submit(p._send_stream, p2p_worker._Stream(rec, never_set_up, 1, [])).result(5)
        assert rec.state is TransferState.FAILED and "t1" not in p._outbound
        nack = heard.get(timeout=5)
        assert isinstance(nack, Nack) and nack.transfer_id == "t1" and nack.group_lost
    finally:
        p.shutdown()


def test_wants_before_p_has_the_kv_cost_bounded_records(monkeypatch) -> None:
    """A WANT that comes before P's request reaches its KV is kept in a record for a lease.
    Such records are capped (NACKed past the cap), and a WANT too big for any prompt is
    refused before it is kept: a flood of WANTs for made-up transfers costs bounded memory."""
    monkeypatch.setattr(p2p_worker, "MAX_EARLY_WANTS", 8)
    p = p2p_worker_for("kv_producer")
    nacks: queue.Queue = queue.Queue()
    groups: list[PairGroups] = []
    address = PeerAddr("D", "127.0.0.1", free_port())
    d = ControlPlane(
        codec(),
        address,
        {
            Nack: lambda _, m: nacks.put(m),
            Hello: lambda peer, m: groups[0].on_hello(peer, m),
            StoreSet: lambda peer, m: groups[0].on_store_set(peer, m),
        },
    )
    groups.append(PairGroups(address, d.send, setup_timeout_s=10, op_timeout_s=10))
    d.start()
    try:
        group = groups[0].ensure(p.me)  # its Hello reaches P before the WANTs
        for i in range(20):
            d.send(p.me, Want(f"t{i}", group.name, 8, "h", [[0, 1]], [[2]]))
        d.send(p.me, Want("huge", group.name, 8, "h", [list(range(1000))], [[1000]]))
        refused = [nacks.get(timeout=10) for _ in range(13)]
        assert [n.transfer_id for n in refused] == [f"t{i}" for i in range(8, 20)] + ["huge"]
        assert all("8 transfers already wait for P's KV" in n.reason for n in refused[:-1])
        assert "more blocks than its prompt has" in refused[-1].reason
        with p._lock:
            assert sorted(p._outbound) == sorted(f"t{i}" for i in range(8))
    finally:
        p.shutdown()
        groups[0].close()
        d.close()
