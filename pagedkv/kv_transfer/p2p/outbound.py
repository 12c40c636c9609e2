"""OutboundTransfers: how P answers each event of its transfers, from the first word of one
to its end.

A record is made by whichever comes first: D's WANT (kept for a lease while P's request has
not reached its KV: "early WANTs", capped), or P's request reaching its KV. It is sent once
both hold, on the pair group's SendLane, in the way the send mode says (send_modes.py): while
the forward computes the prompt (PUT, PUT_ASYNC) or afterwards from the held blocks or the
send pool. Its lease, its one end, its tombstone and the freeing of its blocks are
OutboundRecords' (outbound_records.py).

A lease bounds how long P keeps KV nobody asks for; D's heartbeats renew it, for loads D
asked for and for requests still waiting for admission on D. The other way, P's heartbeats
name the transfers D asked for whose request is still queued or in prefill here
(``heartbeats``): D's load deadline then waits for P instead of failing a request that P was
only slow to reach.

Events: ``on_arrived``, ``on_computing``, ``on_hold``, ``on_release``, ``on_departed``
(engine thread); ``on_want``, ``on_done``, ``on_cancel``, ``on_heartbeat`` (listener);
``on_job_ended`` (send lanes); ``on_group_ready``, ``on_peer_lost`` (Peers); ``on_tick``
(maintenance: expired leases). One lock guards the records; a lane is only ever called with
it held, never the other way round.
"""

from __future__ import annotations

import logging
import threading

from pagedkv.distributed.shard import Shard
from pagedkv.kv_transfer.p2p.config import P2pConfig
from pagedkv.kv_transfer.p2p.connector import SendSpec
from pagedkv.kv_transfer.p2p.lanes import Job, LaneError, SendLane
from pagedkv.kv_transfer.p2p.outbound_records import OutboundRecords
from pagedkv.kv_transfer.p2p.peers import Peers
from pagedkv.kv_transfer.p2p.protocol import MAX_COMPUTING, Cancel, Done, Heartbeat, Nack, Want
from pagedkv.kv_transfer.p2p.send_modes import SendMode
from pagedkv.kv_transfer.p2p.transfer_state import Outbound, P2pStats, Reports, TransferState
from pagedkv.kv_transfer.p2p.want_check import (
    may_serve,
    tp_problem,
    want_problem,
    want_size_problem,
)
from pagedkv.transport.peer_addr import PeerAddr

logger = logging.getLogger(__name__)

PENDING, SENDING, SENT = TransferState.PENDING, TransferState.SENDING, TransferState.SENT
DELIVERED, REFUSED, FAILED = TransferState.DELIVERED, TransferState.REFUSED, TransferState.FAILED

#: Records made by WANTs before P's request got to its KV, at most: each holds its decoded
#: WANT for a lease, so a flood of WANTs costs bounded memory. Honest ones are bounded by the
#: loads the D instances admit (max_num_seqs each, 256 by default).
MAX_EARLY_WANTS = 4096


class OutboundTransfers:
    def __init__(
        self,
        p2p: P2pConfig,
        is_producer: bool,
        block_size: int,
        num_groups: int,
        num_blocks: int,
        mode: SendMode,
        peers: Peers,
        finished: Reports,
        stats: P2pStats,
        tp_size: int = 1,
    ) -> None:
        self.is_producer = is_producer
        self.block_size = block_size
        self.num_groups = num_groups
        self.num_blocks = num_blocks
        self.mode = mode
        self.peers = peers
        self.finished = finished
        self.stats = stats
        self.half_block_bytes = 1
        #: This instance's tensor-parallel size, and the checkpoint's KV heads this rank holds
        #: (set when the caches are registered).
        self.tp_size = tp_size
        self.own_heads = Shard(0, 0)
        self._lock = threading.Lock()
        self.records = OutboundRecords(p2p.lease_s, mode, peers, finished, stats)
        #: P's requests from their arrival until they end -> their transfer id (arrival order).
        self._in_progress: dict[str, str] = {}

    @property
    def num_records(self) -> int:
        return len(self.records)

    def ended_reason(self, transfer_id: str) -> str | None:
        """Why a transfer ended, while it is remembered."""
        return self.records.ended.reason(transfer_id)

    # ------------------------------------------------------------------ engine thread
    def on_arrived(self, arrivals: list[tuple[str, str]]) -> None:
        """These requests (request id, transfer id) arrived: their KV is being computed (they
        are queued or in prefill) until ``on_departed``."""
        with self._lock:
            self._in_progress.update(arrivals)

    def on_departed(self, request_ids: list[str]) -> None:
        """These requests ended: their transfers are no longer named as being computed."""
        with self._lock:
            for request_id in request_ids:
                self._in_progress.pop(request_id, None)

    def on_computing(self, specs: list[SendSpec]) -> None:
        """The forward about to run completes these prompts: a transfer whose WANT is here
        and whose lane is up goes out as the forward computes it (one wire batch per D)."""
        batches: dict[SendLane, list[Job]] = {}
        with self._lock:
            self.mode.begin_forward([spec.transfer_id for spec in specs])
            for spec in specs:
                if spec.transfer_id in self.records.ended:
                    continue
                rec = self.records.make(spec.transfer_id)
                rec.spec = spec
                if rec.state is not PENDING or rec.want is None or rec.peer is None:
                    continue
                lane = self.peers.send_lane(rec.peer.engine_id, rec.want.group)
                if lane is None:
                    continue  # not up yet: sent after the forward, from the held blocks
                problem = want_problem(rec, self.block_size, self.half_block_bytes, self.own_heads)
                if problem is not None:
                    self.records.end(rec, REFUSED, "bad_want", problem)
                    continue
                job = self.mode.stream(rec, self.mode.ids(rec), rec.want.segments)
                if job is not None:
                    self.stats.num_streamed_sends += 1
                    rec.state, rec.job = SENDING, job
                    batches.setdefault(lane, []).append(job)
            for lane, jobs in batches.items():
                self._submit(lane, jobs)

    def on_hold(self, spec: SendSpec) -> None:
        """The scheduler holds a finished request's blocks until ``finished_sending``."""
        with self._lock:
            why = self.ended_reason(spec.transfer_id)
            if why is not None and spec.transfer_id not in self.records:
                logger.info("transfer %s already ended (%s): freeing", spec.transfer_id, why)
                self.finished.sending(spec.request_id)
                return
            rec = self.records.make(spec.transfer_id)
            rec.spec, rec.held = spec, True
            if rec.state.is_terminal:
                self.records.retire_if_settled(rec)
                return
        problem = self.mode.prepare(rec)  # GET copies the KV: outside the lock
        with self._lock:
            if rec.state.is_terminal:  # ended meanwhile (CANCEL, lease expiry)
                self.mode.release(rec.transfer_id)
                self.records.retire_if_settled(rec)
            elif problem is not None:
                self.records.end(rec, REFUSED, "prepare", problem)
            else:
                rec.prepared = True
                if self.mode.frees_blocks_early:
                    self.records.release_blocks(rec)
                self._maybe_start(rec)

    def on_release(self, transfer_id: str) -> None:
        """P's request ended without KV to send (aborted, error): its blocks are not held."""
        why = "the prefill request ended without its KV"
        with self._lock:
            rec = self.records.get(transfer_id)
            if rec is None:
                self.records.ended.add(transfer_id, why)
                return
            rec.held = False
            if rec.state is PENDING:
                self.records.end(rec, REFUSED, "released", why)
            else:
                self.records.retire_if_settled(rec)

    # ------------------------------------------------------------------ messages from D
    def on_want(self, peer: PeerAddr, want: Want) -> None:
        with self._lock:
            why = self.ended_reason(want.transfer_id)
            if why is not None:
                self.peers.control.send(peer, Nack(want.transfer_id, why))
                return
            if not self.is_producer:
                self.peers.control.send(peer, Nack(want.transfer_id, "not a KV producer"))
                return
            mismatch = tp_problem(want, self.tp_size)
            if mismatch is not None:
                self.peers.control.send(peer, Nack(want.transfer_id, mismatch))
                return
            if not self.peers.has_group(peer.engine_id, want.group):
                why = f"refused: no pair group {want.group[:8]} with {peer.engine_id}"
                self.records.ended.add(want.transfer_id, why)
                self.peers.control.send(peer, Nack(want.transfer_id, why, group_lost=True))
                return
            rec = self.records.get(want.transfer_id)
            if rec is None:  # before P's request got to its KV: kept for a lease, so bounded
                problem = want_size_problem(want, self.num_groups, self.block_size, self.num_blocks)
                if problem is None and self._early_wants_full():
                    problem = f"{MAX_EARLY_WANTS} transfers already wait for P's KV"
                if problem is not None:
                    why = f"refused: {problem}"
                    self.records.ended.add(want.transfer_id, why)
                    self.peers.control.send(peer, Nack(want.transfer_id, why))
                    return
                rec = self.records.make(want.transfer_id)
            if rec.want is not None:
                if rec.peer != peer:
                    self.peers.control.send(peer, Nack(want.transfer_id, "claimed by another D"))
                return
            rec.want, rec.peer = want, peer
            self.records.leases.renew(want.transfer_id)
            self._maybe_start(rec)

    def on_done(self, peer: PeerAddr, done: Done) -> None:
        with self._lock:
            rec = self.records.get(done.transfer_id)
            if rec is None or rec.peer != peer:
                return
            if rec.state is SENDING:
                rec.peer_result = (done.ok, done.reason or "delivered")
            else:
                state = DELIVERED if done.ok else FAILED
                self.records.end(rec, state, "done", done.reason or "delivered")

    def on_cancel(self, peer: PeerAddr, cancel: Cancel) -> None:
        reason = f"cancelled by D: {cancel.reason}"
        with self._lock:
            rec = self.records.get(cancel.transfer_id)
            if rec is None:
                if cancel.transfer_id not in self.records.ended:
                    self.records.ended.add(cancel.transfer_id, reason)
                return
            if rec.peer is not None and rec.peer != peer:
                return
            if rec.peer is None and not may_serve(rec.spec, peer):
                return
            if rec.state is SENDING:
                rec.peer_result = (False, reason)
                lane = self.peers.send_lane(peer.engine_id, rec.want.group) if rec.want else None
                job = lane.cancel(rec.transfer_id) if lane is not None else None
                if job is not None:  # its batch had not started: it never goes out
                    job.error = LaneError(reason)
                    self._job_ended(job)
            else:
                self.records.end(rec, FAILED, "cancelled", reason)

    def on_heartbeat(self, peer: PeerAddr, heartbeat: Heartbeat) -> None:
        """From D: renew the leases it names; NACK the loads P does not hold for it."""
        with self._lock:
            for transfer_id in heartbeat.transfer_ids:
                rec = self.records.get(transfer_id)
                if rec is not None and rec.peer == peer:
                    self.records.leases.renew(transfer_id)
                else:
                    why = self.ended_reason(transfer_id) or "unknown transfer (P restarted?)"
                    self.peers.control.send(peer, Nack(transfer_id, why))
            for transfer_id in heartbeat.queued:  # not asked for yet: unknown ones are early
                rec = self.records.get(transfer_id)
                if rec is not None and rec.peer is None and may_serve(rec.spec, peer):
                    self.records.leases.renew(transfer_id)

    def heartbeats(self) -> dict[PeerAddr, Heartbeat]:
        """Per D: the transfers it asked for (WANT here, not sent yet) whose request is still
        queued or in prefill here, oldest first, at most ``MAX_COMPUTING`` (past that, the
        newest are not named: their deadline on D runs on from their last naming)."""
        named: dict[PeerAddr, list[str]] = {}
        with self._lock:
            for transfer_id in dict.fromkeys(self._in_progress.values()):
                rec = self.records.get(transfer_id)
                if rec is None or rec.peer is None or rec.state is not PENDING:
                    continue
                ids = named.setdefault(rec.peer, [])
                if len(ids) < MAX_COMPUTING:
                    ids.append(transfer_id)
        return {peer: Heartbeat(computing=ids) for peer, ids in named.items()}

    # ------------------------------------------------------------------ lanes, peers, clock
    def on_job_ended(self, job: Job) -> None:
        with self._lock:
            self._job_ended(job)

    def on_group_ready(self, engine_id: str) -> None:
        with self._lock:
            for rec in list(self.records.values()):
                if (
                    rec.state is PENDING
                    and rec.peer is not None
                    and rec.peer.engine_id == engine_id
                ):
                    self._maybe_start(rec)

    def on_peer_lost(self, engine_id: str, reason: str, unstarted: list[Job]) -> None:
        why = f"pair group with D gone: {reason}"
        with self._lock:
            for job in unstarted:  # never went out
                job.error = LaneError(why)
                self._job_ended(job)
            for rec in list(self.records.values()):
                if rec.peer is None or rec.peer.engine_id != engine_id:
                    continue
                if rec.state is SENDING:
                    rec.peer_result = (False, why)  # ended by its lane
                elif not rec.state.is_terminal:
                    self.records.end(rec, FAILED, "peer_lost", why)

    def on_tick(self, now: float) -> None:
        with self._lock:
            self.records.expire(now)

    # ------------------------------------------------------------------ internals (lock held)
    def _maybe_start(self, rec: Outbound) -> None:
        """Send the transfer once D's WANT is here, the lane is up and the KV is prepared, or
        is being computed by the forward running now (the send joins it); else this is called
        again when one of them changes."""
        if rec.state is not PENDING or rec.want is None or rec.peer is None:
            return
        if not rec.prepared and rec.spec is None:
            return
        lane = self.peers.send_lane(rec.peer.engine_id, rec.want.group)
        if lane is None:
            if not self.peers.has_group(rec.peer.engine_id, rec.want.group):
                self.records.end(rec, FAILED, "group_lost", "the pair group with D is gone")
            return  # being set up: on_group_ready
        problem = want_problem(rec, self.block_size, self.half_block_bytes, self.own_heads)
        if problem is not None:
            self.records.end(rec, REFUSED, "bad_want", problem)
            return
        try:
            if rec.prepared:
                job = self.mode.whole(rec, self.mode.ids(rec), rec.want.segments)
                self.stats.num_after_forward_sends += 1
            else:
                job = self.mode.join(rec, self.mode.ids(rec), rec.want.segments)
                if job is None:
                    return  # its forward is over: sent once the request has finished
                self.stats.num_joined_sends += 1
        except LaneError as e:
            self.records.end(rec, FAILED, "send", str(e))
            return
        rec.state, rec.job = SENDING, job
        self._submit(lane, [job])

    def _submit(self, lane: SendLane, jobs: list[Job]) -> None:
        if not lane.submit(jobs):
            for job in jobs:
                job.error = LaneError("the pair group is being torn down")
                self._job_ended(job)

    def _job_ended(self, job: Job) -> None:
        job.ended.set()
        self.mode.release(job.transfer_id)  # copies made for it are no longer read
        rec = self.records.get(job.transfer_id)
        if rec is None or rec.job is not job:
            return
        rec.job = None
        if job.error is not None and rec.peer_result is not None and not rec.peer_result[0]:
            # D had ended it (a CANCEL, a failed load) or the pair group was gone: that is
            # why the send broke, and D needs no NACK.
            self.records.end(rec, FAILED, "peer", rec.peer_result[1])
            return
        if job.error is not None:
            self.records.end(rec, FAILED, "send", f"send failed: {job.error}")
            assert rec.peer is not None
            self.peers.control.send(rec.peer, Nack(rec.transfer_id, f"send failed: {job.error}"))
            return
        assert rec.want is not None
        self.stats.num_bytes_sent += job.num_bytes
        self.stats.num_blocks_sent += sum(len(ix) for ix in rec.want.block_indices)
        if rec.peer_result is not None:
            ok, reason = rec.peer_result
            self.records.end(rec, DELIVERED if ok else FAILED, "done", reason)
        else:
            rec.state = SENT
            self.records.leases.renew(rec.transfer_id)

    def _early_wants_full(self) -> bool:
        """MAX_EARLY_WANTS records were made by WANTs before P's request got to its KV
        (counted only when there may be that many)."""
        return len(self.records) >= MAX_EARLY_WANTS and (
            sum(rec.spec is None for rec in self.records.values()) >= MAX_EARLY_WANTS
        )
