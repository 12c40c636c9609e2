"""Routing: which P and which D serve a request (any number of each, xPyD).

A pair is a decode instance and a prefill instance with the same model fingerprint (KV moves
only between equals). ``round_robin`` cycles through each role's live instances;
``least_loaded`` picks the fewest requests this proxy has in flight there, then the fewest the
instance reported running and waiting in its last heartbeat. Instances that already failed
this request are skipped, so a retry lands elsewhere.
"""

from __future__ import annotations

import itertools
from collections import Counter

from pagedkv.entrypoints.proxy.cli_args import ROUTING_POLICIES
from pagedkv.entrypoints.proxy.registry import Instance, InstanceRegistry


class Router:
    def __init__(self, registry: InstanceRegistry, policy: str = "round_robin") -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.registry = registry
        self.policy = policy
        self.in_flight: Counter[str] = Counter()
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}

    def _order(self, instances: list[Instance], role: str) -> list[Instance]:
        instances = sorted(instances, key=lambda i: i.engine_id)
        if not instances:
            return instances
        if self.policy == "round_robin":
            start = next(self._turns[role]) % len(instances)
            return instances[start:] + instances[:start]
        return sorted(
            instances,
            key=lambda i: (self.in_flight[i.engine_id], i.info.num_running + i.info.num_waiting),
        )

    def pick_pair(
        self, exclude: set[str] | frozenset[str] = frozenset()
    ) -> tuple[Instance, Instance] | None:
        """(P, D) for one request, or None when no live, compatible pair is left."""
        live = [i for i in self.registry.live() if i.engine_id not in exclude]
        decoders = self._order([i for i in live if i.is_decode], "decode")
        prefillers = [i for i in live if i.is_prefill]
        for decoder in decoders:
            compatible = [
                p
                for p in prefillers
                if p.info.fingerprint == decoder.info.fingerprint
                and p.engine_id != decoder.engine_id
            ]
            if compatible:
                return self._order(compatible, "prefill")[0], decoder
        return None

    def acquire(self, instance: Instance) -> None:
        """Count a request in flight at ``instance`` (for least_loaded) until ``release``."""
        self.in_flight[instance.engine_id] += 1

    def release(self, instance: Instance) -> None:
        self.in_flight[instance.engine_id] -= 1
        if self.in_flight[instance.engine_id] <= 0:
            del self.in_flight[instance.engine_id]
