"""Routing: which instance answers a request, and which P prefills it (any number of each).

Instances that answer: replicas (``plain``: no P2P connector, data parallel) and decode
instances. A decode instance is paired with a prefill instance of the same model fingerprint
(KV moves only between equals); a replica, or a D told to prefill itself, answers alone. The
answering instance is chosen first, then its P, each ranked by the ``RoutingPolicy`` that
``--routing`` names in ``ROUTING_POLICIES`` (a new policy: a subclass and its entry there).

Conditional disaggregation (``disagg_threshold`` N > 0): a D that lacks fewer than N prompt
tokens prefills them itself, with no P. Instances that already failed this request are
skipped, so a retry lands elsewhere. When nothing is left, ``why_no_pair`` says why, instance
by instance;
``pairing_note`` says it of one instance (shown in ``/instances`` and told at registration).

``cli_args`` reads the policies' names from here for ``--help``: this module imports nothing
heavy at run time (the rest only for type checking).
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, NamedTuple

from pagedkv.entrypoints.proxy.recent_work import RecentWork
from pagedkv.entrypoints.proxy.tier_costs import DEFAULT_TIER_COSTS, tier_cost

if TYPE_CHECKING:
    from pagedkv.entrypoints.proxy.kv_index import KVIndex
    from pagedkv.entrypoints.proxy.prompt_blocks import PromptTokenizer
    from pagedkv.entrypoints.proxy.registry import Instance, InstanceRegistry

#: kv_aware: costs this many prompt tokens above the lowest count as tied with it. One block of
#: 16: a chat template's header that every prompt shares is no reason to pile new prefixes on
#: one instance; sent elsewhere, a request recomputes at most this much once.
NEAR_TIE_TOKENS = 16

#: An instance's cached prefix of a prompt, in tokens by the medium that serves each
#: (``{"GPU": 32, "CPU": 16}``: 48 tokens, the first 32 from its pool).
TierTokens = dict[str, int]


class Prompt(NamedTuple):
    """What the router knows of a request's prompt."""

    token_ids: list[int]
    cache_salt: str | None = None


class Route(NamedTuple):
    """``d`` answers; ``p`` (None: nobody) prefills for it. ``predicted_hit_tokens``: the
    prompt tokens ``d``'s prefix cache should serve, when the router looked (kv_aware)."""

    d: Instance
    p: Instance | None = None
    predicted_hit_tokens: int | None = None


class RoutingPolicy(ABC):
    """How ``router`` ranks the instances that could answer a request (role ``decode``) or
    prefill it for a D (``prefill``), what it predicts of their caches, and what it notes of
    each choice."""

    #: Reads the instances' prefix caches: the proxy follows their KV events into a ``KVIndex``.
    needs_kv_index = False

    def __init__(self, router: Router, seed: int | None) -> None:
        self.router = router
        self.random = random.Random(seed)  # exact ties, for a policy that breaks them at random

    @abstractmethod
    def rank(
        self,
        instances: list[Instance],
        role: str,
        prompt: Prompt | None,
        hits: dict[str, TierTokens],
    ) -> list[Instance]:
        """``instances`` (not empty, sorted by engine id), best first."""

    def hit_tokens(self, prompt: Prompt | None, instances: list[Instance]) -> dict[str, TierTokens]:
        """Each instance's cached prefix of the prompt, in tokens by medium ({}: the policy
        does not look)."""
        return {}

    def expect(self, prompt: Prompt | None, instance: Instance, hit_tokens: int | None) -> None:
        """``instance`` was chosen for ``prompt`` (its predicted hit: ``hit_tokens``)."""
        return None


class RoundRobin(RoutingPolicy):
    """Cycles through the answering instances, then through that D's Ps."""

    def __init__(self, router: Router, seed: int | None) -> None:
        super().__init__(router, seed)
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}

    def rank(
        self,
        instances: list[Instance],
        role: str,
        prompt: Prompt | None,
        hits: dict[str, TierTokens],
    ) -> list[Instance]:
        start = next(self._turns[role]) % len(instances)
        return instances[start:] + instances[:start]


class LeastLoaded(RoutingPolicy):
    """The fewest requests this proxy has in flight there, then the fewest the instance
    reported running and waiting in its last heartbeat."""

    def rank(
        self,
        instances: list[Instance],
        role: str,
        prompt: Prompt | None,
        hits: dict[str, TierTokens],
    ) -> list[Instance]:
        in_flight = self.router.in_flight
        return sorted(
            instances,
            key=lambda i: (in_flight[i.engine_id], i.info.num_running + i.info.num_waiting),
        )


class KVAware(LeastLoaded):
    """The lowest cost = the prompt tokens the instance lacks (its cached prefix from
    ``KVIndex``) + the tokens it holds in a tier below its pool, each at its tier's fraction of
    a recompute (``tier_costs``: ``--kv-tier-cost``) + ``load_weight`` × its load (heartbeat's
    running and waiting + this proxy's in flight). Costs within ``NEAR_TIE_TOKENS`` of the
    lowest are ties, broken by ``RecentWork`` (the fewest prompt tokens sent to compute lately
    first), then at random. D is chosen by its own cached prefix (D asks P only for the blocks
    it lacks), P by its own. Without a prompt: least loaded.

    Why ties need more than load: a prompt no instance holds costs the same everywhere, and
    when requests come one at a time every load is 0, so a random pick can put most new
    prefixes (and then all of their traffic) on one instance. The work an instance was sent
    lately outlives its requests; a new prefix goes where the least was. Near-ties count too: a
    one-block header that every prompt shares would otherwise keep every new prefix on the
    first instance that has it."""

    needs_kv_index = True

    def __init__(self, router: Router, seed: int | None) -> None:
        super().__init__(router, seed)
        if router.kv_index is None or router.tokenizer is None:
            raise ValueError("kv_aware routing needs a KV index and the model's tokenizer")
        self.kv_index, self.tokenizer = router.kv_index, router.tokenizer

    def rank(
        self,
        instances: list[Instance],
        role: str,
        prompt: Prompt | None,
        hits: dict[str, TierTokens],
    ) -> list[Instance]:
        """The instances tied with the lowest cost, the least recent work first, then the
        others, the lowest cost first."""
        if prompt is None:
            return super().rank(instances, role, prompt, hits)
        self.random.shuffle(instances)  # exact ties at random: the sorts below are stable
        costs = {i.engine_id: self.cost(i, len(prompt.token_ids), hits) for i in instances}
        tied_below = min(costs.values()) + NEAR_TIE_TOKENS
        tied = [i for i in instances if costs[i.engine_id] <= tied_below]
        others = [i for i in instances if costs[i.engine_id] > tied_below]
        tied.sort(key=lambda i: self.router.recent_work.get(i.engine_id))
        others.sort(key=lambda i: costs[i.engine_id])
        return tied + others

    def cost(self, instance: Instance, num_tokens: int, hits: dict[str, TierTokens]) -> float:
        """Prompt tokens ``instance`` lacks + its tier hits at their tiers' cost +
        ``load_weight`` × its load (lowest wins). A pool hit costs nothing."""
        info = instance.info
        load = info.num_running + info.num_waiting + self.router.in_flight[instance.engine_id]
        tiers = hits.get(instance.engine_id, {})
        costs = self.router.tier_costs
        loaded = sum(tokens * tier_cost(costs, medium) for medium, tokens in tiers.items())
        uncached = num_tokens - sum(tiers.values())
        return uncached + loaded + self.router.load_weight * load

    def hit_tokens(self, prompt: Prompt | None, instances: list[Instance]) -> dict[str, TierTokens]:
        if prompt is None:
            return {}
        hits: dict[str, TierTokens] = {i.engine_id: {} for i in instances}
        by_hashing: dict[tuple[int, str], list[str]] = {}
        for instance in instances:
            if instance.info.hash_algo:
                key = (instance.info.block_size, instance.info.hash_algo)
                by_hashing.setdefault(key, []).append(instance.engine_id)
        for (block_size, algo), names in by_hashing.items():
            # The last prompt token is always computed (for its logits): never a hit.
            hashes = self.tokenizer.block_hashes(
                prompt.token_ids[:-1], block_size, algo, prompt.cache_salt
            )
            overlap = self.kv_index.overlap(hashes, names, self.router.tier_costs)
            for name, by_medium in overlap.items():
                hits[name] = {medium: n * block_size for medium, n in by_medium.items()}
        return hits

    def expect(self, prompt: Prompt | None, instance: Instance, hit_tokens: int | None) -> None:
        """``instance`` will compute the prompt tokens it lacks, and cache the prompt's full
        blocks soon."""
        if prompt is None:
            return
        self.router.recent_work.add(instance.engine_id, len(prompt.token_ids) - (hit_tokens or 0))
        info = instance.info
        if info.hash_algo:
            hashes = self.tokenizer.block_hashes(
                prompt.token_ids, info.block_size, info.hash_algo, prompt.cache_salt
            )
            self.kv_index.expect(instance.engine_id, hashes)


#: Each ``RoutingPolicy`` by its name: the ``--routing`` choices.
ROUTING_POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "kv_aware": KVAware}


class Router:
    def __init__(
        self,
        registry: InstanceRegistry,
        policy: str = "round_robin",
        *,
        kv_index: KVIndex | None = None,
        tokenizer: PromptTokenizer | None = None,
        load_weight: float = 32.0,
        tier_costs: Mapping[str, float] = DEFAULT_TIER_COSTS,
        disagg_threshold: int = 0,
        seed: int | None = None,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {tuple(ROUTING_POLICIES)}, got {policy!r}")
        self.registry = registry
        self.kv_index = kv_index
        self.tokenizer = tokenizer
        self.load_weight = load_weight
        self.tier_costs = tier_costs
        self.disagg_threshold = disagg_threshold
        self.in_flight: Counter[str] = Counter()
        self.recent_work = RecentWork()
        self.policy = ROUTING_POLICIES[policy](self, seed)
        if disagg_threshold and tokenizer is None:
            raise ValueError("--disagg-threshold needs the model's tokenizer")

    def read_prompt(self, path: str, body: dict) -> Prompt | None:
        """The request's prompt as the instances will tokenize it (None: unknown)."""
        if self.tokenizer is None:
            return None
        token_ids = self.tokenizer.token_ids(path, body)
        if not token_ids:
            return None
        salt = body.get("cache_salt")
        return Prompt(token_ids, salt if isinstance(salt, str) and salt else None)

    # ------------------------------------------------------------------ choosing
    def route(
        self,
        prompt: Prompt | None = None,
        exclude: Collection[str] = frozenset(),
        alone: bool = False,
    ) -> Route | None:
        """Who serves one request (``alone``: no P), or None when nobody can."""
        live = [i for i in self.registry.live() if i.engine_id not in exclude]
        answerers = [i for i in live if i.answers]
        hits = self.policy.hit_tokens(prompt, answerers)
        for d in self._rank(answerers, "decode", prompt, hits):
            predicted = _total(hits, d)
            if d.is_replica or alone or self._prefills_itself(prompt, predicted):
                self.policy.expect(prompt, d, predicted)
                return Route(d, None, predicted)
            _, peers = _peers(d, live)
            compatible = [p for p in peers if p.info.fingerprint == d.info.fingerprint]
            if compatible:
                p_hits = self.policy.hit_tokens(prompt, compatible)
                p = self._rank(compatible, "prefill", prompt, p_hits)[0]
                self.policy.expect(prompt, d, predicted)
                self.policy.expect(prompt, p, _total(p_hits, p))
                return Route(d, p, predicted)
        return None

    def _prefills_itself(self, prompt: Prompt | None, hit_tokens: int | None) -> bool:
        """Conditional disaggregation: the D lacks fewer than the threshold's prompt tokens."""
        if not self.disagg_threshold or prompt is None:
            return False
        return len(prompt.token_ids) - (hit_tokens or 0) < self.disagg_threshold

    def _rank(
        self,
        instances: list[Instance],
        role: str,
        prompt: Prompt | None,
        hits: dict[str, TierTokens],
    ) -> list[Instance]:
        """``instances``, best first, by the policy."""
        instances = sorted(instances, key=lambda i: i.engine_id)
        return self.policy.rank(instances, role, prompt, hits) if instances else instances

    # ------------------------------------------------------------------ explaining
    def pairing_note(self, instance: Instance) -> str | None:
        """Why ``instance`` cannot be paired with any live instance now (None: it can, or it
        is a replica, which is never paired)."""
        if instance.is_replica:
            return None
        wanted, peers = _peers(instance, self.registry.live())
        if not peers:
            return f"no {wanted} instance is registered"
        if any(p.info.fingerprint == instance.info.fingerprint for p in peers):
            return None
        return (
            f"no {wanted} instance has its model and KV layout "
            f"({_layout(instance)}); registered: "
            + "; ".join(f"{p.engine_id} ({_layout(p)})" for p in peers[:4])
        )

    def why_no_pair(self, exclude: Collection[str] = frozenset()) -> str:
        """Why ``route(exclude=exclude)`` found nothing, for the 503: what is registered, then
        each live instance it did not use (by id and address) and why."""
        live = sorted(self.registry.live(), key=lambda i: i.engine_id)
        counts = (
            f"{sum(i.is_prefill for i in live)} prefill, {sum(i.is_decode for i in live)} "
            f"decode and {sum(i.is_replica for i in live)} replica instances are registered"
        )
        unused = [
            f"{i.engine_id} ({i.info.http_url}): {self._why_unused(i, live, exclude)}"
            for i in live
            if i.engine_id not in exclude
        ]
        return f"{counts}; not used: {' | '.join(unused)}" if unused else counts

    def _why_unused(
        self, instance: Instance, live: list[Instance], exclude: Collection[str]
    ) -> str:
        """Why an instance that did not fail this request could not serve it: it has no peer
        of its model and KV layout, or each such peer failed this request."""
        if instance.is_replica:
            return "not tried"
        wanted, peers = _peers(instance, live)
        equals = [p.engine_id for p in peers if p.info.fingerprint == instance.info.fingerprint]
        if equals and all(name in exclude for name in equals):
            return f"each {wanted} instance it pairs with failed this request ({', '.join(equals)})"
        return self.pairing_note(instance) or "not tried"

    # ------------------------------------------------------------------ accounting
    def acquire(self, instance: Instance) -> None:
        """Count a request in flight at ``instance`` (for the load) until ``release``."""
        self.in_flight[instance.engine_id] += 1

    def release(self, instance: Instance) -> None:
        self.in_flight[instance.engine_id] -= 1
        if self.in_flight[instance.engine_id] <= 0:
            del self.in_flight[instance.engine_id]


def _total(hits: dict[str, TierTokens], instance: Instance) -> int | None:
    """``instance``'s predicted hit in tokens, every tier's (None: the policy did not look)."""
    tiers = hits.get(instance.engine_id)
    return None if tiers is None else sum(tiers.values())


def _peers(instance: Instance, live: list[Instance]) -> tuple[str, list[Instance]]:
    """The role ``instance`` pairs with, and the other ``live`` instances of that role."""
    wanted = "prefill" if instance.is_decode else "decode"
    peers = [
        i
        for i in live
        if i.engine_id != instance.engine_id
        and (i.is_prefill if wanted == "prefill" else i.is_decode)
    ]
    return wanted, peers


def _layout(instance: Instance) -> str:
    info = instance.info
    detail = info.kv_layout or "layout not reported"
    return f"model {info.model!r}, fingerprint {info.fingerprint[:8]}, {detail}"
