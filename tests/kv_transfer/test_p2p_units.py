"""The P2P connector's pieces in one process: wire format, control plane, leases, send pool,
rendezvous store, pair groups, config. (The data path: test_p2p_lanes.py; the owners:
test_p2p_owners.py.)"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from pagedkv.kv_transfer.p2p.lease import LeaseTable
from pagedkv.kv_transfer.p2p.pair_group import PairGroups
from pagedkv.kv_transfer.p2p.protocol import MESSAGE_TYPES, Cancel, Heartbeat, Hello, StoreSet, Want
from pagedkv.kv_transfer.p2p.rendezvous import PairStore
from pagedkv.kv_transfer.p2p.send_pool import SendPool
from pagedkv.transport.codec import PROTOCOL_VERSION, Codec, Envelope, ProtocolError
from pagedkv.transport.control_plane import ControlPlane
from pagedkv.transport.peer_addr import PeerAddr
from tests.ports import free_port

SECRET = b"unit-secret"
ME = PeerAddr("engine-a", "127.0.0.1", 1)
WANT = Want("t1", "g", 40, "h", [[1, 2]], [[2]])


def codec(secret: bytes | None = SECRET, compat: str = "fp", limit: int = 4096) -> Codec:
    return Codec(compat, secret, limit, MESSAGE_TYPES)


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


def test_a_handler_answers_only_with_a_message(caplog) -> None:
    """A handler's return value goes back on the sender's connection, so a handler that
    returns something else (benchmarks/pd_transfer.py's returned the lane's bool) is reported
    as the bug it is, once per message, and the listener goes on; a message is answered."""
    address = PeerAddr("listener", "127.0.0.1", free_port())
    handlers = {Want: lambda _, m: True, Hello: lambda _, m: Hello("answer")}
    plane = ControlPlane(codec(), address, handlers)
    plane.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address.endpoint)
    try:
        dealer.send_multipart(codec().encode(WANT, ME))
        dealer.send_multipart(codec().encode(Hello("g"), ME))
        assert dealer.poll(5000), "no answer"
        envelope, answer = codec().decode(dealer.recv_multipart())
        assert answer == Hello("answer") and envelope.sender == address
        assert "a handler returned True: only a message is answered" in caplog.text
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
        assert plane.num_peers <= 16
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


def test_a_forgotten_peer_still_gets_what_was_queued_and_costs_no_new_socket() -> None:
    """A peer that went away keeps its DEALER for a while: a message queued to it before (a
    CANCEL to a P that was only hung) reaches it when it comes back, a late message reuses
    that DEALER instead of opening another, and it is closed when its time is up."""
    heard: list = []
    address = PeerAddr("hung", "127.0.0.1", free_port())
    sender = ControlPlane(codec(), PeerAddr("me", "127.0.0.1", free_port()), {})
    try:
        sender.send(address, Heartbeat(["queued before"]))  # nobody listens yet
        sender.forget(address, keep_s=30, now=0.0)
        sender.send(address, Heartbeat(["late"]))
        assert sender.num_peers == 1
        plane = ControlPlane(codec(), address, {Heartbeat: lambda _, m: heard.append(m)})
        plane.start()  # the peer resumes
        wait_until(lambda: len(heard) == 2)
        assert [m.transfer_ids for m in heard] == [["queued before"], ["late"]]
        sender.close_retired(now=29.0)
        assert sender.num_peers == 1
        sender.close_retired(now=31.0)
        assert sender.num_peers == 0
        plane.close()
    finally:
        sender.close()


def test_a_cancel_queued_behind_its_want_is_handled_first() -> None:
    """P was SIGSTOPped: D's WANT, then D's CANCEL (D gave up) queued on P's listener. Read
    together on resume, the CANCELs of the batch are handled first, in their order, then the
    rest in theirs: P ends the transfer by D's word instead of starting a send to a D that
    has torn its side down (the flaky `test_a_cancel_reaches_a_p_that_was_only_hung`: P's
    send failed with "Connection refused" and the CANCEL found nothing to cancel)."""
    handled: list[msgspec.Struct] = []
    address = PeerAddr("hung", "127.0.0.1", free_port())
    record = lambda _, m: handled.append(m)  # noqa: E731
    plane = ControlPlane(
        codec(), address, {Want: record, Cancel: record, Heartbeat: record}, first=(Cancel,)
    )
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address.endpoint)
    queued = [WANT, Heartbeat(["t1"]), Cancel("t1", "P silent"), Want("t2", "g", 4, "h", [[0]],
              [[1]]), Cancel("t2", "P silent")]  # fmt: skip
    try:
        for message in queued:
            dealer.send_multipart(codec().encode(message, ME))
        dealer.send_multipart([b"one frame"])  # a refused one in the batch changes nothing
        time.sleep(0.5)  # all of it queued on the listener's socket, nobody reading
        plane.start()
        wait_until(lambda: len(handled) == len(queued))
        assert handled == [queued[2], queued[4], queued[0], queued[1], queued[3]]
        assert plane.rejected == {"malformed": 1}
    finally:
        dealer.close(linger=0)
        ctx.term()
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


def _two_instances(transport: str = "network", ring_capacity: int = 32 << 20):
    """Two control planes that route Hello/StoreSet to their PairGroups (``transport``: their
    same_host_transport; in one process they are on one host)."""
    groups: dict[str, PairGroups] = {}
    planes = []
    for name in ("engine-a", "engine-b"):
        address = PeerAddr(name, "127.0.0.1", free_port())
        handlers = {
            Hello: lambda peer, m, n=name: groups[n].on_hello(peer, m),
            StoreSet: lambda peer, m, n=name: groups[n].on_store_set(peer, m),
        }
        plane = ControlPlane(codec(), address, handlers, name=name)
        groups[name] = PairGroups(
            address, plane.send, 10, 10, same_host_transport=transport, ring_capacity=ring_capacity
        )
        plane.start()
        planes.append(plane)
    return planes, groups


def test_simultaneous_group_setup_from_both_sides_settles_on_one_generation() -> None:
    planes, groups = _two_instances()
    try:
        first = groups["engine-a"].ensure(planes[1].address)
        second = groups["engine-b"].ensure(planes[0].address)
        winner = min(first.name, second.name)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ga, gb = groups["engine-a"].get("engine-b"), groups["engine-b"].get("engine-a")
            if ga and gb and ga.name == gb.name == winner and ga.wire and gb.wire:
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
    from pagedkv.kv_connector.config import KVTransferConfig
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

    from pagedkv.transport.peer_addr import warn_if_open

    log = logging.getLogger("test")
    for host, secret in (("127.0.0.1", None), ("localhost", None), ("10.1.2.3", b"s")):
        warn_if_open(log, "the plane", host, secret)
    assert not caplog.records
    warn_if_open(log, "the plane", "0.0.0.0", None)
    assert "without a shared secret" in caplog.text
