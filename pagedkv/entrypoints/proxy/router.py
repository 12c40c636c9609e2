"""Routing: which P and which D serve a request (any number of each, xPyD).

A pair is a decode instance and a prefill instance with the same model fingerprint (KV moves
only between equals). ``round_robin`` cycles through each role's live instances;
``least_loaded`` picks the fewest requests this proxy has in flight there, then the fewest the
instance reported running and waiting in its last heartbeat. Instances that already failed
this request are skipped, so a retry lands elsewhere. When no pair is left, ``why_no_pair``
says why (a role missing, or the fingerprints that do not match, with their KV layouts);
``pairing_note`` says it of one instance (shown in ``/instances`` and told at registration).
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

    def pick_decode(self, exclude: set[str] | frozenset[str] = frozenset()) -> Instance | None:
        """A decode instance for a request it prefills itself (the local fallback)."""
        live = [i for i in self.registry.live() if i.is_decode and i.engine_id not in exclude]
        ordered = self._order(live, "decode")
        return ordered[0] if ordered else None

    def pairing_note(self, instance: Instance) -> str | None:
        """Why ``instance`` cannot be paired with any live instance now (None: it can)."""
        others = [i for i in self.registry.live() if i.engine_id != instance.engine_id]
        wanted = "prefill" if instance.is_decode else "decode"
        peers = [i for i in others if (i.is_prefill if wanted == "prefill" else i.is_decode)]
        if not peers:
            return f"no {wanted} instance is registered"
        if any(p.info.fingerprint == instance.info.fingerprint for p in peers):
            return None
        return (
            f"no {wanted} instance has its model and KV layout "
            f"({_layout(instance)}); registered: "
            + "; ".join(f"{p.engine_id} ({_layout(p)})" for p in peers[:4])
        )

    def why_no_pair(self, exclude: set[str] | frozenset[str] = frozenset()) -> str:
        """Why ``pick_pair(exclude)`` found nothing, for the 503."""
        live = self.registry.live()
        decoders = [i for i in live if i.is_decode]
        prefillers = [i for i in live if i.is_prefill]
        if not decoders or not prefillers:
            return f"{len(prefillers)} prefill and {len(decoders)} decode instances are registered"
        usable = [i for i in live if i.engine_id not in exclude]
        if exclude and len(usable) < len(live):
            failed = ", ".join(sorted(exclude))
            if not any(i.is_decode for i in usable) or not any(i.is_prefill for i in usable):
                return f"every instance of a role failed this request ({failed})"
        notes = [f"{d.engine_id}: {self.pairing_note(d)}" for d in decoders]
        return "no decode instance has a compatible prefill instance: " + " | ".join(notes)

    def acquire(self, instance: Instance) -> None:
        """Count a request in flight at ``instance`` (for least_loaded) until ``release``."""
        self.in_flight[instance.engine_id] += 1

    def release(self, instance: Instance) -> None:
        self.in_flight[instance.engine_id] -= 1
        if self.in_flight[instance.engine_id] <= 0:
            del self.in_flight[instance.engine_id]


def _layout(instance: Instance) -> str:
    info = instance.info
    detail = info.kv_layout or "layout not reported"
    return f"model {info.model!r}, fingerprint {info.fingerprint[:8]}, {detail}"
