"""P2pConnectorWorker, worker half: wires the owners to the engine's hooks.

The flow, P and D dispatched concurrently by the proxy::

  D  request arrives: named in D's heartbeats to P while it waits for admission
  D  admits it: async load of blocks [h/bs, ceil(n/bs)), failed after kv_load_timeout unless
     P keeps naming it in its heartbeats as still being computed (queued or in prefill on P)
  D  -> P  Hello(group) (first contact only) + WANT(transfer_id, group, indices, prompt hash,
           segments: how D wants the blocks cut into messages)
  P  prefills; once "KV computed" and "WANT arrived" both hold, the transfer is queued on the
     pair group's send lane, which sends XFER_BEGIN(group, tag, parts) and the blocks
  D  its receive lane scatters them into the blocks, reports finished_recving, -> P DONE(ok)
  P  reports finished_sending (its blocks are freed)

Who owns what (each with its own lock, changed only through named events):

  OutboundTransfers (outbound.py)  P's transfers: WANTs, sends, early WANTs; their records
                                   (outbound_records.py: leases, one end, tombstones)
  InboundTransfers (inbound.py)    D's loads: plans, cancels, deadlines, one report each
  Peers (peers.py)                 the control plane, pair groups, their lanes, liveness
  SendMode (send_modes.py)         PUT / PUT_ASYNC / GET: where a send reads the KV from
  SendLane / ReceiveLane (lanes.py) the data path of one pair group, one thread each way

With tensor parallelism every rank runs this worker half, a peer of its own (head_plan.py:
``kv_port + rank``); each event about a request becomes events about this rank's pieces of
it (tp_pieces.py), whose reports are joined per request before they go up.

Threads (all daemons, every wait on a peer bounded): the engine thread (these hooks), the
control plane's listener, one maintenance thread (leases, deadlines, heartbeats, liveness),
one lane thread per pair group and direction, and a short-lived one per pair group setup.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from pagedkv.distributed.shard import SINGLE_LAYOUT, Shard, TPLayout
from pagedkv.kv_connector.base import KVConnectorWorker
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer import block_copy
from pagedkv.kv_transfer.p2p.config import P2pConfig
from pagedkv.kv_transfer.p2p.connector import P2pConnectorMetadata
from pagedkv.kv_transfer.p2p.head_plan import rank_address
from pagedkv.kv_transfer.p2p.inbound import InboundTransfers
from pagedkv.kv_transfer.p2p.outbound import OutboundTransfers
from pagedkv.kv_transfer.p2p.peers import Peers
from pagedkv.kv_transfer.p2p.protocol import MESSAGE_TYPES, Cancel, Done, Heartbeat, Nack, Want
from pagedkv.kv_transfer.p2p.send_modes import SEND_MODES, SendContext
from pagedkv.kv_transfer.p2p.send_pool import SendPool
from pagedkv.kv_transfer.p2p.tp_pieces import PieceReports, TPPieces
from pagedkv.kv_transfer.p2p.transfer import block_bytes, chunk_blocks_for
from pagedkv.kv_transfer.p2p.transfer_state import Finished, P2pStats
from pagedkv.transport.codec import Codec
from pagedkv.transport.peer_addr import PeerAddr, warn_if_open

logger = logging.getLogger(__name__)


class P2pConnectorWorker(KVConnectorWorker):
    signals_progress = True

    def __init__(
        self, config, kv_cache_config, model_fingerprint: str, tp: TPLayout = SINGLE_LAYOUT
    ) -> None:
        super().__init__(config, kv_cache_config, model_fingerprint, tp)
        p2p = self.p2p_config = P2pConfig.from_kv_transfer_config(config)
        self.me = rank_address(PeerAddr(config.engine_id, config.kv_ip, config.kv_port), tp.rank)
        first_head = tp.kv_heads().start if tp.size > 1 else 0
        groups = kv_cache_config.kv_cache_groups
        block_size = groups[0].kv_cache_spec.block_size
        num_layers = sum(len(group.layer_names) for group in groups)
        self.stats = P2pStats()
        self.finished = Finished(self.notify_progress)
        self.reports = PieceReports(self.finished)
        self.pieces: TPPieces | None = None  # once the caches say how many heads they hold
        self.pool = SendPool(int(config.kv_buffer_size))
        self.send_context = SendContext(
            [], [], block_size, self.pool, p2p.transfer_timeout_s, first_head
        )
        self.mode = SEND_MODES[p2p.send_type](self.send_context)

        codec = Codec(model_fingerprint, p2p.secret_bytes, p2p.max_message_bytes, MESSAGE_TYPES)
        warn_if_open(logger, "the P2P control plane", config.kv_ip, p2p.secret_bytes)
        handlers = {
            Want: lambda peer, m: self.outbound.on_want(peer, m),
            Done: lambda peer, m: self.outbound.on_done(peer, m),
            Cancel: lambda peer, m: self.outbound.on_cancel(peer, m),
            Heartbeat: self._on_heartbeat,
            Nack: lambda peer, m: self.inbound.on_nack(peer, m),
        }
        self.peers = Peers(
            self.me, codec, p2p, handlers, num_layers, name=f"p2p[{self.me.engine_id[:12]}]"
        )
        self.outbound, self.inbound = self._owners(config, kv_cache_config, first_head)
        self._stop = threading.Event()
        self._maintenance = threading.Thread(
            target=self._maintain, name="p2p-maintenance", daemon=True
        )
        self.peers.start()
        self._maintenance.start()
        logger.info(
            "P2P connector %s (%s, %s) listening on %s",
            self.me.engine_id,
            config.kv_role,
            p2p.send_type,
            self.me.endpoint,
        )

    def _owners(
        self, config, kv_cache_config, first_head: int
    ) -> tuple[OutboundTransfers, InboundTransfers]:
        """P's and D's owners, bound to the peers (each side only where the role has it)."""
        p2p, tp = self.p2p_config, self.tp
        groups = kv_cache_config.kv_cache_groups
        block_size, num_blocks = groups[0].kv_cache_spec.block_size, kv_cache_config.num_blocks
        outbound = OutboundTransfers(
            p2p,
            config.kv_role.produces,
            block_size,
            len(groups),
            num_blocks,
            self.mode,
            self.peers,
            self.reports,
            self.stats,
            tp.size,
        )
        inbound = InboundTransfers(
            config,
            p2p,
            block_size,
            num_blocks,
            self.peers,
            self.reports,
            self.stats,
            tp.size,
            first_head,
        )
        self.peers.bind(
            outbound if config.kv_role.produces else None,
            inbound if config.kv_role.consumes else None,
        )
        return outbound, inbound

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layer_groups: list[int]) -> None:
        super().register_kv_caches(kv_caches, layer_groups)
        largest = max(block_bytes(cache) for cache in kv_caches)
        self.send_context.kv_caches = kv_caches
        self.send_context.layer_groups = layer_groups
        self.outbound.half_block_bytes = largest // 2
        self._plan_pieces(kv_caches[0].shape[3])
        chunk_blocks = chunk_blocks_for(largest, self.p2p_config.chunk_bytes)
        self.inbound.register(kv_caches, layer_groups, chunk_blocks)
        block_copy.load()  # any build happens now, not on a lane during a transfer

    def _plan_pieces(self, num_local_heads: int) -> None:
        """This rank's heads, now that its cache says how many it holds (with one rank, all
        the checkpoint's: ``tp.num_kv_heads`` may be 0)."""
        tp = self.tp
        num_kv_heads = tp.num_kv_heads or num_local_heads
        own = tp.kv_heads() if tp.size > 1 else Shard(0, num_kv_heads)
        if own.size != num_local_heads:
            raise ValueError(
                f"rank {tp.rank} of {tp.size} holds {own.size} of {num_kv_heads} KV heads, "
                f"its cache {num_local_heads}"
            )
        self.outbound.own_heads = own
        self.pieces = TPPieces(tp, num_kv_heads, own, self.reports)

    def get_kv_connector_stats(self) -> dict[str, int]:
        out = self.stats.as_dict()
        out.update(self.peers.stats())
        out["send_pool_used_bytes"] = self.pool.used_bytes
        return out

    def kv_paths(self) -> dict[str, str]:
        return self.peers.paths()

    # ================================================================== engine thread
    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, P2pConnectorMetadata):
            return
        pieces = self.pieces
        assert pieces is not None, "register_kv_caches first"
        sizes = meta.remote_tp_sizes
        arrivals = [
            arrival
            for request_id, tid in meta.arrivals
            for arrival in pieces.arrived(request_id, tid, sizes.get(tid))
        ]
        if arrivals:
            self.outbound.on_arrived(arrivals)
        for transfer_id in meta.releases:
            for tid in pieces.transfer_ids(transfer_id, sizes.get(transfer_id)):
                self.outbound.on_release(tid)
        for spec in meta.holds:
            for piece in pieces.hold(spec, sizes.get(spec.transfer_id)):
                self.outbound.on_hold(piece)
        self._start_loads(meta, pieces)
        computing = [
            piece
            for spec in meta.computing
            for piece in pieces.sends(spec, sizes.get(spec.transfer_id))
        ]
        if computing:
            self.outbound.on_computing(computing)
        departures = [rid for request_id in meta.departures for rid in pieces.departed(request_id)]
        if departures:
            self.outbound.on_departed(departures)

    def _start_loads(self, meta: P2pConnectorMetadata, pieces: TPPieces) -> None:
        """D's events, each for this rank's pieces of its request."""
        for load in meta.queued:
            for piece in pieces.remote_loads(load):
                self.inbound.on_queued(piece)
        for spec in meta.loads:
            for piece in pieces.loads(spec):
                self.inbound.on_load(piece)
        for request_id in meta.cancels:
            for piece_id in self.reports.pieces_of(request_id):
                self.inbound.on_cancel(piece_id, "cancelled (aborted, or past kv_load_timeout)")
        for load in meta.abandons:
            for piece in pieces.remote_loads(load):
                self.inbound.on_abandon(piece)

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, attn_metadata) -> None:
        self.mode.save_layer(layer_idx, kv_cache)

    def wait_for_save(self) -> None:
        self.mode.wait_for_save()

    def get_finished(self) -> KVConnectorOutput:
        return self.finished.take()

    # ================================================================== heartbeats
    def _on_heartbeat(self, peer: PeerAddr, beat: Heartbeat) -> None:
        """D's renew P's leases; P's name the transfers P still computes for D."""
        self.outbound.on_heartbeat(peer, beat)
        if beat.computing:
            self.inbound.on_peer_busy(peer, beat.computing, time.monotonic())

    def _heartbeats(self) -> dict[PeerAddr, Heartbeat]:
        """What this instance tells each peer: as D, the loads it awaits and has queued; as
        P, the transfers it still computes."""
        beats = self.inbound.heartbeats()
        for peer, beat in self.outbound.heartbeats().items():
            mine = beats.get(peer, Heartbeat())
            beats[peer] = Heartbeat(mine.transfer_ids, mine.queued, beat.computing)
        return beats

    # ================================================================== maintenance
    def _maintain(self) -> None:
        tick = min(0.1, self.p2p_config.heartbeat_s / 4)
        while not self._stop.wait(tick):
            try:
                now = time.monotonic()
                self.outbound.on_tick(now)
                for piece_id in self.reports.take_cancels():
                    self.inbound.on_cancel(piece_id, "another piece of its request failed")
                self.inbound.on_tick(now)
                self.peers.on_tick(now, self._heartbeats)
            except Exception:
                logger.exception("p2p maintenance error (continuing)")

    def shutdown(self) -> None:
        """Say goodbye to every peer (their pair groups go at once) and stop."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._maintenance.join(timeout=5)
        self.peers.close()
