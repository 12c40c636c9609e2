"""A connector's tier events through a real engine's KV event publisher: published after the
pool's in the step's batch, each with its medium, on vLLM's wire shape; a subscriber mirrors
the pool and the tier apart, and one that joins later gets both from the snapshot."""

from __future__ import annotations

import time
from collections import Counter

import msgspec
import zmq

import tests.engine.tier_events_connector  # noqa: F401  (registers TierEventsConnector)
from pagedkv import SamplingParams
from pagedkv.entrypoints.proxy.kv_index import KVIndex
from pagedkv.kv_events.feed import FeedAddress
from pagedkv.kv_events.subscriber import KVEventSubscriber
from tests.engine.conftest import run
from tests.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
EVENTS = {
    "enable_kv_cache_events": True,
    "endpoint": "tcp://127.0.0.1:0",
    "replay_endpoint": "tcp://127.0.0.1:0",
}
TIER = {
    "kv_connector": "TierEventsConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"capacity": 6},
}


def wait_until(condition, step, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        step()
        time.sleep(0.01)


def pool_cached(engine) -> Counter:
    hashes = engine.kv_cache_manager.cached_block_hashes()
    return Counter((group, h) for group, hs in enumerate(hashes) for h in hs)


def synced(subscriber: KVEventSubscriber) -> bool:
    stats = subscriber.stats.get("i")
    return stats is not None and stats.synced


def follow(publisher) -> tuple[KVEventSubscriber, KVIndex]:
    index = KVIndex()
    subscriber = KVEventSubscriber(index, request_timeout_s=1.0)
    subscriber.start()
    subscriber.follow("i", FeedAddress(publisher.endpoint, publisher.replay_endpoint, ""))
    return subscriber, index


def test_tier_events_reach_the_index_with_their_medium_and_the_snapshot_carries_tiers(
    make_llm,
) -> None:
    engine = make_llm("llama", kv_events_config=EVENTS, kv_transfer_config=TIER).llm_engine
    publisher, tier = engine.kv_event_publisher, engine.scheduler.connector
    assert engine.description.kv_tiers == {"CPU": 6}  # what the instance registers
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    first, first_index = follow(publisher)
    try:
        wait_until(lambda: synced(first), engine.publish_kv_events)
        time.sleep(0.2)  # the raw SUB socket's connection (slow joiner)
        for n in range(6):  # 6 prompts of 2-3 full blocks, a tier of 6: evictions
            run(engine, [(random_prompt(40 + n, seed=n), GREEDY, None)])
        tier_cached = Counter((0, h) for h in tier.held)
        assert len(tier_cached) == 6

        def mirrored(index: KVIndex) -> bool:
            return index.cached("i") == pool_cached(engine) and index.cached("i", "CPU") == (
                tier_cached
            )

        wait_until(lambda: mirrored(first_index), engine.publish_kv_events)
        assert first_index.cached_blocks_by_medium("i") == {
            "GPU": len(pool_cached(engine)),
            "CPU": 6,
        }
        # On the wire: vLLM's maps, the tier's with medium "CPU", after the pool's in a batch.
        batches = []
        while sub.poll(0):
            _, _, payload = sub.recv_multipart()
            batches.append(msgspec.msgpack.decode(payload)[1])
        tier_events = [e for batch in batches for e in batch if e.get("medium") == "CPU"]
        assert {e["type"] for e in tier_events} == {"BlockStored", "BlockRemoved"}
        for batch in batches:
            media = [e["medium"] for e in batch if e["type"] == "BlockStored"]
            assert media == sorted(media, key=lambda m: m != "GPU")
        # A subscriber that joins now loads both from one snapshot (no event follows it).
        later, later_index = follow(publisher)
        try:
            wait_until(lambda: synced(later), engine.publish_kv_events)
            assert mirrored(later_index) and later.stats["i"].num_batches == 0
        finally:
            later.close()
    finally:
        first.close()
        sub.close(linger=0)
        ctx.term()
