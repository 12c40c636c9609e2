"""The proxy's ``KVIndex`` by tier: every medium mirrored apart from wire events (stores,
removals, the pool's clear, snapshots), a prompt's cached prefix credited at each block's
cheapest medium, and ``--kv-tier-cost``'s parsing."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.entrypoints.proxy.cli_args import add_cli_args
from pagedkv.entrypoints.proxy.kv_index import KVIndex
from pagedkv.entrypoints.proxy.tier_costs import DEFAULT_TIER_COSTS, parse_tier_costs
from pagedkv.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored

HASHES = [bytes([i]) * 16 for i in range(8)]
MEDIA = ["GPU", "CPU", "DISK", "REMOTE"]


def stored(hashes, medium: str | None, group: int = 0) -> BlockStored:
    return BlockStored(list(hashes), None, [1] * 4 * len(hashes), 4, None, medium, None, group)


def removed(hashes, medium: str | None, group: int = 0) -> BlockRemoved:
    return BlockRemoved(list(hashes), medium, group)


def keys(hashes, group: int = 0) -> Counter:
    return Counter((group, h) for h in hashes)


def test_each_medium_is_stored_removed_and_cleared_apart() -> None:
    index = KVIndex()
    index.apply("a", [stored(HASHES[:4], "GPU"), stored(HASHES[:6], "CPU")])
    index.apply("a", [stored(HASHES[6:], "disk"), stored(HASHES[:1], None)])  # None: the pool
    assert index.cached("a") == keys(HASHES[:4]) + keys(HASHES[:1])
    assert index.cached("a", "CPU") == keys(HASHES[:6])
    assert index.cached("a", "DISK") == keys(HASHES[6:])  # media are upper-cased
    index.apply("a", [removed(HASHES[:2], "CPU")])
    assert index.cached("a", "CPU") == keys(HASHES[2:6])
    assert index.cached("a") == keys(HASHES[:4]) + keys(HASHES[:1])  # the pool keeps them
    index.apply("a", [removed(HASHES[4:6], "GPU")])  # not in the pool: nothing to remove
    assert index.cached_blocks_by_medium("a") == {"GPU": 4, "CPU": 4, "DISK": 2}
    # AllBlocksCleared is the pool's reset: the tiers keep their blocks.
    index.apply("a", [AllBlocksCleared()])
    assert index.cached_blocks_by_medium("a") == {"GPU": 0, "CPU": 4, "DISK": 2}
    assert index.overlap(HASHES, ["a"]) == {"a": {}}  # block 0 is nowhere now
    index.clear("a")
    assert index.cached_blocks_by_medium("a") == {"GPU": 0}
    assert index.overlap(HASHES[2:], ["a"]) == {"a": {}}


def test_overlap_credits_each_block_at_its_cheapest_medium() -> None:
    index = KVIndex()
    index.apply("a", [stored(HASHES[:2], "GPU"), stored(HASHES[:4], "CPU")])
    index.apply("a", [stored(HASHES[3:6], "REMOTE"), stored(HASHES[4:5], "DISK")])
    index.apply("b", [stored(HASHES[1:], "GPU")])  # no first block: no prefix
    index.apply("c", [stored(HASHES[:3], "VRAM_OF_ANOTHER_ENGINE")])
    assert index.overlap(HASHES, ["a", "b", "c", "d"]) == {
        "a": {"GPU": 2, "CPU": 2, "DISK": 1, "REMOTE": 1},
        "b": {},
        "c": {"VRAM_OF_ANOTHER_ENGINE": 3},  # an unknown medium still holds the block
        "d": {},
    }
    # Other costs choose other media for the blocks held twice.
    costs = {**DEFAULT_TIER_COSTS, "CPU": 0.9}
    assert index.overlap(HASHES, ["a"], costs) == {
        "a": {"GPU": 2, "CPU": 1, "REMOTE": 2, "DISK": 1}
    }


def test_a_block_is_held_in_a_medium_only_when_every_group_holds_it_there() -> None:
    index = KVIndex()
    index.set_num_groups("a", 2)
    index.apply("a", [stored(HASHES[:3], "CPU", 0), stored(HASHES[:2], "CPU", 1)])
    index.apply("a", [stored(HASHES[2:3], "GPU", 1)])  # block 2: group 0 in CPU, 1 in GPU
    assert index.overlap(HASHES, ["a"]) == {"a": {"CPU": 2}}
    index.apply("a", [stored(HASHES[2:3], "CPU", 1)])
    assert index.overlap(HASHES, ["a"]) == {"a": {"CPU": 3}}


def test_expected_blocks_are_the_pools_until_a_pool_event_tells() -> None:
    index = KVIndex()
    index.apply("a", [stored(HASHES[:2], "CPU")])
    index.expect("a", HASHES[:3])
    assert index.overlap(HASHES, ["a"]) == {"a": {"GPU": 3}}
    # A tier's event says nothing of the pool: the expectation stays.
    index.apply("a", [removed(HASHES[:1], "CPU")])
    assert index.overlap(HASHES, ["a"]) == {"a": {"GPU": 3}}
    # The pool's own removal ends it; the tier still holds block 1.
    index.apply("a", [removed(HASHES[:2], "GPU")])
    assert index.overlap(HASHES, ["a"]) == {"a": {}}
    index.apply("a", [stored(HASHES[:1], "CPU")])
    assert index.overlap(HASHES, ["a"]) == {"a": {"CPU": 2, "GPU": 1}}
    index.apply("a", [AllBlocksCleared()])  # a pool reset drops the pool's expectations
    assert index.overlap(HASHES, ["a"]) == {"a": {"CPU": 2}}


def test_a_snapshot_replaces_every_medium() -> None:
    index = KVIndex()
    index.apply("a", [stored(HASHES, "GPU"), stored(HASHES, "DISK")])
    index.load_snapshot("a", [HASHES[:2] + HASHES[:1]], {"cpu": [HASHES[2:4]], "DISK": []})
    assert index.cached("a") == keys(HASHES[:2]) + keys(HASHES[:1])
    assert index.cached("a", "CPU") == keys(HASHES[2:4])
    assert index.cached("a", "DISK") == Counter()
    assert index.overlap(HASHES, ["a"]) == {"a": {"GPU": 2, "CPU": 2}}


OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear"]),
        st.sampled_from(MEDIA),
        st.integers(0, 1),  # group
        st.lists(st.integers(0, len(HASHES) - 1), min_size=1, max_size=4),
    ),
    max_size=40,
)


def model_overlap(model: dict[str, Counter], num_groups: int) -> dict[str, int]:
    """The cached prefix by brute force: each block at its cheapest medium holding every
    group, until a block held nowhere."""
    found: Counter = Counter()
    for block_hash in HASHES:
        media = [m for m in MEDIA if all(model[m][(g, block_hash)] > 0 for g in range(num_groups))]
        if not media:
            break
        found[min(media, key=DEFAULT_TIER_COSTS.__getitem__)] += 1
    return dict(found)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, num_groups=st.integers(1, 2))
def test_the_mirror_equals_the_events_per_medium(ops, num_groups) -> None:
    """Random stores (a hash may be stored twice), removals and pool clears in every medium:
    the index holds per medium what the events add up to, and its overlap is the brute-force
    one; a snapshot of that state loads into an equal mirror."""
    index = KVIndex()
    index.set_num_groups("a", num_groups)
    model = {m: Counter() for m in MEDIA}
    for kind, medium, group, picks in ops:
        group %= num_groups  # an instance's groups are 0 .. num_groups - 1
        hashes = [HASHES[i] for i in picks]
        if kind == "store":
            index.apply("a", [stored(hashes, medium, group)])
            model[medium].update((group, h) for h in hashes)
        elif kind == "remove":
            index.apply("a", [removed(hashes, medium, group)])
            for h in hashes:
                if model[medium][(group, h)] > 0:
                    model[medium][(group, h)] -= 1
        else:
            index.apply("a", [AllBlocksCleared()])
            model["GPU"].clear()
    for medium in MEDIA:
        assert index.cached("a", medium) == +model[medium]
    assert index.overlap(HASHES, ["a"]) == {"a": model_overlap(model, num_groups)}

    def hashes_by_group(counts: Counter) -> list[list[bytes]]:
        return [list(Counter({h: n for (g, h), n in counts.items() if g == i}).elements())
                for i in range(2)]  # fmt: skip

    snapshot = KVIndex()
    snapshot.set_num_groups("a", num_groups)
    tiers = {m: hashes_by_group(model[m]) for m in MEDIA[1:]}
    snapshot.load_snapshot("a", hashes_by_group(model["GPU"]), tiers)
    for medium in MEDIA:
        assert snapshot.cached("a", medium) == index.cached("a", medium)
    assert snapshot.overlap(HASHES, ["a"]) == index.overlap(HASHES, ["a"])


def test_kv_tier_cost_flag() -> None:
    assert parse_tier_costs("cpu=0.2,DISK=1") == {**DEFAULT_TIER_COSTS, "CPU": 0.2, "DISK": 1.0}
    assert parse_tier_costs("HBM_PEER=0.05")["HBM_PEER"] == 0.05
    for bad in ("CPU", "CPU=", "=0.1", "CPU=1.5", "CPU=-0.1", "CPU=nan", "CPU=0.1,", "CPU=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="MEDIUM=COST"):
            parse_tier_costs(bad)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert parser.parse_args([]).kv_tier_cost == DEFAULT_TIER_COSTS
    args = parser.parse_args(["--kv-tier-cost", "CPU=0.05,REMOTE=0.8"])
    assert args.kv_tier_cost == {**DEFAULT_TIER_COSTS, "CPU": 0.05, "REMOTE": 0.8}
