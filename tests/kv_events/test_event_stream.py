"""The KV event stream, end to end over real ZMQ sockets: a pool's events published in vLLM's
shape, with a connector's tier events after them, followed by a subscriber into the proxy's
``KVIndex``, reconstruct the pool's cached set and each tier's exactly, through evictions,
prefix-cache resets, dropped batches and a publisher restart."""

from __future__ import annotations

import random
import time
from collections import Counter

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedkv.entrypoints.proxy.kv_index import KVIndex
from pagedkv.kv_cache import kv_events
from pagedkv.kv_events.config import KVEventsConfig
from pagedkv.kv_events.feed import FeedAddress
from pagedkv.kv_events.publisher import KVEventPublisher
from pagedkv.kv_events.subscriber import KVEventSubscriber
from pagedkv.kv_events.wire import END_SEQ, SNAPSHOT_REQUEST
from tests.kv_cache.helpers import Req, decode, full_spec, make_hasher, make_manager

BS = 4
STEMS = [[random.Random(s).randrange(6) for _ in range(40)] for s in range(3)]
#: What the simulated connector tiers hold blocks of (any hashes do: the index keys by hash).
TIER_HASHES = [bytes([i]) * 16 for i in range(6)]


def config(**kw) -> KVEventsConfig:
    addresses = {"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
    return KVEventsConfig(enable_kv_cache_events=True, **{**addresses, **kw})


def pool_cached(mgr) -> Counter:
    return Counter(
        (group, h) for group, hashes in enumerate(mgr.cached_block_hashes()) for h in hashes
    )


def wait_until(condition, step=lambda: None, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        step()
        time.sleep(0.005)


class Instance:
    """A KV cache manager and a connector's tiers (simulated: hash counts per medium) whose
    steps publish their events, as the engine's do."""

    def __init__(self, num_blocks: int, **publisher_config) -> None:
        self.mgr = make_manager(full_spec(BS), num_blocks=num_blocks, enable_kv_cache_events=True)
        self.hasher = make_hasher(self.mgr)
        self.publisher = KVEventPublisher(config(**publisher_config))
        self.running: list[Req] = []
        self.next_id = 0
        self.tiers: dict[str, Counter] = {kv_events.CPU: Counter(), kv_events.DISK: Counter()}
        self.tier_events: list[kv_events.KVCacheEvent] = []

    def step(self) -> None:
        events, self.tier_events = self.mgr.take_events() + self.tier_events, []
        self.publisher.publish_step(events, self.mgr.cached_block_hashes, self.tier_hashes)

    def tier_hashes(self) -> dict[str, list[list[bytes]]]:
        return {medium: [list(held.elements())] for medium, held in self.tiers.items()}

    def tier_cached(self, medium: str) -> Counter:
        return Counter({(0, h): n for h, n in self.tiers[medium].items()})

    def change_tier(self, medium: str, store: bool, picks: list[int]) -> None:
        held = self.tiers[medium]
        for block_hash in (TIER_HASHES[i] for i in picks):
            if store:
                held[block_hash] += 1
                event = kv_events.BlockStored((block_hash,), None, (1,) * BS, BS, 0, medium)
            elif held[block_hash]:
                held[block_hash] -= 1
                event = kv_events.BlockRemoved((block_hash,), 0, medium)
            else:
                continue
            self.tier_events.append(event)

    def run(self, op: tuple) -> None:
        kind, *args = op
        if kind == "arrive":
            stem, length, tail = args
            req = Req(f"r{self.next_id}", STEMS[stem][:length] + tail, self.hasher)
            self.next_id += 1
            blocks, hit = self.mgr.get_computed_blocks(req)
            new = self.mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks)
            if new is not None:
                req.num_computed_tokens = req.num_tokens
                self.running.append(req)
        elif kind == "decode" and self.running:
            req = self.running[args[0] % len(self.running)]
            if decode(self.mgr, req, args[1]) is None:
                self.finish(req)
        elif kind == "finish" and self.running:
            self.finish(self.running[args[0] % len(self.running)])
        elif kind == "tier":
            self.change_tier(*args)
        elif kind == "reset":
            for req in list(self.running):
                self.finish(req)
            assert self.mgr.reset_prefix_cache()
        self.step()

    def finish(self, req: Req) -> None:
        self.mgr.free(req)
        self.running.remove(req)


OPS = st.one_of(
    st.tuples(
        st.just("arrive"),
        st.integers(0, 2),
        st.integers(1, 40),
        st.lists(st.integers(0, 5), max_size=6),
    ),
    st.tuples(st.just("decode"), st.integers(0, 5), st.integers(0, 5)),
    st.tuples(st.just("finish"), st.integers(0, 5)),
    st.just(("reset",)),
    st.tuples(
        st.just("tier"),
        st.sampled_from([kv_events.CPU, kv_events.DISK]),
        st.booleans(),
        st.lists(st.integers(0, len(TIER_HASHES) - 1), max_size=4),
    ),
)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    ops=st.lists(OPS, min_size=1, max_size=60),
    num_blocks=st.integers(8, 30),
    max_queue_size=st.sampled_from([1, 2, 100_000]),
    buffer_steps=st.sampled_from([1, 4, 10_000]),
    start_after=st.integers(0, 10),
)
def test_events_reconstruct_the_pool_and_the_tiers_exactly(
    ops, num_blocks, max_queue_size, buffer_steps, start_after
) -> None:
    """Random arrivals (with prefix hits and evictions in a small pool), decodes, finishes,
    prefix-cache resets (the tiers keep their blocks) and tier stores and removals; the
    publisher thread starts only after ``start_after`` steps, so a small queue drops batches
    (and a small replay buffer cannot replay them). Once the stream is quiet, the index holds
    exactly what the pool holds, and what each tier holds."""
    instance = Instance(num_blocks, max_queue_size=max_queue_size, buffer_steps=buffer_steps)
    publisher = instance.publisher
    index = KVIndex()
    subscriber = KVEventSubscriber(index, request_timeout_s=1.0)
    subscriber.start()
    try:
        subscriber.follow("i", FeedAddress(publisher.endpoint, publisher.replay_endpoint, ""))
        for op in ops[:start_after]:
            instance.run(op)
        publisher.start()
        for op in ops[start_after:]:
            instance.run(op)

        def synced() -> bool:
            stats = subscriber.stats.get("i")
            return stats is not None and stats.synced

        def mirrored() -> bool:
            return index.cached("i") == pool_cached(instance.mgr) and all(
                index.cached("i", m) == instance.tier_cached(m) for m in instance.tiers
            )

        wait_until(lambda: synced() and mirrored(), step=instance.step)
        instance.mgr.check_integrity()
        stats = subscriber.stats["i"]
        event(f"dropped batches: {publisher.get_stats()['num_dropped_batches'] > 0}")
        event(f"replayed: {stats.num_replays > 0}")
        event(f"resynced from a later snapshot: {stats.num_snapshots > 1}")
    finally:
        subscriber.close()
        publisher.shutdown()


def raw_subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    return sub


def test_wire_shape_is_vllms_and_replay_and_snapshot_answer_on_the_router() -> None:
    """Frames [topic, 8-byte big-endian seq, msgpack [ts, [events]]], events as maps tagged
    "type" with vLLM's field names; the replay socket answers a start seq with the buffered
    batches then seq -1, and our snapshot request with the cached hashes (and the tiers') then
    seq -1."""
    instance = Instance(num_blocks=20, topic="kv")
    publisher = instance.publisher
    publisher.start()
    ctx = zmq.Context()
    sub = raw_subscriber(ctx, publisher.endpoint)
    try:
        batch = None
        for n in range(200):  # until the SUB connection is up (slow joiner)
            instance.run(("arrive", n % 3, 9, [n % 6, n // 6 % 6]))
            instance.run(("finish", 0))
            try:
                batch = sub.recv_multipart(zmq.NOBLOCK)
                break
            except zmq.Again:
                time.sleep(0.01)
        assert batch is not None
        topic, seq, payload = batch
        assert topic == b"kv" and len(seq) == 8
        ts, events, data_parallel_rank = msgspec.msgpack.decode(payload)
        assert abs(ts - time.time()) < 5 and data_parallel_rank is None
        stored = events[0]
        assert stored["type"] == "BlockStored"
        assert set(stored) == {
            "type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
            "lora_id", "medium", "lora_name", "group_idx",
        }  # fmt: skip
        assert stored["block_size"] == BS and stored["medium"] == "GPU"
        assert len(stored["token_ids"]) == BS * len(stored["block_hashes"])
        assert all(isinstance(h, bytes) and len(h) == 16 for h in stored["block_hashes"])

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", seq])
        replayed = []
        while (frames := dealer.recv_multipart())[2] != END_SEQ:
            replayed.append(frames)
        assert replayed[0] == [b"", b"kv", seq, payload]
        assert frames == [b"", b"", END_SEQ, b""]
        assert [int.from_bytes(f[2], "big") for f in replayed] == list(
            range(int.from_bytes(seq, "big"), publisher.get_stats()["num_published_batches"])
        )

        dealer.send_multipart([b"", SNAPSHOT_REQUEST])
        wait_until(lambda: dealer.poll(0), step=instance.step)
        _, topic, next_seq, body = dealer.recv_multipart()
        ts, next_seq_in_body, block_hashes, tiers = msgspec.msgpack.decode(body)
        assert int.from_bytes(next_seq, "big") == next_seq_in_body
        assert tiers == {"CPU": [[]], "DISK": [[]]}  # the connector's tiers, empty here
        assert Counter(block_hashes[0]) == Counter(instance.mgr.cached_block_hashes()[0])
        assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()
        publisher.shutdown()


def test_a_full_queue_drops_and_counts_and_never_waits() -> None:
    instance = Instance(num_blocks=20, max_queue_size=2)
    publisher = instance.publisher  # not started: nothing drains the queue
    try:
        t0 = time.monotonic()
        for _ in range(5):
            instance.run(("arrive", 1, 12, []))
        assert time.monotonic() - t0 < 1.0
        stats = publisher.get_stats()
        assert stats["num_dropped_batches"] == 3 and stats["num_dropped_events"] >= 1
    finally:
        publisher.shutdown()


def test_a_restarted_publisher_is_followed_from_a_fresh_snapshot() -> None:
    """Same endpoints, seq back to 0 and a different cache: the index drops what the old
    process held and reloads."""
    first = Instance(num_blocks=20)
    first.publisher.start()
    index = KVIndex()
    subscriber = KVEventSubscriber(index, request_timeout_s=1.0)
    subscriber.start()
    address = FeedAddress(first.publisher.endpoint, first.publisher.replay_endpoint, "")
    subscriber.follow("i", address)
    try:
        for n in range(5):
            first.run(("arrive", 0, 20 + n, []))
        wait_until(lambda: index.cached("i") == pool_cached(first.mgr), step=first.step)
        first.publisher.shutdown()
        config_kw = dict(endpoint=address.endpoint, replay_endpoint=address.replay_endpoint)
        second = Instance.__new__(Instance)
        second.mgr = make_manager(full_spec(BS), num_blocks=20, enable_kv_cache_events=True)
        second.hasher = make_hasher(second.mgr)
        second.publisher = KVEventPublisher(
            KVEventsConfig(enable_kv_cache_events=True, **config_kw)
        )
        second.running, second.next_id = [], 0
        second.tiers, second.tier_events = {}, []
        second.publisher.start()
        for n in range(3):
            second.run(("arrive", 2, 12 + n, []))
        wait_until(
            lambda: (
                index.cached("i") == pool_cached(second.mgr)
                and subscriber.stats["i"].num_restarts + subscriber.stats["i"].num_snapshots > 1
            ),
            step=second.step,
        )
        second.publisher.shutdown()
    finally:
        subscriber.close()


def test_a_bad_kv_events_config_is_a_value_error_naming_the_field() -> None:
    for bad, field in (
        ({"publisher": "kafka"}, "publisher"),
        ({"endpoint": "127.0.0.1:5557"}, "endpoint"),
        ({"replay_endpoint": "udp://x"}, "replay_endpoint"),
        ({"max_queue_size": 0}, "max_queue_size"),
        ({"buffer_steps": True}, "buffer_steps"),
        ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
        ({"endpont": "tcp://127.0.0.1:1"}, "unknown fields"),
    ):
        with pytest.raises(ValueError, match=field):
            KVEventsConfig.from_dict(bad)
    assert not KVEventsConfig().publishes
    assert KVEventsConfig(enable_kv_cache_events=True).publishes
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishes
    with pytest.raises(ValueError, match="cannot bind"):
        KVEventPublisher(config(endpoint="tcp://192.0.2.1:1"))  # not an address of this host
