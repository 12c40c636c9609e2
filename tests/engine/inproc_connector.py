"""A KV connector for tests: two engines in one process hand KV over through a dict.

It exercises the scheduler's side of the connector contract (async loads, held blocks,
failure policies, deadlines, aborts) with real KV, so outputs can be compared token for token.
The real connectors (P2P, store) are tested with real processes elsewhere.

kv_transfer_params understood:
  producer: {"do_remote_decode": True, "transfer_id": tid}
  consumer: {"do_remote_prefill": True, "transfer_id": tid,
             "fail_from_block": k (optional: blocks >= k fail to load),
             "hang": True (optional: the load never completes unless cancelled)}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.kv_cache.kv_cache_block import NULL_BLOCK_ID
from pagedkv.kv_connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorWorker
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer.factory import register_connector

#: transfer id -> per-layer KV of the producer's blocks (block index order, all groups)
STORE: dict[str, list[torch.Tensor]] = {}


@dataclass
class Load:
    request_id: str
    transfer_id: str
    first_block: int
    block_ids: tuple[list[int], ...]
    fail_from_block: int | None
    hang: bool


@dataclass
class InProcMetadata(KVConnectorMetadata):
    sends: list[tuple[str, str, tuple[list[int], ...]]] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


class InProcConnector(KVConnectorBase):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._meta = InProcMetadata()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or num_external_tokens == 0:
            return
        block_size = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self._meta.loads.append(
            Load(
                request.request_id,
                params["transfer_id"],
                (request.num_computed_tokens or 0) // block_size,
                blocks.get_block_ids(),
                params.get("fail_from_block"),
                bool(params.get("hang")),
            )
        )

    def build_connector_meta(self, scheduler_output):
        meta, self._meta = self._meta, InProcMetadata()
        return meta

    def request_finished(self, request, block_ids):
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode") and request.status.name == "FINISHED_LENGTH_CAPPED":
            self._meta.sends.append((request.request_id, params["transfer_id"], block_ids))
            return True, {"do_remote_prefill": True, "transfer_id": params["transfer_id"]}
        return False, None

    def cancel_load(self, request):
        self._meta.cancels.append(request.request_id)


class InProcConnectorWorker(KVConnectorWorker):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._pending: dict[str, Load] = {}
        self._done = KVConnectorOutput()
        self.loaded_blocks = 0

    def start_load_kv(self) -> None:
        meta: InProcMetadata = self._metadata  # type: ignore[assignment]
        for request_id, transfer_id, block_ids in meta.sends:
            STORE[transfer_id] = [
                cache[:, block_ids[self.layer_groups[i]]].clone()
                for i, cache in enumerate(self.kv_caches)
            ]
            self._done.finished_sending.add(request_id)
        for load in meta.loads:
            self._pending[load.request_id] = load
        for request_id in meta.cancels:
            load = self._pending.pop(request_id, None)
            if load is not None:
                self._finish(load, failed_from=load.first_block)
        for request_id, load in list(self._pending.items()):
            if load.hang:
                continue
            del self._pending[request_id]
            self._finish(load, failed_from=load.fail_from_block)

    def _finish(self, load: Load, failed_from: int | None) -> None:
        src = STORE[load.transfer_id]
        for i, cache in enumerate(self.kv_caches):
            dst = load.block_ids[self.layer_groups[i]]
            for b in range(load.first_block, len(dst)):
                if failed_from is not None and b >= failed_from:
                    self._done.invalid_block_ids.add(dst[b])
                elif dst[b] != NULL_BLOCK_ID and b < src[i].shape[1]:
                    cache[:, dst[b]] = src[i][:, b]
                    self.loaded_blocks += i == 0
        self._done.finished_recving.add(load.request_id)

    def get_finished(self) -> KVConnectorOutput:
        done, self._done = self._done, KVConnectorOutput()
        return done


register_connector(
    "InProcConnector",
    "tests.engine.inproc_connector:InProcConnector",
    "tests.engine.inproc_connector:InProcConnectorWorker",
)
