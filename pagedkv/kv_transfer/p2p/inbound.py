"""InboundTransfers: D's loads, from the scheduler's plan to their one reported end.

A load sends its WANT (setting up the pair group with P on first contact), waits for its
part of a wire batch on the group's ReceiveLane, and ends exactly once: delivered, refused (P
NACKed), or failed (cancelled by the scheduler: aborted or past ``kv_load_timeout``; the
peer lost or refusing our messages; a receive error). The end is reported at once:
``finished_recving``, and for a failed load its blocks in ``invalid_block_ids`` with a reason
naming the peer and the cause, once no receive posted straight into its blocks is in flight
(at once, unless one was): setting ``cancelled`` under the load's lock stops the lane from
posting or scattering into them, so nothing lands in them after the report; what P still
sends for it drains into staging. P hears how the load ended (DONE, or CANCEL while it had
not started), so it frees its blocks at once.

Requests waiting for admission (``on_queued``) are named in the heartbeats too: P keeps their
KV (renewing its lease) while D has no room to ask for it yet. The other way, P's heartbeats
name the loads whose request P is still computing (``on_peer_busy``): a load's deadline,
``kv_load_timeout``, counts from its start or from the last time P named it, whichever is
later, here and in the scheduler (told through ``loads_in_progress``). A busy P costs time; a
P that stops naming a load, or dies, lets its deadline run out.

Between instances of different tensor-parallel sizes a load is one *piece* (head_plan.py):
some KV heads of its blocks, from one P rank, received into this rank's cache narrowed to
them (``LoadSpec.kv_heads``); the worker splits a request's load into its pieces and reports
the request once each has ended (tp_pieces.py).

Events: ``on_queued``, ``on_load``, ``on_cancel``, ``on_abandon`` (engine thread); ``on_nack``,
``on_peer_refused``, ``on_peer_busy`` (listener); ``on_xfer_part``, ``on_received`` (receive lanes);
``on_peer_lost`` (Peers); ``on_tick`` (maintenance). One lock guards the tables.
"""

from __future__ import annotations

import logging
import threading

import torch

from pagedkv.distributed.shard import Shard
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_transfer.p2p.config import P2pConfig
from pagedkv.kv_transfer.p2p.connector import LoadSpec, RemoteLoad
from pagedkv.kv_transfer.p2p.lanes import Job
from pagedkv.kv_transfer.p2p.pair_group import PairGroupError
from pagedkv.kv_transfer.p2p.peers import Peers
from pagedkv.kv_transfer.p2p.protocol import (
    MAX_COMPUTING,
    MAX_PARTS,
    Cancel,
    Done,
    Heartbeat,
    Nack,
    Want,
    XferBegin,
    XferPart,
)
from pagedkv.kv_transfer.p2p.receive_lane import Target
from pagedkv.kv_transfer.p2p.transfer import (
    LayerBlocks,
    block_bytes,
    min_run_blocks_for,
    narrow_heads,
    plan_segments,
    plan_segments_at_runs,
)
from pagedkv.kv_transfer.p2p.transfer_state import Inbound, P2pStats, Reports, TransferState
from pagedkv.transport.peer_addr import PeerAddr
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)

PENDING, RECEIVING = TransferState.PENDING, TransferState.RECEIVING
DELIVERED, REFUSED, FAILED = TransferState.DELIVERED, TransferState.REFUSED, TransferState.FAILED
#: Requests waiting for admission whose transfers the heartbeats name, at most.
MAX_QUEUED = 4096


class InboundTransfers:
    def __init__(
        self,
        config: KVTransferConfig,
        p2p: P2pConfig,
        block_size: int,
        num_blocks: int,
        peers: Peers,
        finished: Reports,
        stats: P2pStats,
        tp_size: int = 1,
        first_head: int = 0,
    ) -> None:
        self.config = config
        #: This instance's tensor-parallel size, and the checkpoint's first KV head this
        #: rank's cache holds.
        self.tp_size = tp_size
        self.first_head = first_head
        self.p2p = p2p
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.peers = peers
        self.finished = finished
        self.stats = stats
        self.kv_caches: list[torch.Tensor] = []
        self.layer_groups: list[int] = []
        self.chunk_blocks = 1
        self.min_run_blocks = 1
        self._lock = threading.Lock()
        self._by_request: dict[str, Inbound] = {}  # until reported
        self._by_tid: dict[str, Inbound] = {}  # until terminal
        #: Transfers of requests waiting for admission -> their P.
        self._queued: dict[str, PeerAddr] = {}
        self._log = RateLimitedLog(logger)

    def register(self, kv_caches: list[torch.Tensor], layer_groups: list[int], chunk_blocks: int):
        self.kv_caches, self.layer_groups, self.chunk_blocks = kv_caches, layer_groups, chunk_blocks
        largest = max((block_bytes(cache) for cache in kv_caches), default=1)
        self.min_run_blocks = min_run_blocks_for(largest, chunk_blocks)

    @property
    def num_local_heads(self) -> int:
        """The KV heads this rank's cache holds."""
        return self.kv_caches[0].shape[3] if self.kv_caches else 0

    def _kv_heads(self, spec: LoadSpec) -> Shard:
        """The checkpoint's KV heads ``spec`` loads (all this rank holds unless a piece)."""
        return spec.kv_heads or Shard(self.first_head, self.num_local_heads)

    def _num_heads(self, spec: LoadSpec) -> int:
        return self._kv_heads(spec).size

    def _plan(self, spec: LoadSpec, in_chunks: bool) -> list[list[int]]:
        """How the wanted blocks are cut into messages, per KV cache group. Over gloo, where
        D's block ids break, so that long runs are received in place; ``in_chunks`` (over
        shared memory, known once the pair is up, or for some heads of each block) every
        message is copied out of the ring or staging anyway: fewer, larger messages."""
        if in_chunks:
            return [plan_segments(len(ix), self.chunk_blocks) for ix in spec.block_indices]
        return [
            plan_segments_at_runs(
                [spec.block_ids[g][i] for i in ix], self.chunk_blocks, self.min_run_blocks
            )
            for g, ix in enumerate(spec.block_indices)
        ]

    # ------------------------------------------------------------------ engine thread
    def on_queued(self, load: RemoteLoad) -> None:
        """A request that will load from ``load.remote`` waits for admission."""
        if load.remote is None:
            return
        with self._lock:
            if len(self._queued) < MAX_QUEUED:
                self._queued[load.transfer_id] = load.remote

    def on_load(self, spec: LoadSpec) -> None:
        rec = Inbound(spec)
        with self._lock:
            self._queued.pop(spec.transfer_id, None)
            if spec.error is not None or spec.remote is None:
                self._end(rec, FAILED, "bad_params", spec.error or "no remote")
                return
            self._by_request[spec.request_id] = rec
            self._by_tid[spec.transfer_id] = rec
        try:
            group = self.peers.ensure(spec.remote)
        except PairGroupError as e:
            with self._lock:
                self._end(rec, FAILED, "pair_group", f"no pair group: {e}")
            return
        rec.group = group.name
        wire = group.wire  # None until the pair is up (a first contact): planned as for gloo
        over_shm = wire is not None and wire.kind == "shm"
        narrowed = self._num_heads(spec) != self.num_local_heads
        rec.segments = self._plan(spec, in_chunks=over_shm or narrowed)
        want = Want(
            spec.transfer_id,
            group.name,
            spec.num_prompt_tokens,
            spec.prompt_hash,
            spec.block_indices,
            rec.segments,
            tuple(self._kv_heads(spec)),
            (spec.remote_tp_size or self.tp_size, self.tp_size),
        )
        sent = self.peers.control.send(spec.remote, want)
        with self._lock:
            if not sent:
                self._end(rec, FAILED, "control", "could not send the WANT to P")
            rec.want_sent = True

    def on_cancel(self, request_id: str, reason: str) -> None:
        """The scheduler gives up on a load (the request was aborted, or is past its deadline)."""
        with self._lock:
            rec = self._by_request.get(request_id)
            if rec is not None:
                self._end(rec, FAILED, "deadline", reason)

    def on_abandon(self, load: RemoteLoad) -> None:
        """The request ended before its load started: P may free at once."""
        with self._lock:
            self._queued.pop(load.transfer_id, None)
        if load.remote is not None:
            self.peers.control.send(load.remote, Cancel(load.transfer_id, "request ended"))

    # ------------------------------------------------------------------ messages
    def on_nack(self, peer: PeerAddr, nack: Nack) -> None:
        with self._lock:
            rec = self._by_tid.get(nack.transfer_id)
            if rec is None or rec.spec.remote != peer or rec.state is not PENDING:
                return
            self._end(rec, REFUSED, "nack", f"refused by P: {nack.reason}")
        if nack.group_lost:  # P has no such group: the next load sets up a fresh one
            self.peers.lose(peer.engine_id, "P lost the pair group", rec.group)

    def on_peer_busy(self, peer: PeerAddr, transfer_ids: list[str], now: float) -> None:
        """``peer`` still computes the KV of these transfers (their request is queued or in
        prefill on P): the deadlines of our loads of them count from ``now``."""
        busy = []
        with self._lock:
            for transfer_id in transfer_ids[:MAX_COMPUTING]:
                rec = self._by_tid.get(transfer_id)
                if rec is not None and rec.spec.remote == peer and rec.state is PENDING:
                    rec.counted_from = max(rec.counted_from, now)
                    busy.append(rec.spec.request_id)
        if busy:
            self.finished.in_progress(busy)

    def on_peer_refused(self, peer: PeerAddr, reason: str) -> None:
        """Our messages can't be exchanged with ``peer`` (secret or compatibility mismatch)."""
        with self._lock:
            for rec in list(self._by_tid.values()):
                if rec.spec.remote == peer:
                    cause = reason.split(":", 1)[0]
                    self._end(rec, FAILED, cause, reason)

    def check_xfer_begin(self, begin: XferBegin) -> str | None:
        """Why a batch can't be received in step (None: it can): sizes D can't allocate."""
        if len(begin.parts) > MAX_PARTS:
            return f"{len(begin.parts)} transfers in one batch (at most {MAX_PARTS})"
        num_groups = len(self.layer_groups and set(self.layer_groups))
        for part in begin.parts:
            if not 0 <= part.num_heads <= self.num_local_heads:
                return f"transfer {part.transfer_id[:40]!r}: {part.num_heads} KV heads per block"
            if len(part.segments) != num_groups or any(
                sum(segments) > self.num_blocks or any(n < 1 for n in segments)
                for segments in part.segments
            ):
                return f"transfer {part.transfer_id[:40]!r}: segments D can't receive"
        return None

    # ------------------------------------------------------------------ receive lanes
    def _layers(
        self, ids: list[torch.Tensor], segments: list[list[int]], kv_heads: Shard
    ) -> list[LayerBlocks]:
        return [
            LayerBlocks(narrow_heads(cache, kv_heads, self.first_head), ids[g], segments[g])
            for cache, g in zip(self.kv_caches, self.layer_groups)
        ]

    def drain_layers(self, xfer: XferPart) -> list[LayerBlocks]:
        """Layers to size (never scatter) the messages of a transfer nobody here wants."""
        ids = [torch.zeros(sum(s), dtype=torch.int64) for s in xfer.segments]
        num_heads = xfer.num_heads or self.num_local_heads
        return self._layers(ids, xfer.segments, Shard(self.first_head, num_heads))

    def on_xfer_part(
        self, peer: PeerAddr, xfer: XferPart
    ) -> tuple[Target, list[LayerBlocks]] | None:
        """A batch from ``peer`` begins with this transfer: where it goes (None: drained)."""
        transfer_id = xfer.transfer_id
        with self._lock:
            rec = self._by_tid.get(transfer_id)
            if (
                rec is not None
                and rec.spec.remote == peer
                and (
                    xfer.segments != rec.segments
                    or (xfer.num_heads or self.num_local_heads) != self._num_heads(rec.spec)
                )
            ):
                self._end(rec, FAILED, "protocol", "P's messages differ from the WANT")
            if rec is None or rec.spec.remote != peer or rec.state is not PENDING:
                # Drained: P hears it was not delivered, so it frees at once.
                self.peers.control.send(peer, Done(transfer_id, False, "D does not await it"))
                return None
            rec.state = RECEIVING
            spec = rec.spec
        ids = [
            torch.tensor([spec.block_ids[g][i] for i in ix], dtype=torch.int64)
            for g, ix in enumerate(spec.block_indices)
        ]
        return rec, self._layers(ids, rec.segments, self._kv_heads(spec))

    def on_received(self, target: Target, num_bytes: int, error: Exception | None) -> None:
        assert isinstance(target, Inbound)
        rec = target
        with self._lock:
            if rec.state.is_terminal:  # ended meanwhile: reported once nothing is in flight
                with rec.lock:
                    idle = rec.posted == 0
                if idle:
                    self._report(rec)
                return
            if error is not None:
                self._end(rec, FAILED, "receive", f"receive failed: {error}")
                return
            spec = rec.spec
            self.stats.num_bytes_received += num_bytes
            self.stats.num_blocks_received += sum(len(ix) for ix in spec.block_indices)
            first = min((ix[0] for ix in spec.block_indices if ix), default=0)
            self.stats.num_tokens_received += spec.num_prompt_tokens - first * self.block_size
            self._end(rec, DELIVERED, "", f"{num_bytes} bytes")

    # ------------------------------------------------------------------ peers, clock
    def on_peer_lost(self, engine_id: str, reason: str, unstarted: list[Job]) -> None:
        with self._lock:
            for rec in list(self._by_tid.values()):
                remote = rec.spec.remote
                if remote is not None and remote.engine_id == engine_id:
                    self._end(rec, FAILED, "peer_lost", f"pair group with P gone: {reason}")

    def on_tick(self, now: float) -> None:
        """A load past its deadline ends even if the scheduler's cancel never comes."""
        limit = self.config.kv_load_timeout + max(1.0, self.p2p.heartbeat_s)
        with self._lock:
            for rec in list(self._by_tid.values()):
                if now - rec.counted_from > limit:
                    why = f"no KV within {limit:g}s (kv_load_timeout, plus a heartbeat)"
                    self._end(rec, FAILED, "deadline", why)

    def heartbeats(self) -> dict[PeerAddr, Heartbeat]:
        """Per P: the transfers D awaits (renews P's leases), then those still queued (waiting
        for admission, or their WANT not out yet: P tolerates those unknown)."""
        awaited: dict[PeerAddr, list[str]] = {}
        queued: dict[PeerAddr, list[str]] = {}
        with self._lock:
            for rec in self._by_tid.values():
                if rec.spec.remote is not None:
                    named = awaited if rec.want_sent else queued
                    named.setdefault(rec.spec.remote, []).append(rec.spec.transfer_id)
            for transfer_id, remote in self._queued.items():
                queued.setdefault(remote, []).append(transfer_id)
        return {
            peer: Heartbeat(awaited.get(peer, []), queued.get(peer, []))
            for peer in awaited.keys() | queued.keys()
        }

    @property
    def num_loads(self) -> int:
        return len(self._by_request)

    # ------------------------------------------------------------------ the one end
    def _end(self, rec: Inbound, state: TransferState, cause: str, reason: str) -> None:
        """The one terminal transition of a load (lock held): reported at once, P told."""
        if rec.state.is_terminal:
            return
        was = rec.state
        with rec.lock:  # from here on nothing more is posted or scattered into its blocks
            rec.cancelled = True
            rec.state = state
            in_flight = rec.posted > 0
        spec = rec.spec
        self.stats.loads[state.value] += 1
        where = f"from {spec.remote.engine_id} ({spec.remote.endpoint})" if spec.remote else ""
        if state is DELIVERED:
            logger.debug("load %s %s: delivered (%s)", spec.transfer_id, where, reason)
        else:
            self._log.warning(
                f"load:{cause}", "load %s %s: %s (%s)", spec.transfer_id, where, state.value, reason
            )
        if state is not DELIVERED:
            rec.failure = f"KV load {where}: {state.value}, {reason}"
        if not in_flight:  # else once the receives posted into its blocks have ended
            self._report(rec)
        if self._by_tid.get(spec.transfer_id) is rec:  # not another load's id
            del self._by_tid[spec.transfer_id]
        if spec.remote is None or state is REFUSED:
            return
        if was is PENDING:
            self.peers.control.send(spec.remote, Cancel(spec.transfer_id, reason))
        else:
            self.peers.control.send(spec.remote, Done(spec.transfer_id, state is DELIVERED, reason))

    def _report(self, rec: Inbound) -> None:
        """finished_recving, exactly once per load; a failed one's blocks are invalid."""
        if rec.reported:
            return
        rec.reported = True
        spec = rec.spec
        invalid = set()
        if rec.failure is not None:
            invalid = {spec.block_ids[g][i] for g, ix in enumerate(spec.block_indices) for i in ix}
        self.finished.recving(spec.request_id, invalid, rec.failure)
        self._by_request.pop(spec.request_id, None)
