"""Routing: which instance answers a request, and which P prefills it (any number of each).

Instances that answer: replicas (``plain``: no P2P connector, data parallel) and decode
instances. A decode instance is paired with a prefill instance of the same model fingerprint
(KV moves only between equals); a replica, or a D told to prefill itself, answers alone. The
answering instance is chosen first, then its P, each ranked by the routing policy
(``routing_policy.py``: round robin, least loaded, or ``kv_aware``: D by its own cached prefix,
since D asks P only for the blocks it lacks, and P by its own).

Conditional disaggregation (``disagg_threshold`` N > 0): a D that lacks fewer than N prompt
tokens prefills them itself, with no P. Instances that already failed this request are
skipped, so a retry lands elsewhere. When nothing is left, ``why_no_pair`` says why, instance
by instance;
``pairing_note`` says it of one instance (shown in ``/instances`` and told at registration).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import NamedTuple

from pagedkv.entrypoints.proxy.kv_index import KVIndex
from pagedkv.entrypoints.proxy.prompt_blocks import PromptTokenizer
from pagedkv.entrypoints.proxy.recent_work import RecentWork
from pagedkv.entrypoints.proxy.registry import Instance, InstanceRegistry
from pagedkv.entrypoints.proxy.routing_policy import ROUTING_POLICIES, Prompt


class Route(NamedTuple):
    """``d`` answers; ``p`` (None: nobody) prefills for it. ``predicted_hit_tokens``: the
    prompt tokens ``d``'s prefix cache should serve, when the router looked (kv_aware)."""

    d: Instance
    p: Instance | None = None
    predicted_hit_tokens: int | None = None


class Router:
    def __init__(
        self,
        registry: InstanceRegistry,
        policy: str = "round_robin",
        *,
        kv_index: KVIndex | None = None,
        tokenizer: PromptTokenizer | None = None,
        load_weight: float = 32.0,
        disagg_threshold: int = 0,
        seed: int | None = None,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {tuple(ROUTING_POLICIES)}, got {policy!r}")
        self.policy = ROUTING_POLICIES[policy](seed)
        if self.policy.uses_kv_index and (kv_index is None or tokenizer is None):
            raise ValueError(f"{policy} routing needs a KV index and the model's tokenizer")
        if disagg_threshold and tokenizer is None:
            raise ValueError("--disagg-threshold needs the model's tokenizer")
        self.registry = registry
        self.kv_index = kv_index
        self.tokenizer = tokenizer
        self.load_weight = load_weight
        self.disagg_threshold = disagg_threshold
        self.in_flight: Counter[str] = Counter()
        self.recent_work = RecentWork()

    @property
    def needs_prompt(self) -> bool:
        return self.tokenizer is not None

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
        hits = self.policy.hit_tokens(self, prompt, answerers)
        for d in self._rank(answerers, "decode", prompt, hits):
            predicted = hits.get(d.engine_id)
            if d.is_replica or alone or self._prefills_itself(prompt, predicted):
                self.policy.expect(self, prompt, d, predicted)
                return Route(d, None, predicted)
            compatible = [
                p
                for p in live
                if p.is_prefill
                and p.info.fingerprint == d.info.fingerprint
                and p.engine_id != d.engine_id
            ]
            if compatible:
                p_hits = self.policy.hit_tokens(self, prompt, compatible)
                p = self._rank(compatible, "prefill", prompt, p_hits)[0]
                self.policy.expect(self, prompt, d, predicted)
                self.policy.expect(self, prompt, p, p_hits.get(p.engine_id))
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
        hits: dict[str, int],
    ) -> list[Instance]:
        """``instances``, best first, by the policy."""
        instances = sorted(instances, key=lambda i: i.engine_id)
        return self.policy.rank(self, instances, role, prompt, hits) if instances else instances

    # ------------------------------------------------------------------ explaining
    def pairing_note(self, instance: Instance) -> str | None:
        """Why ``instance`` cannot be paired with any live instance now (None: it can, or it
        is a replica, which is never paired)."""
        if instance.is_replica:
            return None
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
        wanted = "prefill" if instance.is_decode else "decode"
        equals = [
            i.engine_id
            for i in live
            if i.engine_id != instance.engine_id
            and (i.is_prefill if wanted == "prefill" else i.is_decode)
            and i.info.fingerprint == instance.info.fingerprint
        ]
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


def _layout(instance: Instance) -> str:
    info = instance.info
    detail = info.kv_layout or "layout not reported"
    return f"model {info.model!r}, fingerprint {info.fingerprint[:8]}, {detail}"
