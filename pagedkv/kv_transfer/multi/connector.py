"""MultiConnector, scheduler half: several connectors (its children) composed as one.

Semantics (vLLM's MultiConnector's, plus what this engine's contract asks):

- Load: the children are asked in order, each from where the ones before it stop: a child
  that has external tokens for a request loads them, and the next is asked from their end.
  So on D, ``MultiConnector(offloading, P2P)`` loads a shared prefix from its own tiers and
  the rest from P; on P, the tiers' prefix before computing. Several children load one request
  only while each load is asynchronous (a synchronous load is a request's only one). A child
  that answers "not known yet" (None) makes the MultiConnector answer None.
- Failed loads: ``load_failure_policy_for`` is the loading children's: ``recompute`` if any of
  them recomputes (a cache's miss never fails a request), else ``fail``; for a request no child
  loads, the MultiConnector's own (config, or "fail"). ``load_timeout`` is the longest of the
  children's.
- Save: every child sees every request. A finished request whose blocks two children hold is
  reported in ``finished_sending`` only once both have (``MultiConnectorMetadata.holders``,
  counted by the worker half).
- ``kv_transfer_params``: the children's answers merged key by key; a key set by an earlier
  child is kept (children in order).
- Stats: each child's, prefixed by its word (``stats.py``); events, tier hashes and tier
  capacities: the children's, in order;
  ``peer_address``: the first child's that is not None.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedkv.distributed.shard import SINGLE_LAYOUT, TPLayout
from pagedkv.kv_connector.base import KVConnectorBase
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_connector.protocols import ConnectorRequest, ScheduledStep
from pagedkv.kv_transfer.factory import create_scheduler_connector
from pagedkv.kv_transfer.multi.children import build_children, shutdown_all
from pagedkv.kv_transfer.multi.config import child_configs
from pagedkv.kv_transfer.multi.metadata import MultiConnectorMetadata
from pagedkv.kv_transfer.multi.stats import child_prefixes, merged_stats
from pagedkv.transport.peer_addr import PeerAddr

if TYPE_CHECKING:
    from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
    from pagedkv.kv_cache.kv_cache_manager import KVCacheBlocks
    from pagedkv.kv_cache.kv_events import KVCacheEvent


class MultiConnector(KVConnectorBase):
    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache_config: KVCacheConfig,
        model_fingerprint: str,
        tp: TPLayout = SINGLE_LAYOUT,
    ) -> None:
        super().__init__(config, kv_cache_config, model_fingerprint, tp)
        configs = child_configs(config)
        self.stats_prefixes = child_prefixes(configs)
        self.connectors: list[KVConnectorBase] = build_children(
            functools.partial(create_scheduler_connector, tp=tp),
            configs,
            kv_cache_config,
            model_fingerprint,
        )
        #: Request id -> (position, tokens) of each child that loads it, in order (until the
        #: request ends).
        self._loaders: dict[str, list[tuple[int, int]]] = {}
        #: This step's admitted requests loaded by two children or more.
        self._shared_loads: dict[str, tuple[int, ...]] = {}
        #: This step's finished requests held by two children or more.
        self._holders: dict[str, tuple[int, ...]] = {}

    def _loading_children(self, request: ConnectorRequest) -> list[KVConnectorBase]:
        return [self.connectors[p] for p, _ in self._loaders.get(request.request_id, ())]

    def load_failure_policy_for(self, request: ConnectorRequest) -> str:
        policies = {c.load_failure_policy_for(request) for c in self._loading_children(request)}
        if not policies:
            return self.load_failure_policy
        return "recompute" if "recompute" in policies else "fail"

    @property
    def load_timeout(self) -> float:
        return max(child.load_timeout for child in self.connectors)

    @property
    def peer_address(self) -> PeerAddr | None:
        return next((c.peer_address for c in self.connectors if c.peer_address is not None), None)

    def on_new_request(self, request: ConnectorRequest) -> None:
        for child in self.connectors:
            child.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        loaders: list[tuple[int, int]] = []
        total, load_async = 0, False
        for position, child in enumerate(self.connectors):
            num_tokens, child_async = child.get_num_new_matched_tokens(
                request, num_computed_tokens + total
            )
            if num_tokens is None:
                self._loaders.pop(request.request_id, None)
                return None, False
            if num_tokens == 0:
                continue
            if loaders and not (load_async and child_async):
                break  # a synchronous load is a request's only one
            loaders.append((position, num_tokens))
            total, load_async = total + num_tokens, child_async
            if not child_async:
                break
        self._loaders[request.request_id] = loaders
        return total, load_async

    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Each loading child gets its own tokens (a lone loader: the tracker's count, which
        caps a synchronous load before the last prompt token); the others 0."""
        loaders = self._loaders.get(request.request_id, []) if num_external_tokens else []
        tokens = dict(loaders)
        if len(loaders) == 1:
            tokens = {loaders[0][0]: num_external_tokens}
        elif loaders:
            assert sum(tokens.values()) == num_external_tokens, (tokens, num_external_tokens)
            self._shared_loads[request.request_id] = tuple(tokens)
        for position, child in enumerate(self.connectors):
            child.update_state_after_alloc(request, blocks, tokens.get(position, 0))

    def build_connector_meta(self, scheduler_output: ScheduledStep) -> MultiConnectorMetadata:
        children = tuple(child.build_connector_meta(scheduler_output) for child in self.connectors)
        holders, self._holders = self._holders, {}
        loaders, self._shared_loads = self._shared_loads, {}
        return MultiConnectorMetadata(children, holders, loaders)

    def combine_worker_meta(self, metas: Sequence[Any]) -> Any:
        """Each child combines its own position of the ranks' tuples (``KVConnectorOutput.merge``
        made them)."""
        if all(meta is None for meta in metas):
            return None
        combined = tuple(
            child.combine_worker_meta([None if meta is None else meta[i] for meta in metas])
            for i, child in enumerate(self.connectors)
        )
        return None if all(meta is None for meta in combined) else combined

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Each child sees the whole report, with its own ``worker_meta``."""
        metas = output.worker_meta
        for position, child in enumerate(self.connectors):
            mine = None if metas is None else metas[position]
            child.update_connector_output(dataclasses.replace(output, worker_meta=mine))

    def request_finished(
        self, request: ConnectorRequest, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        holders: list[int] = []
        params: dict | None = None
        for position, child in enumerate(self.connectors):
            hold, child_params = child.request_finished(request, block_ids)
            if hold:
                holders.append(position)
            if child_params is not None:
                params = {**child_params, **(params or {})}
        self._loaders.pop(request.request_id, None)
        if len(holders) > 1:
            self._holders[request.request_id] = tuple(holders)
        return bool(holders), params

    def cancel_load(self, request: ConnectorRequest) -> None:
        for child in self._loading_children(request):
            child.cancel_load(request)

    def take_events(self) -> list[KVCacheEvent]:
        return [event for child in self.connectors for event in child.take_events()]

    def tier_block_hashes(self) -> dict[str, list[list[bytes]]]:
        return {m: h for c in self.connectors for m, h in c.tier_block_hashes().items()}

    def tier_capacities(self) -> dict[str, int]:
        return {m: n for c in self.connectors for m, n in c.tier_capacities().items()}

    def get_kv_connector_stats(self) -> dict[str, int | float]:
        stats = [child.get_kv_connector_stats() for child in self.connectors]
        return merged_stats(self.stats_prefixes, stats)

    def shutdown(self) -> None:
        shutdown_all(self.connectors)
