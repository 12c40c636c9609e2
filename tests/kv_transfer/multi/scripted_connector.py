"""A KV connector whose answers come from its ``kv_connector_extra_config`` and whose calls
are recorded: children for unit tests of the MultiConnector.

extra config (all optional):
  matched:   tokens ``get_num_new_matched_tokens`` answers (an int, or None: "not known yet")
  sync:      those tokens load synchronously (in the step) rather than asynchronously
  hold:      ``request_finished`` holds the blocks
  params:    the ``kv_transfer_params`` ``request_finished`` answers
  events:    what ``take_events`` answers (once)
  stats:     what both halves' ``get_kv_connector_stats`` answer
  peer:      ``[engine_id, host, port]``: the ``peer_address``
  signals:   the worker half ``signals_progress``
  fail:      "shutdown": ``shutdown`` raises; "start": the worker half fails to start
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.kv_connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorWorker
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer.factory import register_connector
from pagedkv.transport.peer_addr import PeerAddr

#: Every scripted half's calls, in order: (engine-side name, method, args).
CALLS: list[tuple[str, str, tuple]] = []


@dataclass
class ScriptedMetadata(KVConnectorMetadata):
    name: str
    step: int


class _Scripted:
    def _init_script(self) -> None:
        self.script = self.config.kv_connector_extra_config
        self.name = self.script.get("name", "?")

    def record(self, method: str, *args) -> None:
        CALLS.append((self.name, method, args))

    def get_kv_connector_stats(self) -> dict[str, int | float]:
        return dict(self.script.get("stats", {}))

    def shutdown(self) -> None:
        self.record("shutdown")
        if self.script.get("fail") == "shutdown":
            raise RuntimeError(f"{self.name} failed to shut down")


class ScriptedConnector(_Scripted, KVConnectorBase):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._init_script()
        self.steps = 0
        self.outputs: list[KVConnectorOutput] = []
        self._events = list(self.script.get("events", []))

    @property
    def peer_address(self) -> PeerAddr | None:
        peer = self.script.get("peer")
        return None if peer is None else PeerAddr(*peer)

    def on_new_request(self, request) -> None:
        self.record("on_new_request", request.request_id)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.record("get_num_new_matched_tokens", request.request_id, num_computed_tokens)
        return self.script.get("matched", 0), not self.script.get("sync", False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        self.record("update_state_after_alloc", request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> ScriptedMetadata:
        self.steps += 1
        return ScriptedMetadata(self.name, self.steps)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.outputs.append(output)

    def request_finished(self, request, block_ids):
        self.record("request_finished", request.request_id)
        return bool(self.script.get("hold")), self.script.get("params")

    def cancel_load(self, request) -> None:
        self.record("cancel_load", request.request_id)

    def take_events(self) -> list:
        events, self._events = self._events, []
        return events


class ScriptedConnectorWorker(_Scripted, KVConnectorWorker):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._init_script()
        if self.script.get("fail") == "start":
            raise RuntimeError(f"{self.name} failed to start")
        self.signals_progress = bool(self.script.get("signals"))
        #: What the next ``get_finished`` answers (tests fill it).
        self.pending = KVConnectorOutput()
        self.bound: list[KVConnectorMetadata] = []

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        self.bound.append(metadata)

    def start_load_kv(self) -> None:
        self.record("start_load_kv")

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self.record("wait_for_layer_load", layer_idx)

    def save_kv_layer(self, layer_idx, kv_cache, attn_metadata) -> None:
        self.record("save_kv_layer", layer_idx)

    def wait_for_save(self) -> None:
        self.record("wait_for_save")

    def get_finished(self) -> KVConnectorOutput:
        out, self.pending = self.pending, KVConnectorOutput()
        return out


register_connector(
    "ScriptedConnector",
    "tests.kv_transfer.multi.scripted_connector:ScriptedConnector",
    "tests.kv_transfer.multi.scripted_connector:ScriptedConnectorWorker",
)
