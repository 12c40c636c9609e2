"""A KV connector for tests whose only work is a host tier's KV events.

Its scheduler half keeps the index of a "CPU" tier of ``capacity`` blocks (LRU): when a request
finishes, the full blocks it has not yet "offloaded" enter the tier, each with a
``BlockStored`` of medium "CPU", and the least recently offloaded leave it, each with a
``BlockRemoved``. It moves no bytes and loads nothing: it exercises the engine's publishing of
a connector's tier events and snapshot (``take_events``, ``tier_block_hashes``).
"""

from __future__ import annotations

from collections import OrderedDict

from pagedkv.kv_cache.kv_events import CPU, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.kv_connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorWorker
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer.factory import register_connector


class TierEventsConnector(KVConnectorBase):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.capacity: int = self.config.kv_connector_extra_config.get("capacity", 8)
        self.block_size = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        #: The tier's blocks (group 0), least recently offloaded first.
        self.held: OrderedDict[bytes, None] = OrderedDict()
        self._events: list[KVCacheEvent] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        tokens, size = request.all_token_ids, self.block_size
        parent = None
        for i, block_hash in enumerate(request.block_hashes):
            if block_hash in self.held:
                self.held.move_to_end(block_hash)
            else:
                self.held[block_hash] = None
                block_tokens = tuple(tokens[i * size : (i + 1) * size])
                self._events.append(BlockStored((block_hash,), parent, block_tokens, size, 0, CPU))
            parent = block_hash
        while len(self.held) > self.capacity:
            evicted, _ = self.held.popitem(last=False)
            self._events.append(BlockRemoved((evicted,), 0, CPU))
        return False, None

    def tier_capacities(self) -> dict[str, int]:
        return {CPU: self.capacity}

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def tier_block_hashes(self) -> dict[str, list[list[bytes]]]:
        return {CPU: [list(self.held)]}


class TierEventsConnectorWorker(KVConnectorWorker):
    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()


register_connector(
    "TierEventsConnector",
    "tests.engine.tier_events_connector:TierEventsConnector",
    "tests.engine.tier_events_connector:TierEventsConnectorWorker",
)
