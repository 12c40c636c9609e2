"""PD between instances of different tensor-parallel sizes over the P2P lanes: which P rank
sends which KV heads to which D rank (pure), a request's pieces joined into one report per
rank, and real transfers between the worker halves of every rank (threads of one process,
real control planes, pair groups and lanes, over shared memory and over gloo)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import torch

from pagedkv.distributed.shard import Shard, TPLayout, kv_head_shard
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_connector.params import KVTransferParams
from pagedkv.kv_transfer.p2p.connector import (
    LoadSpec,
    P2pConnectorMetadata,
    RemoteLoad,
    SendSpec,
    parse_remote_load,
)
from pagedkv.kv_transfer.p2p.head_plan import (
    piece_transfer_id,
    plan_pieces,
    rank_address,
)
from pagedkv.kv_transfer.p2p.tp_pieces import PieceReports
from pagedkv.kv_transfer.p2p.transfer_state import Finished
from pagedkv.kv_transfer.p2p.worker import P2pConnectorWorker
from pagedkv.transport.peer_addr import PeerAddr
from tests.kv_transfer.test_p2p_owners import run_forward
from tests.kv_transfer.test_p2p_units import SECRET, wait_until
from tests.ports import free_port_range

SIZES, HEADS = (1, 2, 4), (1, 2, 4, 8)
NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 8, 4, 32


# ---------------------------------------------------------------------------- the plan (pure)
@pytest.mark.parametrize(("p", "d", "num_kv_heads"), itertools.product(SIZES, SIZES, HEADS))
def test_every_d_rank_gets_each_of_its_heads_exactly_once_from_a_p_rank_holding_it(
    p: int, d: int, num_kv_heads: int
) -> None:
    pieces = plan_pieces(num_kv_heads, p, d)
    for d_rank in range(d):
        own = kv_head_shard(num_kv_heads, d_rank, d)
        got = [
            head
            for piece in pieces
            if piece.d_rank == d_rank
            for head in range(piece.kv_heads.start, piece.kv_heads.end)
        ]
        assert sorted(got) == list(range(own.start, own.end)), d_rank
    for piece in pieces:
        held = kv_head_shard(num_kv_heads, piece.p_rank, p)
        assert held.start <= piece.kv_heads.start and piece.kv_heads.end <= held.end
        assert piece.kv_heads.size >= 1
    for side in (0, 1):  # a rank's pieces travel under distinct transfer ids
        for rank in range(max(p, d)):
            ids = [piece_transfer_id("t", x, p, d) for x in pieces if x[side] == rank]
            assert len(set(ids)) == len(ids)
    if p == d:  # the same-TP path: rank r to rank r, whole blocks, the request's own id
        assert pieces == tuple((r, r, kv_head_shard(num_kv_heads, r, d)) for r in range(d))
        assert {piece_transfer_id("t", piece, p, d) for piece in pieces} == {"t"}


def test_the_plan_spreads_replicated_heads_and_says_who_sends_nothing() -> None:
    assert plan_pieces(8, 2, 1) == ((0, 0, Shard(0, 4)), (1, 0, Shard(4, 4)))
    assert plan_pieces(8, 1, 2) == ((0, 0, Shard(0, 4)), (0, 1, Shard(4, 4)))
    assert plan_pieces(1, 2, 1) == ((0, 0, Shard(0, 1)),)  # P rank 1 sends nothing
    assert plan_pieces(2, 4, 2) == ((0, 0, Shard(0, 1)), (3, 1, Shard(1, 1)))
    assert plan_pieces(2, 4, 1) == ((0, 0, Shard(0, 1)), (2, 0, Shard(1, 1)))


def test_each_rank_listens_at_its_own_address_rank_0_at_the_instances() -> None:
    base = PeerAddr("P", "127.0.0.1", 7000)
    assert rank_address(base, 0) == base
    assert rank_address(base, 3) == PeerAddr("P.tp3", "127.0.0.1", 7003)


# ---------------------------------------------------------------------------- joined reports
def test_a_split_request_is_reported_once_every_piece_has_ended() -> None:
    finished = Finished(lambda: None)
    reports = PieceReports(finished)
    reports.expect("r", ["r/a", "r/b"])
    reports.recving("r/a", {1, 2}, None)
    reports.in_progress(["r/b", "x"])
    out = finished.take()
    assert not out.finished_recving and out.loads_in_progress == {"r", "x"}
    assert reports.pieces_of("r") == ["r/b"] and reports.pieces_of("q") == ["q"]
    reports.recving("r/b", {3}, "P rank 1 lost")
    reports.recving("solo", set(), None)  # never split: straight through
    out = finished.take()
    assert out.finished_recving == {"r", "solo"} and out.invalid_block_ids == {1, 2, 3}
    assert out.load_errors == {"r": "P rank 1 lost"}
    assert reports.take_cancels() == []  # r/a had not failed: r/b was not cut short
    reports.expect("u", ["u/a", "u/b", "u/c"])
    reports.recving("u/b", set(), "P rank 1 lost")
    assert sorted(reports.take_cancels()) == ["u/a", "u/c"] and reports.take_cancels() == []
    reports.expect("s", ["s/a", "s/b"])
    reports.sending("s/b")
    assert not finished.take().finished_sending
    reports.sending("s/a")
    assert finished.take().finished_sending == {"s"}


# ---------------------------------------------------------------------------- real transfers
def worker(role: str, name: str, port: int, tp: TPLayout, wire: str, send_type: str):
    """Rank ``tp.rank`` of an instance: two layers of 32 blocks of 4, its KV heads random."""
    from pagedkv.kv_cache.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
    from pagedkv.kv_cache.kv_cache_spec import FullAttentionSpec
    from pagedkv.kv_connector.config import KVTransferConfig

    local = tp.kv_heads().size
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=local, head_size=HEAD_SIZE, dtype="float16"
    )
    extra = {"send_type": send_type, "shared_secret": SECRET.decode(), "heartbeat_s": 0.2,
             "same_host_transport": wire}  # fmt: skip
    config = KVTransferConfig(
        "P2pConnector", role, kv_port=port, engine_id=name, kv_connector_extra_config=extra
    )
    kv_cache_config = KVCacheConfig(NUM_BLOCKS, (KVCacheGroupSpec(("l.0", "l.1"), spec),))
    half = P2pConnectorWorker(config, kv_cache_config, "fp", tp)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, local, HEAD_SIZE)
    fill = torch.randn if role == "kv_producer" else torch.zeros
    half.register_kv_caches([fill(shape).half() for _ in range(2)], [0, 0])
    return half


@pytest.fixture
def instances() -> Iterator:
    made: list[P2pConnectorWorker] = []

    def make(role: str, name: str, size: int, wire: str, send_type: str = "PUT_ASYNC"):
        port = free_port_range(size)
        ranks = [
            worker(role, name, port, TPLayout(r, size, NUM_KV_HEADS), wire, send_type)
            for r in range(size)
        ]
        made.extend(ranks)
        return ranks

    yield make
    for half in made:
        half.shutdown()


def collect(ranks: list[P2pConnectorWorker], field: str, want: set[str], failures=False):
    """What each rank reported in ``field`` over a few steps, once each has reported ``want``
    (no failure among them unless ``failures``: then each rank's whole reports, merged)."""
    seen = [KVConnectorOutput() for _ in ranks]
    deadline = time.monotonic() + 15
    while any(getattr(s, field) != want for s in seen) and time.monotonic() < deadline:
        for i, half in enumerate(ranks):
            out = half.get_finished()
            assert failures or not (out.invalid_block_ids or out.load_errors), out.load_errors
            seen[i] = KVConnectorOutput.merge([seen[i], out])
        time.sleep(0.05)
    return seen if failures else [getattr(s, field) for s in seen]


def lanes_up(half: P2pConnectorWorker, num_records: int) -> bool:
    groups = half.peers.groups.all()
    return half.outbound.num_records == num_records and all(g.send_lane for g in groups)


@pytest.mark.parametrize("wire", ["shm", "network"])
@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize(
    ("send_type", "in_forward"), [("PUT", True), ("PUT_ASYNC", True), ("PUT_ASYNC", False),
                                  ("GET", False)]
)  # fmt: skip
def test_each_d_rank_receives_exactly_its_heads_from_the_p_ranks_holding_them(
    instances, wire: str, p: int, d: int, send_type: str, in_forward: bool
) -> None:
    """P at TP ``p``, D at TP ``d``: every D rank's blocks hold, byte for byte, its KV heads
    of P's blocks (gathered from whichever P ranks hold them), sent as P's forward computes
    them or afterwards, each rank reports the request once, and nothing else of D's cache is
    touched."""
    ps = instances("kv_producer", "P", p, wire, send_type)
    ds = instances("kv_consumer", "D", d, wire)
    src_ids, dst_ids = [5, 6, 7, 9, 2], [20, 21, 22, 3, 30]
    n = BLOCK_SIZE * len(src_ids)
    send = SendSpec("rp", "t1", n, "h", (src_ids,), "D")
    load = LoadSpec("rd", "t1", ps[0].me, None, n, "h", (dst_ids,), [list(range(5))], p)
    for half in ds:
        run_forward(half, P2pConnectorMetadata(loads=[load]))
    computing = []
    if in_forward:  # the WANTs are there and the lanes up: sent during the forward
        wait_until(lambda: all(lanes_up(half, max(1, d // p)) for half in ps))
        computing = [send]
    sizes = {"t1": d}
    for half in ps:  # the step completing the prompt, then the one after it finished
        run_forward(half, P2pConnectorMetadata(computing=computing, remote_tp_sizes=sizes))
        run_forward(half, P2pConnectorMetadata(holds=[send], remote_tp_sizes=sizes))
        assert half.get_kv_connector_stats()["num_streamed_sends"] == in_forward * max(1, d // p)
    assert collect(ds, "finished_recving", {"rd"}) == [{"rd"}] * d
    assert collect(ps, "finished_sending", {"rp"}) == [{"rp"}] * p
    whole = [torch.cat([half.kv_caches[layer] for half in ps], dim=3) for layer in range(2)]
    for layer in range(2):
        for r, half in enumerate(ds):
            heads = kv_head_shard(NUM_KV_HEADS, r, d)
            got, cache = half.kv_caches[layer], whole[layer][:, :, :, heads.start : heads.end]
            assert torch.equal(got[:, dst_ids], cache[:, src_ids]), (layer, r)
            untouched = [i for i in range(NUM_BLOCKS) if i not in dst_ids]
            assert not got[:, untouched].any()


def test_a_p_rank_whose_heads_another_rank_sends_reports_at_once(instances) -> None:
    """One KV head replicated on P's two ranks, D at TP1: only P rank 0 sends; rank 1 reports
    the request sent as soon as its blocks are held, and D never talks to it."""
    ps = [
        worker("kv_producer", "P1", free_port_range(2), TPLayout(r, 2, 1), "shm", "PUT_ASYNC")
        for r in range(2)
    ]
    try:
        send = SendSpec("rp", "t1", 8, "h", ([1, 2],), None)
        run_forward(ps[1], P2pConnectorMetadata(holds=[send], remote_tp_sizes={"t1": 1}))
        assert ps[1].get_finished().finished_sending == {"rp"}
        run_forward(ps[0], P2pConnectorMetadata(holds=[send], remote_tp_sizes={"t1": 1}))
        assert not ps[0].get_finished().finished_sending  # waits for D's WANT
        assert ps[0].outbound.num_records == 1 and ps[1].outbound.num_records == 0
    finally:
        for half in ps:
            half.shutdown()


def test_a_d_that_planned_for_another_p_size_fails_fast_naming_it(instances) -> None:
    """D believes P has one rank (no remote_tp_size), P has two: P's rank 0 refuses the
    WANT at once, naming both sizes; D's load fails (its blocks invalid) without waiting for
    its deadline."""
    ps = instances("kv_producer", "P", 2, "shm")
    (d,) = instances("kv_consumer", "D", 1, "shm")
    load = LoadSpec("rd", "t1", ps[0].me, None, 8, "h", ([3, 4],), [[0, 1]])
    run_forward(d, P2pConnectorMetadata(loads=[load]))
    out = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        out = d.get_finished()
        if out.finished_recving:
            break
        time.sleep(0.05)
    assert out is not None and out.finished_recving == {"rd"}
    assert out.invalid_block_ids == {3, 4}
    assert "D planned for a P of 1 tensor-parallel ranks, this P has 2" in out.load_errors["rd"]


def test_a_lost_p_rank_fails_the_loads_it_was_part_of_and_only_those(instances) -> None:
    """P at TP2 loses its rank 1 while D (TP1) waits for both halves of two requests: D
    reports each once, failed (all its blocks invalid, the lost rank named), at once: the
    halves from the live rank 0 are cancelled, which frees P's blocks there as soon as they
    are held."""
    ps = instances("kv_producer", "P", 2, "shm")
    (d,) = instances("kv_consumer", "D", 1, "shm")
    loads = [
        LoadSpec(f"rd{i}", f"t{i}", ps[0].me, None, 8, "h", ([3 + 2 * i, 4 + 2 * i],), [[0, 1]], 2)
        for i in range(2)
    ]
    run_forward(d, P2pConnectorMetadata(loads=loads))
    wait_until(lambda: all(lanes_up(half, 2) for half in ps))
    ps[1].shutdown()  # its goodbye fails D's pieces from it at once, and their siblings
    out = collect([d], "finished_recving", {"rd0", "rd1"}, failures=True)[0]
    assert out.finished_recving == {"rd0", "rd1"} and out.invalid_block_ids == {3, 4, 5, 6}
    assert all("P.tp1" in out.load_errors[rid] for rid in ("rd0", "rd1"))
    sends = [SendSpec(f"rp{i}", f"t{i}", 8, "h", ([1, 2],), "D") for i in range(2)]
    run_forward(ps[0], P2pConnectorMetadata(holds=sends, remote_tp_sizes={"t0": 1, "t1": 1}))
    assert collect(ps[:1], "finished_sending", {"rp0", "rp1"}) == [{"rp0", "rp1"}]
    assert ps[0].get_kv_connector_stats()["num_sends_delivered"] == 0


def test_the_other_sides_size_travels_in_the_params_and_a_bad_one_fails_the_load() -> None:
    p = PeerAddr("P", "127.0.0.1", 7000)
    handoff = KVTransferParams.handoff("t", p, to="decode", remote_tp_size=2).to_dict()
    assert handoff["remote_tp_size"] == 2
    assert parse_remote_load(handoff) == RemoteLoad("t", p, None, 2)
    for bad in (0, -1, "2", 2.5, True):
        load = parse_remote_load({**handoff, "remote_tp_size": bad})
        assert load.remote is None and "remote_tp_size" in load.error, bad
