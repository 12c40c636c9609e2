"""Eviction policies of the offload tiers, driven the way a tier drives them.

A stateful machine runs random accesses (hit: touch; miss: evict while full, then insert),
pins and unpins (loads in flight), bad entries dropped and bare victim queries against a small
key space, so ghost hits and fully pinned tiers are frequent. After every step: the victim is
never pinned nor absent, and None exactly when every resident key is pinned; LRU's victim is
the model list's least recent unpinned key; ARC keeps its invariants. A loop-plus-scan
workload then shows ARC keeping the reused set where LRU loses it to each scan.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv.kv_transfer.offload.eviction import (
    EVICTION_POLICIES,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
)

KEYS = st.integers(0, 23)


class TierMachine(RuleBasedStateMachine):
    """Subclasses name the policy and add its own checks."""

    policy_cls: type[EvictionPolicy]

    @initialize(capacity=st.integers(1, 8))
    def setup(self, capacity: int) -> None:
        self.policy = self.policy_cls(capacity)
        self.resident: list[int] = []  # model: least recently inserted or touched first
        self.pinned: set[int] = set()

    def can_evict(self, key: int) -> bool:
        return key not in self.pinned

    @rule(key=KEYS)
    def access(self, key: int) -> None:
        if key in self.policy:
            self.policy.touch(key)
            self.resident.remove(key)
        else:
            while len(self.policy) >= self.policy.capacity:
                victim = self.policy.victim(self.can_evict)
                if victim is None:
                    return  # every resident key pinned: the store is dropped
                self.policy.remove(victim)
                self.resident.remove(victim)
        if key not in self.policy:
            self.policy.insert(key)
        self.resident.append(key)

    @rule(key=KEYS)
    def pin(self, key: int) -> None:
        if key in self.policy:
            self.pinned.add(key)

    @rule(key=KEYS)
    def unpin(self, key: int) -> None:
        self.pinned.discard(key)

    @rule(key=KEYS, evicted=st.booleans())
    def remove(self, key: int, evicted: bool) -> None:
        self.policy.remove(key, evicted=evicted)
        if key in self.resident:
            self.resident.remove(key)
        self.pinned.discard(key)

    @invariant()
    def residency_matches(self) -> None:
        assert len(self.policy) == len(self.resident) <= self.policy.capacity
        assert all(key in self.policy for key in self.resident)

    @invariant()
    def victim_is_evictable(self) -> None:
        victim = self.policy.victim(self.can_evict)
        allowed = [key for key in self.resident if key not in self.pinned]
        if allowed:
            assert victim in allowed
        else:
            assert victim is None


class LRUMachine(TierMachine):
    policy_cls = LRUPolicy

    @invariant()
    def victim_is_least_recent(self) -> None:
        allowed = [key for key in self.resident if key not in self.pinned]
        assert self.policy.victim(self.can_evict) == (allowed[0] if allowed else None)


class ARCMachine(TierMachine):
    policy_cls = ARCPolicy

    @invariant()
    def arc_invariants(self) -> None:
        arc, c = self.policy, self.policy.capacity
        t1, t2, b1, b2 = set(arc.t1), set(arc.t2), set(arc.b1), set(arc.b2)
        assert t1 | t2 == set(self.resident) and not t1 & t2
        assert not (t1 | t2) & (b1 | b2) and not b1 & b2
        assert len(t1) + len(b1) <= c
        assert len(t1) + len(t2) + len(b1) + len(b2) <= 2 * c
        assert 0 <= arc.p <= c


SETTINGS = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestLRU = LRUMachine.TestCase
TestLRU.settings = SETTINGS
TestARC = ARCMachine.TestCase
TestARC.settings = SETTINGS


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_misuse_is_refused(name: str):
    cls = EVICTION_POLICIES[name]
    for capacity in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="capacity"):
            cls(capacity)
    policy = cls(2)
    policy.insert("a")
    with pytest.raises(ValueError, match="already resident"):
        policy.insert("a")
    policy.insert("b")
    with pytest.raises(ValueError, match="evict"):
        policy.insert("c")
    with pytest.raises(KeyError):
        policy.touch("c")
    policy.remove("c")  # absent: no-op
    assert len(policy) == 2 and "a" in policy and "c" not in policy


def test_arc_ghost_hits_adapt_the_target():
    arc = ARCPolicy(2)
    arc.insert("a")
    arc.insert("b")
    assert arc.victim(lambda key: True) == "a"  # T1's least recent (|T1| = 2 >= p = 0)
    arc.remove("a")
    assert list(arc.b1) == ["a"]
    arc.insert("a")  # a recency miss: T1 was too small
    assert arc.p == 1 and list(arc.t2) == ["a"] and not arc.b1
    arc.touch("b")  # seen twice: to T2
    assert list(arc.t2) == ["a", "b"] and not arc.t1
    arc.remove("a")
    arc.insert("c")
    assert arc.victim(lambda key: key != "c") == "b"  # T1 preferred, but c is pinned
    arc.remove("b")
    assert list(arc.b2) == ["a", "b"]
    arc.insert("b")  # a frequency miss: T2 was too small
    assert arc.p == 0 and list(arc.b2) == ["a"]
    arc.remove("c", evicted=False)  # found bad: no ghost
    assert "c" not in arc.b1 and list(arc.t2) == ["b"]


def hit_rate(policy: EvictionPolicy, accesses: list[int]) -> float:
    hits = 0
    for key in accesses:
        if key in policy:
            hits += 1
            policy.touch(key)
            continue
        if len(policy) >= policy.capacity:
            victim = policy.victim(lambda _: True)
            assert victim is not None
            policy.remove(victim)
        policy.insert(key)
    return hits / len(accesses)


def test_arc_beats_lru_on_loop_plus_scan():
    """A reused set of 60 blocks (a shared system prompt, say) read twice per round, then a
    one-time scan of 150 blocks, in a tier of 100: each scan flushes LRU, ARC keeps the set."""
    capacity, hot, scan = 100, list(range(60)), 150
    accesses: list[int] = []
    for round_ in range(30):
        accesses += hot + hot
        accesses += [1000 + round_ * scan + i for i in range(scan)]
    lru = hit_rate(LRUPolicy(capacity), accesses)
    arc = hit_rate(ARCPolicy(capacity), accesses)
    print(f"loop+scan hit rate, capacity {capacity}: LRU {lru:.3f}, ARC {arc:.3f}")
    assert arc > lru
