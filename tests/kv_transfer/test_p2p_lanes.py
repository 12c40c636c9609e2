"""The data path of one pair group, in one process over a real two-rank gloo group and over a
real shared-memory segment: P's send lane and D's receive lane, batches, drains, teardown, and
the staging ring."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from pagedkv.kv_transfer.p2p.lanes import Job, StagingRing
from pagedkv.kv_transfer.p2p.protocol import XferBegin, XferPart
from pagedkv.kv_transfer.p2p.receive_lane import ReceiveLane
from pagedkv.kv_transfer.p2p.send_modes import HeldSource, SendContext
from pagedkv.kv_transfer.p2p.send_pool import SendPool
from pagedkv.kv_transfer.p2p.shm_lanes import lane_classes
from pagedkv.kv_transfer.p2p.transfer import LayerBlocks, consecutive_start, plan_segments
from tests.kv_transfer.test_p2p_units import _two_instances, wait_until

NUM_LAYERS, NUM_BLOCKS = 3, 24


#: The shared-memory rings are small (4 KiB: two messages of these tests), so P waits for D.
SHM_RING_BYTES = 4096


@pytest.fixture(params=["network", "shm"])
def pair(request):
    """Two instances' control planes and pair groups, the group between them set up over gloo
    ("network") or shared memory."""
    planes, groups = _two_instances(request.param, SHM_RING_BYTES)
    a, b = groups["engine-a"], groups["engine-b"]
    group_a = a.ensure(planes[1].address)
    group_a.ready.wait(10)
    wait_until(lambda: b.get("engine-a") is not None and b.get("engine-a").wire is not None)
    assert group_a.wire.kind == {"network": "gloo", "shm": "shm"}[request.param]
    try:
        yield group_a, b.get("engine-a"), groups
    finally:
        for g in groups.values():
            g.close()
        for plane in planes:
            plane.close()


class Load:
    """A receive target, as InboundTransfers' records are."""

    def __init__(self, cancelled: bool = False) -> None:
        self.lock = threading.Lock()
        self.cancelled = cancelled
        self.posted = 0


def caches(fill: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shape = (2, NUM_BLOCKS, 4, 2, 8)
    return [torch.randn(shape).half() if fill else torch.zeros(shape).half() for _ in range(3)]


def test_batches_arrive_in_order_layer_major_each_into_its_own_blocks(pair) -> None:
    """Five transfers in two batches, with a window smaller than one message: each lands in
    exactly its blocks on D; one D no longer wants (cancelled) and one it never knew drain
    into staging without touching the cache, and the transfers after them are exact."""
    group_a, group_b, _ = pair
    src, dst = caches(fill=True), caches(fill=False)
    ctx = SendContext(src, [0] * NUM_LAYERS, 4, SendPool(0), 10)
    plans = {  # transfer -> (P's ids, D's ids, D wants it)
        "t1": ([3, 7, 1, 9, 4, 5, 6], [2, 3, 4, 10, 11, 12, 13], Load()),
        "t2": ([0, 1, 2], [20, 5, 8], Load(cancelled=True)),
        "t3": ([10, 11], [14, 15], None),
        "t4": ([12, 13, 14, 15, 16], [16, 17, 18, 19, 21], Load()),
        "t5": ([17], [1], Load()),
    }
    received: list[tuple[str, int, Exception | None]] = []
    names = {id(load): tid for tid, (_, _, load) in plans.items() if load is not None}

    def resolve(xfer: XferPart):
        _, dst_ids, load = plans[xfer.transfer_id]
        if load is None:
            return None
        ids = torch.tensor(dst_ids)
        return load, [LayerBlocks(cache, ids, xfer.segments[0]) for cache in dst]

    def drain_layers(xfer: XferPart):
        segments = xfer.segments[0]
        return [LayerBlocks(cache, torch.zeros(sum(segments), dtype=torch.int64), segments)
                for cache in dst]  # fmt: skip

    send_lane, receive_lane = lane_classes(group_a.wire)
    receiver = receive_lane(
        group_b.wire, resolve, drain_layers,
        lambda load, n, error: received.append((names[id(load)], n, error)),
        lambda reason: pytest.fail(reason), 1024, 10, "recv",
    )  # fmt: skip
    ended: list[Job] = []
    sender = send_lane(
        group_a.wire, group_a.name, NUM_LAYERS,
        lambda begin: receiver.submit(begin), ended.append,
        lambda reason: pytest.fail(reason), 1024, 10, "send",
    )  # fmt: skip
    receiver.start()
    sender.start()

    def job(tid: str) -> Job:
        src_ids, _, _ = plans[tid]
        segments = [plan_segments(len(src_ids), 2)]
        source = HeldSource(src, ctx, [torch.tensor(src_ids)], segments)
        return Job(tid, segments, source, 0)

    assert sender.submit([job("t1"), job("t2"), job("t3")])
    wait_until(lambda: len(ended) == 3)
    assert sender.submit([job("t4"), job("t5")])
    wait_until(lambda: len(received) == 4 and len(ended) == 5)
    assert [j.transfer_id for j in ended] == ["t1", "t2", "t3", "t4", "t5"]
    assert all(j.error is None and j.ended.is_set() for j in ended)
    message = src[0][0, 0].numel() * 2  # bytes of one block's K (or V) half
    expected = {tid: 2 * NUM_LAYERS * len(plans[tid][0]) * message for tid in plans}
    assert received == [(tid, expected[tid], None) for tid in ("t1", "t2", "t4", "t5")]
    touched = set()
    for tid, (src_ids, dst_ids, load) in plans.items():
        if load is not None and not load.cancelled:
            touched.update(dst_ids)
            for s, d in zip(src, dst):
                assert torch.equal(d[:, dst_ids], s[:, src_ids]), tid
    for d in dst:  # nothing of t2 (cancelled) or t3 (unknown) landed anywhere
        assert not d[:, [i for i in range(NUM_BLOCKS) if i not in touched]].any()
    sender.stop("done")
    receiver.stop("done")


def test_a_lane_whose_peer_goes_away_fails_its_jobs_and_lets_the_group_go(pair) -> None:
    """D's side of the group is torn down while P's lane sends: P's sends fail at once (not
    at the 10 s op timeout), every job ends failed, the lane reports itself broken, and once
    both groups are torn down their process groups are released (nothing else holds them:
    they own sockets and threads)."""
    group_a, group_b, groups = pair
    src = caches(fill=True)
    ctx = SendContext(src, [0] * NUM_LAYERS, 4, SendPool(0), 10)
    pgs = [weakref.ref(group_a.wire), weakref.ref(group_b.wire)]
    broken: list[str] = []
    ended: list[Job] = []
    sender = lane_classes(group_a.wire)[0](
        group_a.wire, group_a.name, NUM_LAYERS, lambda begin: True,
        ended.append, broken.append, 1 << 20, 10, "send",
    )  # fmt: skip
    group_a.attach(sender, None)
    segments = [[2, 2]]
    jobs = [Job(f"t{i}", segments, HeldSource(src, ctx, [torch.arange(4)], segments), 0)
            for i in range(3)]  # fmt: skip
    sender.submit(jobs)  # D never posts a receive: they wait
    time.sleep(0.3)
    t0 = time.monotonic()
    groups["engine-b"].drop("engine-a", "test: D goes away")
    wait_until(lambda: len(ended) == 3)
    assert time.monotonic() - t0 < 5
    assert all(job.error is not None for job in ended) and len(broken) == 1
    groups["engine-a"].drop("engine-b", "test: P tears down too")
    assert sender.join(5)
    del group_a, group_b, sender
    gc.collect()
    assert [ref() for ref in pgs] == [None, None]


def test_the_staging_ring_hands_out_bytes_first_in_first_out() -> None:
    ring = StagingRing(capacity=100)
    a, b = ring.take(40), ring.take(40)
    assert a is not None and b is not None and a.data_ptr() + 40 == b.data_ptr()
    assert ring.take(30) is None  # 20 left at the end, the start still in use
    ring.give_back()  # a's 40 bytes
    c = ring.take(30)  # wraps to the start
    assert c is not None and c.data_ptr() == a.data_ptr()
    assert ring.take(20) is None  # would overrun b
    ring.give_back()
    ring.give_back()
    big = ring.take(250)  # larger than the ring, with nothing in use: the ring grows
    assert big is not None and big.numel() == 250
    ring.give_back()
    ring.release()


@pytest.mark.parametrize("pair", ["network"], indirect=True)  # gloo: receives posted in blocks
def test_a_load_cancelled_with_a_receive_in_its_blocks_ends_when_that_receive_has(pair):
    """D receives a run of its blocks straight into them. The load is cancelled while such a
    receive is posted: its end is reported only once that receive has completed (it may
    still write), and every later message of it drains into staging, touching nothing."""
    group_a, group_b, _ = pair
    src, dst = caches(fill=True), caches(fill=False)
    segments = [[2, 2]]
    ids = torch.tensor([4, 5, 6, 7])  # consecutive on both sides: straight into the blocks
    load = Load()
    told: list = []
    receiver = ReceiveLane(
        group_b.wire,
        lambda xfer: (load, [LayerBlocks(c, ids, xfer.segments[0]) for c in dst]),
        lambda xfer: pytest.fail("not drained"),
        lambda target, n, error: told.append((n, error)),
        lambda reason: pytest.fail(reason), 1, 10, "recv",  # one message in flight at a time
    )  # fmt: skip
    receiver.start()
    receiver.submit(XferBegin(group_a.name, 77, [XferPart("t", segments)]))
    wait_until(lambda: load.posted == 1)
    with load.lock:  # what InboundTransfers does when it ends the load
        load.cancelled = True
        assert load.posted == 1  # so it must not report yet
    time.sleep(0.2)
    assert told == []
    layers = [LayerBlocks(c, ids, segments[0]) for c in src]
    for blocks in layers:  # P sends all of it: 3 layers x (K, V) x 2 segments
        for kv, start, end in blocks.messages():
            group_a.wire.pg.send([blocks.run(kv, start, end)], group_a.wire.peer_rank, 77).wait()
    wait_until(lambda: len(told) == 2)
    message = src[0][0, 0].numel() * 2 * 2  # 2 blocks of one K or V half
    assert str(told[0][1]) == "cancelled" and told[1] == (12 * message, None)
    assert torch.equal(dst[0][0, 4:6], src[0][0, 4:6])  # the receive that was in flight
    assert not dst[0][1].any() and not dst[0][0, 6:].any() and not dst[1].any()
    receiver.stop("done")


def test_messages_are_packed_and_scattered_by_block_ids() -> None:
    cache = torch.arange(2 * 8.0).view(2, 8, 1, 1, 1)
    layer = LayerBlocks(cache, torch.tensor([2, 3, 6]), [2, 1])
    assert list(layer.messages()) == [(0, 0, 2), (1, 0, 2), (0, 2, 3), (1, 2, 3)]
    assert consecutive_start(torch.tensor([2, 3])) == 2
    assert consecutive_start(torch.tensor([3, 6])) is None
    view = layer.run(1, 0, 2)  # consecutive ids: the cache itself, no copy
    assert view.data_ptr() == cache[1, 2].data_ptr() and view.flatten().tolist() == [10, 11]
    assert layer.run(0, 1, 3) is None and layer.shape(1, 3) == (2, 1, 1, 1)
    packed = torch.empty(layer.shape(1, 3))
    layer.gather(0, 1, 3, packed)
    assert packed.flatten().tolist() == [3.0, 6.0] and layer.num_bytes(1, 3) == 8
    target = LayerBlocks(torch.zeros_like(cache), torch.tensor([5, 1, 7]), [3])
    target.scatter(0, 0, 3, torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1, 1))
    assert target.cache[0].flatten().tolist() == [0, 2, 0, 0, 0, 1, 0, 3]
    assert plan_segments(7, 3) == [3, 3, 1] and plan_segments(0, 3) == []
