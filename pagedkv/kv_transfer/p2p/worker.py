"""P2pConnectorWorker, worker half: moves KV between this instance's paged cache and its peers.

Threads (all daemons, all waits bounded):
  engine thread   start_load_kv / save_kv_layer / wait_for_save / get_finished; PUT sends;
                  GET copies into the send pool; PUT_ASYNC gathers each layer as it is computed
  listener        the ControlPlane's ROUTER: WANT, XFER_BEGIN, DONE, NACK, CANCEL, HEARTBEAT...
  send pool       PUT_ASYNC and GET sends (``num_send_threads``)
  receive pool    D's receives and scatters (``num_recv_threads``)
  maintenance     leases (P), heartbeats and peer liveness (D), tombstones
  pair setup      one short-lived thread per pair group being created

The flow, P and D dispatched concurrently by the proxy::

  D  admits request: async load of blocks [h/bs, ceil(n/bs))
  D  -> P  Hello(group) (first contact only) + WANT(transfer_id, group, indices, prompt hash,
           segments: how D wants the blocks cut into messages)
  P  prefills; once "KV computed" and "WANT arrived" both hold:
  P  -> D  XFER_BEGIN(transfer_id, group, tag), then the blocks over gloo, per layer
  D  receives them into its blocks (in place, or staged + scattered), reports
     finished_recving, -> P  DONE(ok)
  P  reports finished_sending (its blocks are freed)

While D waits it sends HEARTBEATs (renewing P's lease; P answers). Any failure ends the load as
failed with its blocks in ``invalid_block_ids``; the scheduler applies kv_load_failure_policy.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from pagedkv.kv_cache.kv_cache_block import NULL_BLOCK_ID
from pagedkv.kv_transfer.base import KVConnectorWorker
from pagedkv.kv_transfer.p2p.config import P2pConfig
from pagedkv.kv_transfer.p2p.connector import LoadSpec, P2pConnectorMetadata, SendSpec
from pagedkv.kv_transfer.p2p.control_plane import ControlPlane
from pagedkv.kv_transfer.p2p.lease import LeaseTable
from pagedkv.kv_transfer.p2p.pair_group import PairGroup, PairGroups
from pagedkv.kv_transfer.p2p.protocol import (
    Cancel,
    Codec,
    Done,
    Heartbeat,
    Hello,
    Nack,
    PeerAddr,
    StoreSet,
    Want,
    XferBegin,
    warn_if_open,
)
from pagedkv.kv_transfer.p2p.send_pool import SendPool
from pagedkv.kv_transfer.p2p.transfer import (
    BlockSender,
    LayerBlocks,
    block_bytes,
    chunk_blocks_for,
    gather_blocks,
    plan_segments,
    receive_layers,
    runs,
)
from pagedkv.kv_transfer.p2p.transfer_state import Inbound, Outbound, P2pStats, TransferState
from pagedkv.utils import cdiv
from pagedkv.worker.model_runner_output import KVConnectorOutput

logger = logging.getLogger(__name__)

PENDING, SENDING, SENT, RECEIVING = (
    TransferState.PENDING,
    TransferState.SENDING,
    TransferState.SENT,
    TransferState.RECEIVING,
)
DELIVERED, REFUSED, FAILED, EXPIRED = (
    TransferState.DELIVERED,
    TransferState.REFUSED,
    TransferState.FAILED,
    TransferState.EXPIRED,
)


#: No single message may be larger, whatever a WANT asks for.
MAX_MESSAGE_BYTES = 256 << 20
#: Ended transfers remembered (P), oldest forgotten first: a flood of CANCELs for made-up
#: transfer ids costs bounded memory.
MAX_TOMBSTONES = 1 << 16
#: Transfers D asked for before P's request got to its KV (records without a spec), at most:
#: each holds its decoded WANT for a lease, so a flood of WANTs costs bounded memory. Honest
#: ones are bounded by the loads the D instances admit (max_num_seqs each, 256 by default).
MAX_EARLY_WANTS = 4096


class TransferError(RuntimeError):
    pass


class _Stream:
    """A transfer sent from inside the forward pass that computes its last prompt tokens."""

    def __init__(self, rec: Outbound, group: PairGroup, tag: int, src_ids: list[torch.Tensor]):
        assert rec.want is not None
        self.rec = rec
        self.group = group
        self.tag = tag
        self.src_ids = src_ids
        self.segments = rec.want.segments
        self.sender: BlockSender | None = None  # PUT: sent layer by layer on the engine thread
        self.pieces: queue.Queue[torch.Tensor] = queue.Queue()  # PUT_ASYNC: to the send pool
        self.error: Exception | None = None


class P2pConnectorWorker(KVConnectorWorker):
    def __init__(self, config, kv_cache_config, model_fingerprint: str) -> None:
        super().__init__(config, kv_cache_config, model_fingerprint)
        p2p = self.p2p_config = P2pConfig.from_kv_transfer_config(config)
        self.me = PeerAddr(config.engine_id, config.kv_ip, config.kv_port)
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self.stats = P2pStats()
        self.kv_caches: list[torch.Tensor] = []
        self.layer_groups: list[int] = []
        self._chunk_blocks = 1
        self._half_block_bytes = 1
        self._lock = threading.RLock()
        #: Set when the engine has something to do: a transfer ended, or a PUT became ready.
        self._progress = threading.Event()
        self._finished = KVConnectorOutput()
        # P
        self._outbound: dict[str, Outbound] = {}
        self._leases = LeaseTable(p2p.lease_s)
        #: Ended transfers (P) -> (why, when to forget): a late WANT/heartbeat gets a NACK.
        self._ended: dict[str, tuple[str, float]] = {}
        self._tombstone_s = max(60.0, 4 * p2p.lease_s)
        self._pool = SendPool(int(config.kv_buffer_size)) if p2p.send_type == "GET" else None
        self._streams: list[_Stream] = []
        self._put_ready: list[Outbound] = []
        self._tags = itertools.count(1)
        # D
        self._inbound: dict[str, Inbound] = {}  # by request id, until reported
        self._inbound_by_tid: dict[str, Inbound] = {}  # by transfer id, until terminal
        #: Loads cancelled before P's data began (D) -> (spec, expiry): if the data comes
        #: anyway it is drained (never scattered), which keeps the pair group in step.
        self._cancelled: dict[str, tuple[Inbound, float]] = {}
        self._last_heard: dict[str, float] = {}

        codec = Codec(model_fingerprint, p2p.secret_bytes, p2p.max_message_bytes)
        warn_if_open(logger, "the P2P control plane", config.kv_ip, p2p.secret_bytes)
        self.control = ControlPlane(
            codec,
            self.me,
            {
                Hello: self._on_hello,
                StoreSet: self._on_store_set,
                Want: self._on_want,
                XferBegin: self._on_xfer_begin,
                Done: self._on_done,
                Nack: self._on_nack,
                Cancel: self._on_cancel,
                Heartbeat: self._on_heartbeat,
            },
            name=f"p2p[{config.engine_id[:8]}]",
        )
        self.groups = PairGroups(
            self.me, self.control.send, p2p.group_setup_timeout_s, p2p.transfer_timeout_s
        )
        self._senders = ThreadPoolExecutor(p2p.num_send_threads, thread_name_prefix="p2p-send")
        self._receivers = ThreadPoolExecutor(p2p.num_recv_threads, thread_name_prefix="p2p-recv")
        self._stop = threading.Event()
        self._maintenance = threading.Thread(
            target=self._maintain, name="p2p-maintenance", daemon=True
        )
        self.control.start()
        self._maintenance.start()
        logger.info(
            "P2P connector %s (%s, %s) listening on %s",
            config.engine_id,
            config.kv_role,
            p2p.send_type,
            self.me.endpoint,
        )

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layer_groups: list[int]) -> None:
        super().register_kv_caches(kv_caches, layer_groups)
        largest = max(block_bytes(cache) for cache in kv_caches)
        self._half_block_bytes = largest // 2
        self._chunk_blocks = chunk_blocks_for(largest, self.p2p_config.chunk_bytes)

    def get_kv_connector_stats(self) -> dict[str, int]:
        out = self.stats.as_dict()
        rejected = dict(self.control.rejected)
        out["num_rejected_messages"] = sum(rejected.values())
        out.update({f"num_rejected_{reason}": n for reason, n in rejected.items()})
        out["num_evicted_peers"] = self.control.num_evicted_peers
        out["num_dropped_hellos"] = self.groups.num_dropped_hellos
        if self._pool is not None:
            out["send_pool_used_bytes"] = self._pool.used_bytes
        return out

    # ================================================================== engine thread
    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, P2pConnectorMetadata):
            return
        with self._lock:
            for transfer_id in meta.releases:
                self._on_release(transfer_id)
            to_pool = [rec for spec in meta.holds if (rec := self._on_hold(spec)) is not None]
            for spec in meta.loads:
                self._start_load(spec)
            for request_id in meta.cancels:
                self._cancel_load(request_id, "cancelled (aborted, or past kv_load_timeout)")
            for load in meta.abandons:
                assert load.remote is not None
                self.control.send(load.remote, Cancel(load.transfer_id, "request ended"))
            for spec in meta.computing:
                self._maybe_stream(spec)
            put_now, self._put_ready = self._put_ready, []
        for rec in to_pool:
            self._copy_to_pool(rec)
        for rec in put_now:
            self._send_whole(rec)

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, attn_metadata) -> None:
        if not self._streams:
            return
        group = self.layer_groups[layer_idx]
        for stream in self._streams:
            if stream.error is not None:
                continue
            layer = LayerBlocks(kv_cache, stream.src_ids[group], stream.segments[group])
            if stream.sender is None:  # PUT_ASYNC: copy now, the send pool sends
                for message in BlockSender.pack_all(layer, copy=True):
                    stream.pieces.put(message)
                continue
            try:  # PUT: this layer leaves before the forward goes on
                stream.sender.send_layer(layer)
                stream.sender.finish()
            except Exception as e:
                stream.error = e

    def wait_for_save(self) -> None:
        streams, self._streams = self._streams, []
        for stream in streams:
            if stream.sender is None:
                continue  # PUT_ASYNC: the pieces are copies; the send pool finishes the job
            if stream.error is not None:
                self._send_failed(stream.rec, stream.group, stream.error)
            else:
                self._sent(stream.rec, stream.sender.num_bytes)

    def wait_for_progress(self, timeout: float) -> None:
        self._progress.wait(timeout)
        self._progress.clear()

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            done, self._finished = self._finished, KVConnectorOutput()
        return done

    # ================================================================== P: holding and sending
    def _record(self, transfer_id: str) -> Outbound:
        """The transfer's record (lock held), created with a fresh lease."""
        rec = self._outbound.get(transfer_id)
        if rec is None:
            rec = self._outbound[transfer_id] = Outbound(transfer_id)
            self._leases.grant(transfer_id)
        return rec

    def _on_release(self, transfer_id: str) -> None:
        """P's request ended without KV to send (aborted, error): its blocks are not held."""
        rec = self._outbound.get(transfer_id)
        if rec is None:
            self._tombstone(transfer_id, "the prefill request ended without its KV")
            return
        rec.held = False
        if rec.state is PENDING:
            self._end_outbound(rec, REFUSED, "the prefill request ended without its KV")
        else:
            self._retire_if_settled(rec)

    def _on_hold(self, spec: SendSpec) -> Outbound | None:
        """The scheduler holds a finished request's blocks; returns it if it must be pooled."""
        tombstone = self._ended.get(spec.transfer_id)
        if tombstone is not None and spec.transfer_id not in self._outbound:
            logger.info("transfer %s already ended (%s): freeing", spec.transfer_id, tombstone[0])
            self._finished.finished_sending.add(spec.request_id)
            self._progress.set()
            return None
        rec = self._record(spec.transfer_id)
        rec.spec, rec.held = spec, True
        if rec.state.is_terminal:
            self._retire_if_settled(rec)
        elif self._pool is not None:
            return rec
        else:
            self._maybe_start(rec)
        return None

    def _maybe_stream(self, spec: SendSpec) -> None:
        """PUT/PUT_ASYNC: the forward about to run completes this request's prompt; if D's WANT
        is here and the pair group is up, send each layer as soon as the forward writes it."""
        if self._pool is not None or spec.transfer_id in self._ended:
            return
        rec = self._record(spec.transfer_id)
        rec.spec = spec
        if rec.state is not PENDING or rec.want is None or rec.peer is None:
            return
        group = self.groups.get(rec.peer.engine_id)
        if group is None or group.name != rec.want.group or group.pg is None:
            return  # not ready yet: sent after the forward, from the held blocks
        problem = self._want_problem(rec)
        if problem is not None:
            self._end_outbound(rec, REFUSED, problem)
            return
        rec.state = SENDING
        stream = _Stream(rec, group, self._next_tag(), self._source_ids(rec))
        self.control.send(rec.peer, XferBegin(rec.transfer_id, group.name, stream.tag))
        if self.p2p_config.send_type == "PUT":
            stream.sender = self._block_sender(group, stream.tag)
        else:
            self._senders.submit(self._send_stream, stream)
        self._streams.append(stream)

    def _maybe_start(self, rec: Outbound) -> None:
        """Start a whole-transfer send once both the KV and D's WANT are here (lock held)."""
        if rec.state is not PENDING or rec.want is None:
            return
        if not (rec.pooled if self._pool is not None else rec.held):
            return
        problem = self._want_problem(rec)
        if problem is not None:
            self._end_outbound(rec, REFUSED, problem)
            return
        rec.state = SENDING
        if self.p2p_config.send_type == "PUT":
            self._put_ready.append(rec)  # sent synchronously at the start of the next step
            self._progress.set()
        else:
            self._senders.submit(self._send_whole, rec)

    def _want_problem(self, rec: Outbound) -> str | None:
        """Why D's WANT can't be served from this KV (None: it can)."""
        want, spec = rec.want, rec.spec
        assert want is not None and spec is not None
        if spec.expected_peer is not None and rec.peer.engine_id != spec.expected_peer:
            return f"transfer is for {spec.expected_peer}, not {rec.peer.engine_id}"
        if want.num_prompt_tokens != spec.num_prompt_tokens or want.prompt_hash != spec.prompt_hash:
            return "prompt mismatch: P and D hold different prompts for this transfer"
        if len(want.block_indices) != len(spec.block_ids):
            return "KV cache group count mismatch"
        num_prompt_blocks = cdiv(spec.num_prompt_tokens, self.block_size)
        for indices, ids in zip(want.block_indices, spec.block_ids):
            limit = min(len(ids), num_prompt_blocks)
            if any(not 0 <= i < limit or ids[i] == NULL_BLOCK_ID for i in indices):
                return "WANT names blocks outside the prompt or skipped by P's window"
        if len(want.segments) != len(want.block_indices) or any(
            sum(segments) != len(indices)
            or any(not 0 < n <= MAX_MESSAGE_BYTES // self._half_block_bytes for n in segments)
            for segments, indices in zip(want.segments, want.block_indices)
        ):
            return "WANT's message segments do not cut its blocks into sane messages"
        return None

    def _source_ids(self, rec: Outbound) -> list[torch.Tensor]:
        """Per group, where the wanted blocks are on P: block ids in the paged cache, or
        block-table positions in a pooled copy."""
        assert rec.want is not None and rec.spec is not None
        if rec.pooled:
            return [torch.tensor(ix, dtype=torch.int64) for ix in rec.want.block_indices]
        return [
            torch.tensor([ids[i] for i in ix], dtype=torch.int64)
            for ix, ids in zip(rec.want.block_indices, rec.spec.block_ids)
        ]

    def _next_tag(self) -> int:
        return next(self._tags) % (1 << 30) + 1

    def _block_sender(self, group: PairGroup, tag: int) -> BlockSender:
        assert group.pg is not None
        p2p = self.p2p_config
        return BlockSender(
            group.pg, group.peer_rank, tag, p2p.in_flight_bytes, p2p.transfer_timeout_s
        )

    def _ready_group(self, rec: Outbound) -> PairGroup:
        assert rec.want is not None and rec.peer is not None
        group = self.groups.get(rec.peer.engine_id)
        if group is None or group.name != rec.want.group:
            raise TransferError(f"pair group {rec.want.group[:8]} with {rec.peer} is gone")
        group.wait(self.p2p_config.group_setup_timeout_s)
        return group

    def _send_whole(self, rec: Outbound) -> None:
        """Send a whole transfer from held blocks (PUT, PUT_ASYNC) or the pool (GET)."""
        group = None
        try:
            group = self._ready_group(rec)
            sources = self.kv_caches
            if rec.pooled:
                assert self._pool is not None
                entry = self._pool.get(rec.transfer_id)
                if entry is None:
                    raise TransferError("pool entry is gone")
                sources = entry.layers
            src_ids = self._source_ids(rec)
            tag = self._next_tag()
            assert rec.peer is not None and rec.want is not None
            self.control.send(rec.peer, XferBegin(rec.transfer_id, group.name, tag))
            sender = self._block_sender(group, tag)
            for layer, source in enumerate(sources):  # held blocks or the pool: they stay put
                g = self.layer_groups[layer]
                sender.send_layer(LayerBlocks(source, src_ids[g], rec.want.segments[g]))
            sender.finish()
        except Exception as e:
            self._send_failed(rec, group, e)
            return
        self._sent(rec, sender.num_bytes)

    def _send_stream(self, stream: _Stream) -> None:
        """PUT_ASYNC: send the pieces ``save_kv_layer`` queues, as the forward produces them."""
        rec = stream.rec
        try:  # on the send pool, whose Future swallows exceptions: every error ends the send
            sender = self._block_sender(stream.group, stream.tag)
            num_messages = sum(2 * len(stream.segments[g]) for g in self.layer_groups)
            for _ in range(num_messages):
                sender.send(stream.pieces.get(timeout=self.p2p_config.transfer_timeout_s))
            sender.finish()
        except Exception as e:
            self._send_failed(rec, stream.group, e)
            return
        self._sent(rec, sender.num_bytes)

    def _sent(self, rec: Outbound, num_bytes: int) -> None:
        with self._lock:
            self.stats.num_bytes_sent += num_bytes
            assert rec.want is not None
            self.stats.num_blocks_sent += sum(len(ix) for ix in rec.want.block_indices)
            if rec.peer_result is not None:
                ok, reason = rec.peer_result
                self._end_outbound(rec, DELIVERED if ok else FAILED, reason)
            elif not rec.state.is_terminal:
                rec.state = SENT
                self._leases.renew(rec.transfer_id)

    def _send_failed(self, rec: Outbound, group: PairGroup | None, error: Exception) -> None:
        """D hears a NACK (group lost: the group is dropped here). A D already receiving
        ignores it (its receive fails with the group); a D still waiting for XFER_BEGIN (it
        never came, or was lost) ends the load and sets up a fresh group for the next."""
        reason = f"send failed: {error}"
        with self._lock:
            self._end_outbound(rec, FAILED, reason)
            if rec.peer is not None:
                self.control.send(rec.peer, Nack(rec.transfer_id, reason, group_lost=True))
        if group is not None:
            self.groups.drop(group.peer.engine_id, reason, group.name)

    def _copy_to_pool(self, rec: Outbound) -> None:
        """GET: copy the request's prompt blocks into the send pool, then free them."""
        assert self._pool is not None and rec.spec is not None
        num_blocks = cdiv(rec.spec.num_prompt_tokens, self.block_size)
        ids = [torch.tensor(b[:num_blocks], dtype=torch.int64) for b in rec.spec.block_ids]
        num_bytes = sum(
            block_bytes(cache) * len(ids[self.layer_groups[layer]])
            for layer, cache in enumerate(self.kv_caches)
        )
        if not self._pool.reserve(rec.transfer_id, num_bytes):
            with self._lock:
                self._end_outbound(
                    rec,
                    REFUSED,
                    f"send pool full ({self._pool.used_bytes} of {self._pool.capacity_bytes} "
                    f"bytes used, {num_bytes} needed)",
                )
            return
        copies = [
            gather_blocks(cache, ids[self.layer_groups[layer]])
            for layer, cache in enumerate(self.kv_caches)
        ]
        if not self._pool.fill(rec.transfer_id, copies):
            return  # ended meanwhile (CANCEL, lease expiry): that freed its room and its blocks
        with self._lock:
            if rec.state.is_terminal:  # cancelled meanwhile
                self._pool.pop(rec.transfer_id)
                return
            rec.pooled = True
            self._release_blocks(rec)
            self._maybe_start(rec)

    def _release_blocks(self, rec: Outbound) -> None:
        if rec.held and not rec.released:
            assert rec.spec is not None
            self._finished.finished_sending.add(rec.spec.request_id)
            self._progress.set()
            rec.released = True

    def _end_outbound(self, rec: Outbound, state: TransferState, reason: str) -> None:
        """The one terminal transition of a send (lock held)."""
        if rec.state.is_terminal:
            return
        rec.state = state
        self.stats.sends[state.value] += 1
        log = logger.info if state is DELIVERED else logger.warning
        log("transfer %s to %s: %s (%s)", rec.transfer_id, rec.peer, state.value, reason)
        if state in (REFUSED, EXPIRED) and rec.peer is not None:
            self.control.send(rec.peer, Nack(rec.transfer_id, f"{state.value}: {reason}"))
        self._tombstone(rec.transfer_id, f"{state.value}: {reason}")
        if self._pool is not None:
            self._pool.pop(rec.transfer_id)
        self._retire_if_settled(rec)

    def _retire_if_settled(self, rec: Outbound) -> None:
        """Forget a terminal transfer once the scheduler's hold decision is known; free its
        blocks if held. A record that never saw its KV has nothing held: it goes at once."""
        if not rec.state.is_terminal or (rec.spec is not None and rec.held is None):
            return
        self._release_blocks(rec)
        self._outbound.pop(rec.transfer_id, None)
        self._leases.release(rec.transfer_id)

    def _tombstone(self, transfer_id: str, why: str) -> None:
        if transfer_id not in self._ended and len(self._ended) >= MAX_TOMBSTONES:
            del self._ended[next(iter(self._ended))]  # the oldest
        self._ended[transfer_id] = (why, time.monotonic() + self._tombstone_s)

    # ================================================================== P: messages from D
    def _on_want(self, peer: PeerAddr, want: Want) -> None:
        self._heard(peer)
        with self._lock:
            tombstone = self._ended.get(want.transfer_id)
            if tombstone is not None:
                self.control.send(peer, Nack(want.transfer_id, tombstone[0]))
                return
            if not self.config.is_kv_producer:
                self.control.send(peer, Nack(want.transfer_id, "not a KV producer"))
                return
            group = self.groups.get(peer.engine_id)
            if group is None or group.name != want.group:
                why = f"refused: no pair group {want.group[:8]} with {peer.engine_id}"
                self._tombstone(want.transfer_id, why)
                self.control.send(peer, Nack(want.transfer_id, why, group_lost=True))
                return
            rec = self._outbound.get(want.transfer_id)
            if rec is None:  # before P's request got to its KV: kept for a lease, so bounded
                problem = self._want_size_problem(want)
                if problem is None and self._early_wants_full():
                    problem = f"{MAX_EARLY_WANTS} transfers already wait for P's KV"
                if problem is not None:
                    why = f"refused: {problem}"
                    self._tombstone(want.transfer_id, why)
                    self.control.send(peer, Nack(want.transfer_id, why))
                    return
                rec = self._record(want.transfer_id)
            if rec.want is not None:
                if rec.peer != peer:
                    self.control.send(peer, Nack(want.transfer_id, "claimed by another D"))
                return
            rec.want, rec.peer = want, peer
            self._leases.renew(want.transfer_id)
            self._maybe_start(rec)

    def _want_size_problem(self, want: Want) -> str | None:
        """Why a WANT is too big to be any request's (None: it may be one), checked before a
        record keeps it; what it asks for is checked against the KV by ``_want_problem``."""
        if len(want.block_indices) != self.num_groups or len(want.segments) != self.num_groups:
            return "KV cache group count mismatch"
        most = min(cdiv(want.num_prompt_tokens, self.block_size), self.kv_cache_config.num_blocks)
        if any(
            len(indices) > most or len(segments) > len(indices)
            for indices, segments in zip(want.block_indices, want.segments)
        ):
            return "WANT names more blocks than its prompt has"
        return None

    def _early_wants_full(self) -> bool:
        """MAX_EARLY_WANTS records were made by WANTs before P's request got to its KV (lock
        held; counted only when there may be that many)."""
        return len(self._outbound) >= MAX_EARLY_WANTS and (
            sum(rec.spec is None for rec in self._outbound.values()) >= MAX_EARLY_WANTS
        )

    def _on_done(self, peer: PeerAddr, done: Done) -> None:
        self._heard(peer)
        with self._lock:
            rec = self._outbound.get(done.transfer_id)
            if rec is None or rec.peer != peer:
                return
            if rec.state is SENDING:
                rec.peer_result = (done.ok, done.reason or "delivered")
            else:
                self._end_outbound(
                    rec, DELIVERED if done.ok else FAILED, done.reason or "delivered"
                )

    def _on_cancel(self, peer: PeerAddr, cancel: Cancel) -> None:
        self._heard(peer)
        reason = f"cancelled by D: {cancel.reason}"
        with self._lock:
            rec = self._outbound.get(cancel.transfer_id)
            if rec is None:
                if cancel.transfer_id not in self._ended:
                    self._tombstone(cancel.transfer_id, reason)
                return
            if rec.peer is not None and rec.peer != peer:
                return
            if (
                rec.peer is None
                and rec.spec is not None
                and rec.spec.expected_peer
                not in (
                    None,
                    peer.engine_id,
                )
            ):
                return
            if rec.state is SENDING:
                rec.peer_result = (False, reason)
            else:
                self._end_outbound(rec, FAILED, reason)

    # ================================================================== D: loading
    def _start_load(self, spec: LoadSpec) -> None:
        rec = Inbound(spec)
        if spec.error is not None or spec.remote is None:
            self._end_inbound(rec, FAILED, spec.error or "no remote")
            return
        self._inbound[spec.request_id] = rec
        self._inbound_by_tid[spec.transfer_id] = rec
        try:
            group = self.groups.ensure(spec.remote)
        except Exception as e:
            self._end_inbound(rec, FAILED, f"pair group: {e}")
            return
        rec.group = group.name
        rec.direct, rec.segments = self._plan(spec)
        self.control.send(
            spec.remote,
            Want(
                spec.transfer_id,
                group.name,
                spec.num_prompt_tokens,
                spec.prompt_hash,
                spec.block_indices,
                rec.segments,
            ),
        )

    def _plan(self, spec: LoadSpec) -> tuple[bool, list[list[int]]]:
        """Direct (into runs of D's blocks) when runs are long enough, else staged."""
        targets = [[spec.block_ids[g][i] for i in ix] for g, ix in enumerate(spec.block_indices)]
        lengths = [n for ids in targets for n in runs(ids)]
        mean_run = sum(lengths) / len(lengths) if lengths else 0
        message_blocks = min(mean_run, self._chunk_blocks)
        direct = message_blocks * self._half_block_bytes >= self.p2p_config.direct_min_bytes
        return direct, [plan_segments(ids, self._chunk_blocks, direct) for ids in targets]

    def _cancel_load(self, request_id: str, reason: str) -> None:
        rec = self._inbound.get(request_id)
        if rec is None:
            return  # already ended (its finished_recving is on its way)
        if rec.state is PENDING:
            self._end_inbound(rec, FAILED, reason)
        elif rec.state is RECEIVING:
            with rec.lock:  # nothing more is posted into or scattered into its blocks
                rec.cancelled = True
            # Reported when _receive returns: receives already posted may still land.

    def _report_load(self, rec: Inbound, ok: bool, reason: str) -> None:
        """finished_recving, exactly once per load; failed blocks go to invalid_block_ids."""
        if rec.reported:
            return
        rec.reported = True
        spec = rec.spec
        self._finished.finished_recving.add(spec.request_id)
        self._progress.set()
        if not ok:
            remote = spec.remote
            peer = (
                "no peer"
                if remote is None
                else f"{remote.engine_id} at {remote.host}:{remote.port}"
            )
            self._finished.load_errors[spec.request_id] = f"from {peer}: {reason}"
            self._finished.invalid_block_ids.update(
                spec.block_ids[g][i] for g, ix in enumerate(spec.block_indices) for i in ix
            )
        self._inbound.pop(spec.request_id, None)

    def _end_inbound(self, rec: Inbound, state: TransferState, reason: str) -> None:
        """The one terminal transition of a load (lock held); tells P how it ended."""
        if rec.state.is_terminal:
            return
        was = rec.state
        rec.state = state
        spec = rec.spec
        self.stats.loads[state.value] += 1
        log = logger.info if state is DELIVERED else logger.warning
        log("transfer %s from %s: %s (%s)", spec.transfer_id, spec.remote, state.value, reason)
        self._report_load(rec, state is DELIVERED, f"{state.value}: {reason}")
        if self._inbound_by_tid.get(spec.transfer_id) is rec:  # not another load's id
            del self._inbound_by_tid[spec.transfer_id]
        if was is PENDING and rec.segments:
            # Ended before its data began (cancelled, refused, P silent): if P sends it anyway
            # (its WANT came late, or crossed our CANCEL), it is drained, never stored, so
            # P's send ends at once instead of stalling for transfer_timeout_s.
            self._cancelled[spec.transfer_id] = (rec, time.monotonic() + 60)
        if spec.remote is None or state is REFUSED:
            return
        if was is PENDING:
            self.control.send(spec.remote, Cancel(spec.transfer_id, reason))
        else:
            self.control.send(spec.remote, Done(spec.transfer_id, state is DELIVERED, reason))

    def _on_xfer_begin(self, peer: PeerAddr, begin: XferBegin) -> None:
        self._heard(peer)
        with self._lock:
            rec = self._inbound_by_tid.get(begin.transfer_id)
            if rec is None:
                cancelled, _ = self._cancelled.pop(begin.transfer_id, (None, 0.0))
                if cancelled is not None and cancelled.spec.remote == peer:
                    cancelled.cancelled = True  # drained into staging, never into blocks
                    self._receivers.submit(self._receive, cancelled, begin)
                else:
                    logger.warning("data for unknown transfer %s from %s", begin.transfer_id, peer)
                return
            if rec.spec.remote != peer or rec.state is not PENDING:
                logger.warning("unexpected XFER_BEGIN for %s from %s", begin.transfer_id, peer)
                return
            rec.state = RECEIVING
            self._receivers.submit(self._receive, rec, begin)

    def _receive(self, rec: Inbound, begin: XferBegin) -> None:
        """On the receive pool, whose Future swallows exceptions: every error ends the load."""
        spec = rec.spec
        assert spec.remote is not None
        p2p = self.p2p_config
        with self._lock:  # a load cancelled before its data began is drained, never stored
            draining = self._inbound_by_tid.get(spec.transfer_id) is not rec
        num_bytes, error = 0, None
        try:
            targets = self._target_ids(spec)
            layers = [
                LayerBlocks(cache, targets[g], rec.segments[g])
                for cache, g in zip(self.kv_caches, self.layer_groups)
            ]
            group = self.groups.get(spec.remote.engine_id)
            if group is None or group.name != begin.group:
                raise TransferError(f"pair group {begin.group[:8]} is gone")
            pg = group.wait(p2p.group_setup_timeout_s)
            num_bytes = receive_layers(
                pg,
                group.peer_rank,
                begin.tag,
                layers,
                rec.direct,
                p2p.in_flight_bytes,
                p2p.transfer_timeout_s,
                rec,
                # Not past the scheduler's deadline for this load (it started then, too).
                deadline=None if draining else rec.started + self.config.kv_load_timeout,
            )
        except Exception as e:
            error = e
            self.groups.drop(spec.remote.engine_id, f"receive failed: {e}", begin.group)
        with self._lock:
            if draining:
                self.control.send(spec.remote, Done(spec.transfer_id, False, "cancelled"))
            elif rec.cancelled:
                self._end_inbound(rec, FAILED, "cancelled while receiving (drained)")
            elif error is not None:
                self._end_inbound(rec, FAILED, f"receive failed: {error}")
            else:
                self.stats.num_bytes_received += num_bytes
                self.stats.num_blocks_received += sum(len(ix) for ix in spec.block_indices)
                self._end_inbound(rec, DELIVERED, f"{num_bytes} bytes")

    @staticmethod
    def _target_ids(spec: LoadSpec) -> list[torch.Tensor]:
        """Per group, D's blocks in wire order."""
        return [
            torch.tensor([spec.block_ids[g][i] for i in ix], dtype=torch.int64)
            for g, ix in enumerate(spec.block_indices)
        ]

    def _on_nack(self, peer: PeerAddr, nack: Nack) -> None:
        self._heard(peer)
        with self._lock:
            rec = self._inbound_by_tid.get(nack.transfer_id)
            if rec is None or rec.spec.remote != peer or rec.state is not PENDING:
                return
            self._end_inbound(rec, REFUSED, nack.reason)
        if nack.group_lost:  # the next load to this P sets up a fresh group
            self.groups.drop(peer.engine_id, "P lost the pair group", rec.group)

    # ================================================================== both: groups, liveness
    def _on_hello(self, peer: PeerAddr, hello: Hello) -> None:
        self._heard(peer)
        self.groups.on_hello(peer, hello)

    def _on_store_set(self, peer: PeerAddr, message: StoreSet) -> None:
        self._heard(peer)
        self.groups.on_store_set(peer, message)

    def _on_heartbeat(self, peer: PeerAddr, heartbeat: Heartbeat) -> None:
        """From D: renew these leases (NACK the ones P no longer has) and answer."""
        self._heard(peer)
        if not heartbeat.transfer_ids:
            return
        with self._lock:
            for transfer_id in heartbeat.transfer_ids:
                rec = self._outbound.get(transfer_id)
                if rec is not None and rec.peer == peer:
                    self._leases.renew(transfer_id)
                else:
                    why = self._ended.get(transfer_id, ("unknown transfer (P restarted?)",))[0]
                    self.control.send(peer, Nack(transfer_id, why))
        self.control.send(peer, Heartbeat())

    def _heard(self, peer: PeerAddr) -> None:
        self._last_heard[peer.engine_id] = time.monotonic()

    def _maintain(self) -> None:
        p2p = self.p2p_config
        tick = min(0.1, p2p.heartbeat_s / 4)
        next_heartbeat = 0.0
        while not self._stop.wait(tick):
            try:
                now = time.monotonic()
                with self._lock:
                    self._expire_leases(now)
                    self._check_peers(now)
                    self._forget_old(now)
                    beats = self._heartbeats() if now >= next_heartbeat else {}
                if beats:
                    next_heartbeat = now + p2p.heartbeat_s
                for peer, transfer_ids in beats.items():
                    self.control.send(peer, Heartbeat(transfer_ids))
            except Exception:
                logger.exception("p2p maintenance error (continuing)")

    def _expire_leases(self, now: float) -> None:
        """P: end overdue transfers; a D none of whose transfers is left lost its group."""
        silent: dict[str, PeerAddr] = {}
        for transfer_id in self._leases.expired(now):
            rec = self._outbound.get(transfer_id)
            if rec is None:
                self._leases.release(transfer_id)
            elif rec.state in (PENDING, SENT):
                self._end_outbound(rec, EXPIRED, f"no word from D in {self._leases.lease_s}s")
                if rec.peer is not None:
                    silent[rec.peer.engine_id] = rec.peer
        busy = {rec.peer.engine_id for rec in self._outbound.values() if rec.peer is not None}
        for engine_id, peer in silent.items():
            if engine_id not in busy:
                self.groups.drop(engine_id, "missed heartbeats")
                self.control.forget(peer)

    def _check_peers(self, now: float) -> None:
        """D: fail the loads of a P that stopped answering, and tear its group down."""
        silent: dict[str, PeerAddr] = {}
        for rec in list(self._inbound_by_tid.values()):
            remote = rec.spec.remote
            assert remote is not None
            last_heard = max(self._last_heard.get(remote.engine_id, 0.0), rec.started)
            if now - last_heard > self.p2p_config.peer_timeout_s:
                silent[remote.engine_id] = remote
                reason = f"P {remote.engine_id} silent for {self.p2p_config.peer_timeout_s}s"
                if rec.state is PENDING:
                    self._end_inbound(rec, FAILED, reason)
                else:  # its receive fails with the group (dropped below) and reports
                    with rec.lock:
                        rec.cancelled = True
        for engine_id, peer in silent.items():
            self.groups.drop(engine_id, "peer silent")
            self.control.forget(peer)
            self._last_heard.pop(engine_id, None)

    def _forget_old(self, now: float) -> None:
        for table in (self._ended, self._cancelled):
            for key in [k for k, (_, expiry) in table.items() if expiry < now]:
                del table[key]
        # Senders long silent: only pending loads read these (and bound them by their start).
        # list() copies in one C call: safe while the listener thread adds entries.
        horizon = now - max(60.0, 4 * self.p2p_config.peer_timeout_s)
        for engine_id, heard in list(self._last_heard.items()):
            if heard < horizon:
                self._last_heard.pop(engine_id, None)

    def _heartbeats(self) -> dict[PeerAddr, list[str]]:
        """D: per P, the transfers still awaited (renews P's leases; P's answer = liveness)."""
        beats: dict[PeerAddr, list[str]] = {}
        for rec in self._inbound_by_tid.values():
            if not rec.cancelled and rec.spec.remote is not None:
                beats.setdefault(rec.spec.remote, []).append(rec.spec.transfer_id)
        return beats

    # ================================================================== shutdown
    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._maintenance.join(timeout=5)
        self.control.close()
        self.groups.close()
        self._senders.shutdown(wait=False, cancel_futures=True)
        self._receivers.shutdown(wait=False, cancel_futures=True)
