"""P2pConnector, scheduler half: plans loads (D) and holds (P); never touches a tensor or socket.

``KVTransferParams``, minted by the proxy (``transfer_id`` is the router's, never parsed from a
request id), read here::

    D: do_remote_prefill, transfer_id, remote_engine_id, remote_host, remote_port
                                                 <- P's KV address (all required)
       [remote_tp_size]                          <- P's tensor-parallel size (absent: D's)
    P: do_remote_decode, transfer_id, [remote_engine_id]
                                                 <- D's engine id (optional): only D may pull
       [remote_tp_size]                          <- D's tensor-parallel size (absent: P's)

D. A request with ``do_remote_prefill`` and a local prefix hit of ``h`` tokens (block aligned)
loads the prompt blocks it lacks, asynchronously::

    prompt of n tokens, block_size 4, local hit h = 8
    blocks:   [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ]      n = 18 -> ceil(18/4) = 5 blocks
              |-local-|---- loaded -----|    block indices [h/bs, ceil(n/bs)) = 2, 3, 4

After the load the scheduler recomputes only token n-1 (for its logits). A request is loaded
at most once: if it is preempted later it recomputes like any other request.

P. A request with ``do_remote_decode`` runs normally (the proxy sends ``max_tokens=1``). From its
arrival until it ends it is announced to the worker (``arrivals``, ``departures``), which names
its transfer to D as still being computed, so D's load deadline waits for a busy P. In the
step whose forward completes its prompt it is announced to the worker (``computing``), so PUT
and PUT_ASYNC can send each layer as soon as the forward has written it. When it finishes with
its prompt computed, ``request_finished`` holds its blocks (``holds``) until the worker reports
the transfer ended in ``finished_sending``; a request that ends otherwise is ``released`` and
D's WANT is refused.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from pagedkv.distributed.shard import SINGLE_LAYOUT, Shard, TPLayout
from pagedkv.kv_cache.kv_cache_block import NULL_BLOCK_ID
from pagedkv.kv_connector.base import KVConnectorBase, KVConnectorMetadata
from pagedkv.kv_connector.params import KVTransferParams, asks_for
from pagedkv.kv_connector.protocols import ConnectorRequest
from pagedkv.kv_transfer.p2p.config import P2pConfig
from pagedkv.transport.peer_addr import PeerAddr
from pagedkv.utils import cdiv

if TYPE_CHECKING:
    from pagedkv.kv_cache.kv_cache_manager import KVCacheBlocks
    from pagedkv.kv_connector.output import KVConnectorOutput
    from pagedkv.worker.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

#: P's address, as D reads it (all required).
_PEER_FIELDS = ("remote_engine_id", "remote_host", "remote_port")
#: What P reads; ``remote_engine_id`` is optional there.
_SEND_FIELDS = ("do_remote_decode", "transfer_id", "remote_engine_id", "remote_tp_size")
#: Finish reasons after which a producer's prompt KV is complete and worth sending.
_SENDABLE = ("length", "stop")


def prompt_hash(token_ids: list[int]) -> str:
    """Both ends compare it: P and D must hold the same prompt for the same transfer."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:32]


class RemoteLoad(NamedTuple):
    """A consumer request's transfer; ``error`` (bad params) makes its load fail at once, so
    ``kv_load_failure_policy`` decides (an error, or a local prefill)."""

    transfer_id: str
    remote: PeerAddr | None
    error: str | None
    #: P's tensor-parallel size (None: the same as D's).
    remote_tp_size: int | None = None


def parse_remote_load(raw: Mapping[str, Any]) -> RemoteLoad:
    """D's load from a request's kv_transfer_params (which ask for a remote prefill); a
    malformed or missing field fails it, named in ``error``."""
    transfer_id = ""  # kept for the log when only P's address is malformed
    try:
        tid = KVTransferParams.parse(raw, ["transfer_id"], required=["transfer_id"]).transfer_id
        transfer_id = tid or ""
        params = KVTransferParams.parse(
            raw, ["do_remote_prefill", *_PEER_FIELDS, "remote_tp_size"], required=_PEER_FIELDS
        )
    except ValueError as e:
        return RemoteLoad(transfer_id, None, str(e))
    peer = PeerAddr(params.remote_engine_id, params.remote_host, params.remote_port)
    return RemoteLoad(transfer_id, peer, None, params.remote_tp_size)


@dataclass(slots=True)
class LoadSpec:
    """D: load ``block_indices`` (per KV cache group) of ``transfer_id`` from ``remote``
    (``error`` set: fail the load without contacting anyone)."""

    request_id: str
    transfer_id: str
    remote: PeerAddr | None
    error: str | None
    num_prompt_tokens: int
    prompt_hash: str
    #: D's whole block table per group; the targets are ``block_ids[g][i]`` for i in indices.
    block_ids: tuple[list[int], ...]
    block_indices: list[list[int]]
    #: P's tensor-parallel size (None: the same as D's).
    remote_tp_size: int | None = None
    #: The checkpoint's KV heads this load takes from ``remote`` (None: all this rank holds);
    #: set by the worker for one piece of a load (head_plan.py).
    kv_heads: Shard | None = None


@dataclass(slots=True)
class SendSpec:
    """P: the prompt KV of ``transfer_id`` lives in ``block_ids`` (per group, block-table order)."""

    request_id: str
    transfer_id: str
    num_prompt_tokens: int
    prompt_hash: str
    block_ids: tuple[list[int], ...]
    #: Only this engine may pull the KV (None: any peer that knows the transfer id).
    expected_peer: str | None
    #: The checkpoint's KV heads sent (None: all this rank holds); set by the worker for one
    #: piece of a transfer (head_plan.py).
    kv_heads: Shard | None = None


@dataclass
class P2pConnectorMetadata(KVConnectorMetadata):
    #: D: transfers of requests that arrived and wait for admission (P keeps their KV).
    queued: list[RemoteLoad] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    #: D: request ids whose load must end now (aborted, or past the deadline).
    cancels: list[str] = field(default_factory=list)
    #: D: transfers whose request ended before its load started: P may free at once.
    abandons: list[RemoteLoad] = field(default_factory=list)
    #: P: requests whose prompt is complete after this step's forward pass.
    computing: list[SendSpec] = field(default_factory=list)
    #: P: finished requests whose blocks the connector holds until ``finished_sending``.
    holds: list[SendSpec] = field(default_factory=list)
    #: P: transfer ids whose request ended without KV to send (its blocks are not held).
    releases: list[str] = field(default_factory=list)
    #: P: requests that arrived, with their transfer id: from now until they depart, P names
    #: the transfer in its heartbeats to D as still being computed.
    arrivals: list[tuple[str, str]] = field(default_factory=list)
    #: P: arrived requests that ended (their KV is computed, or never will be).
    departures: list[str] = field(default_factory=list)
    #: P: the tensor-parallel size of the D each transfer above goes to, where its params
    #: say (absent: the same as P's).
    remote_tp_sizes: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Producing:
    """P: a request whose KV goes to D; ``spec.block_ids`` follow its block table."""

    spec: SendSpec
    announced: bool = False
    remote_tp_size: int | None = None


class P2pConnector(KVConnectorBase):
    def __init__(
        self, config, kv_cache_config, model_fingerprint: str, tp: TPLayout = SINGLE_LAYOUT
    ) -> None:
        super().__init__(config, kv_cache_config, model_fingerprint, tp)
        self.p2p_config = P2pConfig.from_kv_transfer_config(config)
        block_sizes = set(kv_cache_config.block_sizes)
        if len(block_sizes) != 1:
            raise ValueError(
                f"the P2P connector needs one block size for every KV cache group, got "
                f"{sorted(block_sizes)}"
            )
        self.block_size = block_sizes.pop()
        self._meta = P2pConnectorMetadata()
        self._producing: dict[str, _Producing] = {}
        #: D: requests whose load was issued (never load twice) -> their transfer.
        self._loading: dict[str, RemoteLoad] = {}
        #: Transfer ids in use -> the one request using each: D from its load until the
        #: request ends; P from admission until its blocks are released. A second request
        #: with a live id is refused (its load fails, its KV is not sent): both on one
        #: transfer record, one of them would hold its blocks forever.
        self._loading_tids: dict[str, str] = {}
        self._sending_tids: dict[str, str] = {}
        #: P: requests whose blocks are held -> their transfer id (until finished_sending).
        self._held: dict[str, str] = {}
        #: P: requests announced in ``arrivals`` that have not departed yet.
        self._arrived: set[str] = set()

    # ------------------------------------------------------------------ D
    def _remote_load(self, request: ConnectorRequest) -> RemoteLoad | None:
        raw = request.kv_transfer_params
        if not self.config.kv_role.consumes or not asks_for(raw, "do_remote_prefill"):
            return None
        return parse_remote_load(raw)

    def on_new_request(self, request: ConnectorRequest) -> None:
        load = self._remote_load(request)
        if load is not None and load.remote is not None:
            self._meta.queued.append(load)
        try:
            params = self._send_params(request)
        except ValueError:  # warned about at admission
            return
        if params is not None:
            assert params.transfer_id is not None
            self._arrived.add(request.request_id)
            self._meta.arrivals.append((request.request_id, params.transfer_id))
            self._note_tp_size(params.transfer_id, params.remote_tp_size)

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self._loading or self._remote_load(request) is None:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._track_producer(request)
        if num_external_tokens == 0:
            return
        load = self._remote_load(request)
        assert load is not None
        if load.remote is not None:
            owner = self._loading_tids.setdefault(load.transfer_id, request.request_id)
            if owner != request.request_id:
                why = f"transfer id {load.transfer_id!r} is already in use by another request"
                load = RemoteLoad(load.transfer_id, None, why)
        self._loading[request.request_id] = load
        num_prompt = request.num_prompt_tokens
        first_block = (num_prompt - num_external_tokens) // self.block_size
        end_block = cdiv(num_prompt, self.block_size)
        block_ids = blocks.get_block_ids()
        self._meta.loads.append(
            LoadSpec(
                request_id=request.request_id,
                transfer_id=load.transfer_id,
                remote=load.remote,
                error=load.error,
                num_prompt_tokens=num_prompt,
                prompt_hash=prompt_hash(request.prompt_token_ids),
                block_ids=block_ids,
                remote_tp_size=load.remote_tp_size,
                # The null block stands for window-skipped positions: never loaded into.
                block_indices=[
                    [
                        i
                        for i in range(first_block, min(end_block, len(ids)))
                        if ids[i] != NULL_BLOCK_ID
                    ]
                    for ids in block_ids
                ],
            )
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id in output.finished_sending:  # P: the blocks are released
            transfer_id = self._held.pop(request_id, None)
            if transfer_id is not None and self._sending_tids.get(transfer_id) == request_id:
                del self._sending_tids[transfer_id]

    def cancel_load(self, request: ConnectorRequest) -> None:
        self._meta.cancels.append(request.request_id)

    # ------------------------------------------------------------------ P
    def _send_params(self, request: ConnectorRequest) -> KVTransferParams | None:
        """P: the params of a request whose KV goes to D (None: it does not ask for that);
        ValueError names a malformed field."""
        raw = request.kv_transfer_params
        if not self.config.kv_role.produces or not asks_for(raw, "do_remote_decode"):
            return None
        return KVTransferParams.parse(raw, _SEND_FIELDS, required=["transfer_id"])

    def _note_tp_size(self, transfer_id: str, remote_tp_size: int | None) -> None:
        """P: this step's metadata says the size of the D the transfer goes to, if known."""
        if remote_tp_size is not None:
            self._meta.remote_tp_sizes[transfer_id] = remote_tp_size

    def _track_producer(self, request: ConnectorRequest) -> None:
        if request.request_id in self._producing:
            return
        try:
            params = self._send_params(request)
        except ValueError as e:
            logger.warning("request %s: %s; its KV will not be sent", request.request_id, e)
            return
        if params is None:
            return
        transfer_id = params.transfer_id
        assert transfer_id is not None
        owner = self._sending_tids.setdefault(transfer_id, request.request_id)
        if owner != request.request_id:
            logger.warning(
                "request %s: transfer id %r is already in use by request %s; its KV will not "
                "be sent",
                request.request_id,
                transfer_id,
                owner,
            )
            return
        self._producing[request.request_id] = _Producing(
            SendSpec(
                request.request_id,
                transfer_id,
                request.num_prompt_tokens,
                prompt_hash(request.prompt_token_ids),
                (),
                params.remote_engine_id,
            ),
            remote_tp_size=params.remote_tp_size,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pConnectorMetadata:
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            producing = self._producing.get(new.req_id)
            if producing is not None:  # new, or resumed after preemption: a fresh block table
                producing.spec.block_ids = tuple(list(ids) for ids in new.block_ids)
                self._announce_if_complete(
                    producing, new.num_computed_tokens + num_scheduled[new.req_id]
                )
        for cached in scheduler_output.scheduled_cached_reqs:
            producing = self._producing.get(cached.req_id)
            if producing is not None:
                for ids, new_ids in zip(producing.spec.block_ids, cached.new_block_ids):
                    ids.extend(new_ids)
                self._announce_if_complete(
                    producing, cached.num_computed_tokens + num_scheduled[cached.req_id]
                )
        meta, self._meta = self._meta, P2pConnectorMetadata()
        return meta

    def _announce_if_complete(self, producing: _Producing, num_computed_after_step: int) -> None:
        spec = producing.spec
        if producing.announced or num_computed_after_step < spec.num_prompt_tokens:
            return
        producing.announced = True
        self._note_tp_size(spec.transfer_id, producing.remote_tp_size)
        self._meta.computing.append(
            replace(spec, block_ids=tuple(list(ids) for ids in spec.block_ids))
        )

    def request_finished(
        self, request: ConnectorRequest, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        request_id = request.request_id
        if request_id in self._arrived:
            self._arrived.discard(request_id)
            self._meta.departures.append(request_id)
        loaded = self._loading.pop(request_id, None)
        if loaded is None:
            load = self._remote_load(request)
            if load is not None and load.remote is not None:
                self._meta.abandons.append(load)  # ended before its load started: P may free
        elif self._loading_tids.get(loaded.transfer_id) == request_id:
            del self._loading_tids[loaded.transfer_id]
        producing = self._producing.pop(request_id, None)
        try:
            params = self._send_params(request)
        except ValueError:  # warned about at admission
            return False, None
        if params is None:
            return False, None
        transfer_id = params.transfer_id
        assert transfer_id is not None
        owner = self._sending_tids.get(transfer_id)
        if owner is not None and owner != request_id:
            return False, None  # refused at admission: the live transfer is another request's
        complete = request.num_computed_tokens >= request.num_prompt_tokens
        self._note_tp_size(transfer_id, params.remote_tp_size)
        if producing is None or not complete or request.status.finish_reason not in _SENDABLE:
            self._sending_tids.pop(transfer_id, None)
            self._meta.releases.append(transfer_id)
            return False, None
        self._held[request_id] = transfer_id
        self._meta.holds.append(replace(producing.spec, block_ids=block_ids))
        handoff = KVTransferParams.handoff(
            transfer_id, self.peer_address, to="decode", remote_tp_size=self.tp.size
        )
        return True, handoff.to_dict()

    @property
    def peer_address(self) -> PeerAddr:
        return PeerAddr(self.config.engine_id, self.config.kv_ip, self.config.kv_port)
