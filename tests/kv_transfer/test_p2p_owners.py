"""The P2P worker's owners driven through their events, in one process over loopback: P's
OutboundTransfers, D's InboundTransfers and Peers (real control planes, pair groups and
lanes; tests read what the owners report and what the peer hears, never a private field)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from pagedkv.kv_transfer.p2p import outbound as outbound_module
from pagedkv.kv_transfer.p2p.config import P2pConfig
from pagedkv.kv_transfer.p2p.connector import LoadSpec, P2pConnectorMetadata, RemoteLoad, SendSpec
from pagedkv.kv_transfer.p2p.pair_group import PairGroups
from pagedkv.kv_transfer.p2p.peers import Peers
from pagedkv.kv_transfer.p2p.protocol import Cancel, Hello, Nack, StoreSet, Want
from pagedkv.kv_transfer.p2p.send_pool import SendPool
from pagedkv.kv_transfer.p2p.worker import P2pConnectorWorker
from pagedkv.transport.control_plane import ControlPlane
from pagedkv.transport.peer_addr import PeerAddr
from tests.kv_transfer.test_p2p_units import SECRET, codec, wait_until
from tests.ports import free_port

BLOCK_SIZE, NUM_BLOCKS = 4, 32


def p2p_worker_for(role: str, send_type: str = "PUT_ASYNC", name: str | None = None,
                   **extra) -> P2pConnectorWorker:  # fmt: skip
    """A real connector worker on loopback: two layers, one KV cache group of 32 blocks of 4."""
    from pagedkv.kv_cache.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
    from pagedkv.kv_cache.kv_cache_spec import FullAttentionSpec
    from pagedkv.kv_connector.config import KVTransferConfig

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype="float32")
    top = {k: extra.pop(k) for k in list(extra) if k.startswith("kv_")}
    config = KVTransferConfig(
        "P2pConnector", role, kv_port=free_port(), engine_id=name or role,
        kv_connector_extra_config={"send_type": send_type, "shared_secret": SECRET.decode(),
                                   "heartbeat_s": 0.2, **extra}, **top,
    )  # fmt: skip
    kv_cache_config = KVCacheConfig(NUM_BLOCKS, (KVCacheGroupSpec(("layers.0", "layers.1"), spec),))
    worker = P2pConnectorWorker(config, kv_cache_config, "fp")
    caches = [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8) for _ in range(2)]
    worker.register_kv_caches(caches, [0, 0])
    return worker


@pytest.fixture
def workers() -> Iterator:
    made: list[P2pConnectorWorker] = []

    def make(*args, **kwargs) -> P2pConnectorWorker:
        made.append(p2p_worker_for(*args, **kwargs))
        return made[-1]

    yield make
    for worker in made:
        worker.shutdown()


def load_spec(request_id: str, tid: str, p: P2pConnectorWorker, ids: list[int], num_tokens: int):
    return LoadSpec(request_id, tid, p.me, None, num_tokens, "h", (ids,), [list(range(len(ids)))])


def run_forward(worker: P2pConnectorWorker, meta: P2pConnectorMetadata) -> None:
    """One step of the worker's engine hooks, the forward writing nothing new."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    for layer, cache in enumerate(worker.kv_caches):
        worker.save_kv_layer(layer, cache, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


# ---------------------------------------------------------------------------- a whole transfer
@pytest.mark.parametrize("send_type", ["PUT", "PUT_ASYNC", "GET"])
@pytest.mark.parametrize("when", ["in_the_forward", "after_it"])
def test_transfers_go_end_to_end_through_the_owners(workers, send_type, when) -> None:
    """D's loads ask, P's transfers go out as one batch (in the forward that computes them
    for PUT/PUT_ASYNC, else from the held blocks or GET's pool), each lands in D's blocks,
    each side reports each transfer once, and D counts blocks and tokens received."""
    p = workers("kv_producer", send_type, name="P")
    d = workers("kv_consumer", name="D")
    src_ids = {"t1": [5, 6, 7], "t2": [9, 2], "t3": [11, 12, 13, 14]}
    dst_ids = {"t1": [20, 21, 22], "t2": [3, 30], "t3": [1, 8, 16, 24]}
    specs = {tid: SendSpec(f"r-{tid}", tid, 4 * len(ids), "h", (ids,), "D")
             for tid, ids in src_ids.items()}  # fmt: skip
    for tid, ids in dst_ids.items():
        d.inbound.on_load(load_spec(f"r-{tid}", tid, p, ids, 4 * len(ids)))
    wait_until(lambda: p.outbound.num_records == 3 and p.peers.stats()["pair_groups"] == 1)
    wait_until(lambda: (g := p.peers.groups.get("D")) is not None and g.send_lane is not None)
    computing = list(specs.values()) if when == "in_the_forward" else []
    run_forward(p, P2pConnectorMetadata(computing=computing, holds=list(specs.values())))
    wait_until(lambda: d.inbound.num_loads == 0)
    finished = d.get_finished()
    assert finished.finished_recving == {"r-t1", "r-t2", "r-t3"}
    assert not finished.invalid_block_ids and not finished.load_errors
    for tid in src_ids:
        for src, dst in zip(p.kv_caches, d.kv_caches):
            assert torch.equal(dst[:, dst_ids[tid]], src[:, src_ids[tid]]), tid
    wait_until(lambda: p.outbound.num_records == 0)
    sent = set()
    for _ in range(50):
        sent |= p.get_finished().finished_sending
        if len(sent) == 3:
            break
        time.sleep(0.05)
    assert sent == {"r-t1", "r-t2", "r-t3"}
    stats = d.get_kv_connector_stats()
    assert stats["num_loads_delivered"] == 3 and stats["num_blocks_received"] == 9
    assert stats["num_tokens_received"] == 36
    assert p.get_kv_connector_stats()["num_sends_delivered"] == 3
    assert p.pool.used_bytes == 0


# ---------------------------------------------------------------------------- P's events
@pytest.mark.parametrize("end", ["cancel", "lease_expiry"])
def test_a_get_transfer_ended_while_p_copies_it_to_the_pool_frees_its_blocks(workers, end) -> None:
    """GET: P copies a finished request's blocks into the pool on the engine thread, outside
    the owner's lock. D's CANCEL (listener) or the lease expiring (maintenance) in between
    ends the transfer: its blocks are freed once, the pool entry goes (the copy that was
    being made is dropped)."""
    p = workers("kv_producer", "GET")
    outbound = p.outbound

    class EndedWhileCopying(SendPool):
        def reserve(self, key: str, num_bytes: int) -> bool:
            reserved = super().reserve(key, num_bytes)
            if end == "cancel":
                outbound.on_cancel(PeerAddr("D", "127.0.0.1", 1), Cancel(key, "client gone"))
            else:
                outbound.on_tick(time.monotonic() + 2 * p.p2p_config.lease_s)
            return reserved

    pool = p.send_context.pool = EndedWhileCopying(capacity_bytes=1 << 20)
    outbound.on_hold(SendSpec("r1", "t1", 10, "h", ([3, 5, 7],), None))
    assert p.get_finished().finished_sending == {"r1"}  # its blocks, freed once
    assert pool.get("t1") is None and pool.used_bytes == 0 and outbound.num_records == 0
    assert outbound.ended_reason("t1").startswith(
        "failed: cancelled" if end == "cancel" else "expired"
    )


def test_wants_before_p_has_the_kv_cost_bounded_records(workers, monkeypatch) -> None:
    """A WANT that comes before P's request reaches its KV is kept in a record for a lease.
    Such records are capped (NACKed past the cap), and a WANT too big for any prompt is
    refused before it is kept: a flood of WANTs for made-up transfers costs bounded memory."""
    monkeypatch.setattr(outbound_module, "MAX_EARLY_WANTS", 8)
    p = workers("kv_producer", name="P")
    nacks: list[Nack] = []
    groups: list[PairGroups] = []
    address = PeerAddr("D", "127.0.0.1", free_port())
    d = ControlPlane(
        codec(),
        address,
        {
            Nack: lambda _, m: nacks.append(m),
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
        wait_until(lambda: len(nacks) == 13)
        assert [n.transfer_id for n in nacks] == [f"t{i}" for i in range(8, 20)] + ["huge"]
        assert all("8 transfers already wait for P's KV" in n.reason for n in nacks[:-1])
        assert "more blocks than its prompt has" in nacks[-1].reason
        assert p.outbound.num_records == 8
    finally:
        groups[0].close()
        d.close()


def test_a_transfer_d_has_queued_keeps_its_kv_past_ps_lease(workers) -> None:
    """P holds a request's KV under a 1 s lease; D has the request but no room to admit it
    yet. D names it in its heartbeats (queued), so P keeps it for as long as D does, while a
    transfer no D knows of expires; when the request ends on D before its load, P frees at
    once. (Before, P let the lease expire and the load D started later was refused: the
    preemption storm test's empty outputs.)"""
    p = workers("kv_producer", name="P", lease_s=1.0)
    d = workers("kv_consumer", name="D")
    for tid in ("queued", "nobody"):
        p.outbound.on_hold(SendSpec(f"r-{tid}", tid, 8, "h", ([1, 2],), None))
    load = RemoteLoad("queued", p.me, None)
    d.inbound.on_queued(load)
    wait_until(lambda: p.outbound.ended_reason("nobody") is not None)
    assert p.outbound.ended_reason("nobody").startswith("expired")
    time.sleep(1.5)  # past its lease too
    assert p.outbound.ended_reason("queued") is None and p.outbound.num_records == 1
    d.inbound.on_abandon(load)
    wait_until(lambda: p.outbound.num_records == 0)
    assert p.outbound.ended_reason("queued") == "failed: cancelled by D: request ended"


# ---------------------------------------------------------------------------- D's events
def test_a_cancelled_load_is_reported_once_and_p_hears_it(workers) -> None:
    """The scheduler cancels a load before its data came: it is reported at once with its
    blocks invalid and a reason, P frees the KV it held (CANCEL), and when the data comes
    anyway it drains (nothing lands in the blocks) and P hears it was not delivered."""
    p = workers("kv_producer", name="P")
    d = workers("kv_consumer", name="D")
    d.inbound.on_load(load_spec("r1", "t1", p, [4, 5], 8))
    wait_until(lambda: p.outbound.num_records == 1)
    d.inbound.on_cancel("r1", "past kv_load_timeout")
    finished = d.get_finished()
    assert finished.finished_recving == {"r1"} and finished.invalid_block_ids == {4, 5}
    assert "from P" in finished.load_errors["r1"]
    assert "past kv_load_timeout" in finished.load_errors["r1"]
    wait_until(lambda: p.outbound.num_records == 0)
    assert p.outbound.ended_reason("t1").startswith("failed: cancelled by D")
    before = [cache[:, [4, 5]].clone() for cache in d.kv_caches]
    d.inbound.on_load(load_spec("r2", "t2", p, [6], 4))  # the next one still arrives
    wait_until(lambda: p.outbound.num_records == 1)
    run_forward(p, P2pConnectorMetadata(holds=[SendSpec("rp", "t2", 4, "h", ([9],), None)]))
    wait_until(lambda: "r2" in d.get_finished().finished_recving)
    assert torch.equal(d.kv_caches[0][:, 6], p.kv_caches[0][:, 9])
    assert all(torch.equal(b, c[:, [4, 5]]) for b, c in zip(before, d.kv_caches))


def test_a_heartbeat_never_names_a_load_before_its_want_went_out(workers) -> None:
    """D registers a load, then makes sure of the pair group, then sends the WANT. A heartbeat
    in between once named the transfer as awaited: P, which had never heard of it, NACKed it
    as "unknown transfer (P restarted?)" and the request failed (1P1D GET with two CPU hogs,
    one request in 141). Until its WANT is out, a load is only named as queued."""
    p = workers("kv_producer", "GET", name="P")
    d = workers("kv_consumer", name="D")
    ensure = d.peers.ensure

    def slow_ensure(peer):
        group = ensure(peer)
        time.sleep(1.0)  # five heartbeats go out meanwhile
        return group

    d.peers.ensure = slow_ensure
    d.inbound.on_load(load_spec("r1", "t1", p, [4, 5], 8))
    wait_until(lambda: p.outbound.num_records == 1)
    run_forward(p, P2pConnectorMetadata(holds=[SendSpec("rp", "t1", 8, "h", ([9, 10],), None)]))
    wait_until(lambda: d.inbound.num_loads == 0)
    finished = d.get_finished()
    assert finished.finished_recving == {"r1"} and not finished.load_errors
    assert torch.equal(d.kv_caches[0][:, [4, 5]], p.kv_caches[0][:, [9, 10]])


def test_a_load_from_a_peer_that_refuses_our_messages_fails_fast_naming_it(workers) -> None:
    """The shared secret is set on P only: P refuses D's WANT as an authentication mismatch
    and tells D (whose listener refuses P's reply the same way). D's load fails within a
    second or two (not when P is found silent), and the reason names P and the mismatch."""
    p = workers("kv_producer", name="P")
    d = workers("kv_consumer", name="D", shared_secret=None)
    t0 = time.monotonic()
    d.inbound.on_load(load_spec("r1", "t1", p, [4], 4))
    wait_until(lambda: d.inbound.num_loads == 0, timeout_s=5)
    assert time.monotonic() - t0 < 3
    error = d.get_finished().load_errors["r1"]
    assert "P (tcp://127.0.0.1:" in error and "authentication mismatch" in error
    assert p.get_kv_connector_stats()["num_rejected_auth_mismatch"] >= 1
    assert d.get_kv_connector_stats()["num_rejected_auth_mismatch"] >= 1


# ---------------------------------------------------------------------------- Peers
@pytest.fixture
def bare_peers() -> Iterator:
    """``make(name, **p2p)``: a Peers with no transfers, its clock driven by the test."""
    made: list[Peers] = []

    def make(name: str, **knobs) -> Peers:
        p2p = P2pConfig(heartbeat_s=0.2, peer_timeout_s=1.0, lease_s=1.0, **knobs)
        me = PeerAddr(name, "127.0.0.1", free_port())
        peers = Peers(me, codec(), p2p, {}, num_layers=0, name=name)
        peers.bind(None, None)
        peers.start()
        made.append(peers)
        return peers

    yield make
    for peers in made:
        peers.close()


def up(a: Peers, b: Peers):
    """Set up the group between a and b; (a's side, b's side)."""
    group = a.ensure(b.me)
    wait_until(lambda: group.is_up and (g := b.groups.get(a.me.engine_id)) is not None and g.is_up)
    return group, b.groups.get(a.me.engine_id)


def test_a_silent_peer_is_lost_and_its_group_released_but_a_pause_is_not_silence(
    bare_peers,
) -> None:
    """No word from the peer for peer_timeout_s (1 s): the group is torn down and its
    process group released. A gap between this side's own ticks (the process was stopped or
    starved) does not count as the peer's silence."""
    import gc
    import weakref

    a, b = bare_peers("a"), bare_peers("b")
    group, _ = up(a, b)
    pg = weakref.ref(group.wire)
    now = time.monotonic()
    a.on_tick(now, lambda: {})
    a.on_tick(now + 30, lambda: {})  # a paused for 30 s: b had no chance to be heard
    assert a.groups.get("b") is group
    a.on_tick(now + 30.5, lambda: {})
    a.on_tick(now + 31.0, lambda: {})
    a.on_tick(now + 31.2, lambda: {})  # ticking normally, and b silent for more than 1 s
    assert a.groups.get("b") is None and a.stats()["num_pair_groups_torn_down_peer_lost"] == 1
    del group
    gc.collect()
    assert pg() is None
    wait_until(lambda: b.groups.get("a") is None)  # a said goodbye
    assert b.stats()["num_pair_groups_torn_down_goodbye"] == 1


def test_heartbeats_keep_a_quiet_group_and_idle_ones_go(bare_peers) -> None:
    a, b = bare_peers("a", idle_ttl_s=3.0), bare_peers("b", idle_ttl_s=3.0)
    up(a, b)
    t = time.monotonic()
    for step in range(12):  # 2.4 s of heartbeats both ways: nobody is silent
        for side in (a, b):
            side.on_tick(t + 0.2 * step, lambda: {})
        time.sleep(0.2)
    assert a.groups.get("b") is not None and b.groups.get("a") is not None
    a.on_tick(time.monotonic() + 3.5, lambda: {})  # no transfer for more than idle_ttl_s
    assert a.groups.get("b") is None and a.stats()["num_pair_groups_torn_down_idle"] == 1
    wait_until(lambda: b.groups.get("a") is None)


def test_live_groups_are_capped_least_recently_used_first(bare_peers) -> None:
    hub = bare_peers("hub", max_pair_groups=2)
    others = [bare_peers(f"d{i}") for i in range(3)]
    up(hub, others[0])
    up(hub, others[1])
    hub.ensure(others[0].me)  # d0 used again: d1 is the least recently used
    up(hub, others[2])
    assert {g.peer.engine_id for g in hub.groups.all()} == {"d0", "d2"}
    assert hub.stats()["num_pair_groups_torn_down_evicted"] == 1
    wait_until(lambda: others[1].groups.get("hub") is None)  # told: BYE
