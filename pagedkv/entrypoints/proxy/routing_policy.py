"""Routing policies: how the router ranks the instances that could serve a request.

A policy is a small class; ``ROUTING_POLICIES`` names them for ``--routing``. A new policy is
one subclass of ``RoutingPolicy`` and one entry there. Each ranks candidates (best first); a
policy that reads the instances' prefix caches also says what each holds of a prompt
(``hit_tokens``) and records where the router sent it (``expect``).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:  # types only: ``pagedkv proxy --help`` reads the policy names from here
    from pagedkv.entrypoints.proxy.kv_index import KVIndex
    from pagedkv.entrypoints.proxy.prompt_blocks import PromptTokenizer
    from pagedkv.entrypoints.proxy.recent_work import RecentWork
    from pagedkv.entrypoints.proxy.registry import Instance

#: kv_aware: costs this many prompt tokens above the lowest count as tied with it. One block of
#: 16: a chat template's header that every prompt shares is no reason to pile new prefixes on
#: one instance; sent elsewhere, a request recomputes at most this much once.
NEAR_TIE_TOKENS = 16


class Prompt(NamedTuple):
    """What the router knows of a request's prompt."""

    token_ids: list[int]
    cache_salt: str | None = None


class RouterState(Protocol):
    """What a policy reads of the router (its accounting and its view of the caches)."""

    in_flight: Counter[str]
    load_weight: float
    recent_work: RecentWork
    kv_index: KVIndex | None
    tokenizer: PromptTokenizer | None


def load(router: RouterState, instance: Instance) -> int:
    """Requests at ``instance``: in its last heartbeat, plus this proxy's in flight."""
    info = instance.info
    return info.num_running + info.num_waiting + router.in_flight[instance.engine_id]


class RoutingPolicy:
    #: Reads the instances' prefix caches: needs a KV index and the model's tokenizer.
    uses_kv_index = False

    def __init__(self, seed: int | None = None) -> None:
        self.random = random.Random(seed)

    def rank(
        self,
        router: RouterState,
        instances: list[Instance],
        role: str,
        prompt: Prompt | None,
        hits: dict[str, int],
    ) -> list[Instance]:
        """``instances`` (sorted by engine id), best first; ``role``: "decode" (who answers)
        or "prefill" (its P); ``hits``: ``hit_tokens``' answer."""
        raise NotImplementedError

    def hit_tokens(
        self, router: RouterState, prompt: Prompt | None, instances: list[Instance]
    ) -> dict[str, int]:
        """Each instance's cached prefix of the prompt, in tokens ({}: the policy does not
        look)."""
        return {}

    def expect(
        self, router: RouterState, prompt: Prompt | None, instance: Instance, hits: int | None
    ) -> None:
        """``instance`` was chosen to compute the prompt tokens it lacks."""


class RoundRobin(RoutingPolicy):
    """Cycles through the answering instances, then through that D's Ps."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}

    def rank(self, router, instances, role, prompt, hits):
        start = next(self._turns[role]) % len(instances)
        return instances[start:] + instances[:start]


class LeastLoaded(RoutingPolicy):
    """The fewest requests this proxy has in flight there, then the fewest the instance
    reported running and waiting in its last heartbeat."""

    def rank(self, router, instances, role, prompt, hits):
        return sorted(
            instances,
            key=lambda i: (router.in_flight[i.engine_id], i.info.num_running + i.info.num_waiting),
        )


class KVAware(LeastLoaded):
    """The lowest cost = the prompt tokens the instance lacks (its cached prefix from
    ``KVIndex``) + ``load_weight`` x its load. Costs within ``NEAR_TIE_TOKENS`` of the lowest
    are ties, broken by ``RecentWork`` (the fewest prompt tokens sent to compute lately
    first), then at random. Without a prompt: least loaded.

    Why ties need more than load: a prompt no instance holds costs the same everywhere, and
    when requests come one at a time every load is 0, so a random pick can put most new
    prefixes (and then all of their traffic) on one instance. The work an instance was sent
    lately outlives its requests; a new prefix goes where the least was. Near-ties count
    too: a one-block header that every prompt shares would otherwise keep every new prefix
    on the first instance that has it."""

    uses_kv_index = True

    def rank(self, router, instances, role, prompt, hits):
        if prompt is None:
            return super().rank(router, instances, role, prompt, hits)
        self.random.shuffle(instances)  # exact ties at random: the sorts below are stable
        num_tokens = len(prompt.token_ids)
        costs = {i.engine_id: self.cost(router, i, num_tokens, hits) for i in instances}
        tied_below = min(costs.values()) + NEAR_TIE_TOKENS
        tied = [i for i in instances if costs[i.engine_id] <= tied_below]
        others = [i for i in instances if costs[i.engine_id] > tied_below]
        tied.sort(key=lambda i: router.recent_work.get(i.engine_id))
        others.sort(key=lambda i: costs[i.engine_id])
        return tied + others

    @staticmethod
    def cost(router: RouterState, instance: Instance, num_tokens: int, hits: dict) -> float:
        """Prompt tokens ``instance`` lacks + ``load_weight`` x its load (lowest wins)."""
        lacking = num_tokens - hits.get(instance.engine_id, 0)
        return lacking + router.load_weight * load(router, instance)

    def hit_tokens(self, router, prompt, instances):
        if prompt is None:
            return {}
        assert router.kv_index is not None and router.tokenizer is not None
        hits: dict[str, int] = {i.engine_id: 0 for i in instances}
        by_hashing: dict[tuple[int, str], list[str]] = {}
        for instance in instances:
            if instance.info.hash_algo:
                key = (instance.info.block_size, instance.info.hash_algo)
                by_hashing.setdefault(key, []).append(instance.engine_id)
        for (block_size, algo), names in by_hashing.items():
            # The last prompt token is always computed (for its logits): never a hit.
            hashes = router.tokenizer.block_hashes(
                prompt.token_ids[:-1], block_size, algo, prompt.cache_salt
            )
            for name, num_blocks in router.kv_index.overlap(hashes, names).items():
                hits[name] = num_blocks * block_size
        return hits

    def expect(self, router, prompt, instance, hits):
        """The instance will compute the prompt tokens it lacks, and cache the prompt's full
        blocks soon."""
        if prompt is None:
            return
        router.recent_work.add(instance.engine_id, len(prompt.token_ids) - (hits or 0))
        info = instance.info
        if not info.hash_algo:
            return
        assert router.kv_index is not None and router.tokenizer is not None
        hashes = router.tokenizer.block_hashes(
            prompt.token_ids, info.block_size, info.hash_algo, prompt.cache_salt
        )
        router.kv_index.expect(instance.engine_id, hashes)


#: ``--routing`` names.
ROUTING_POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "kv_aware": KVAware,
}
