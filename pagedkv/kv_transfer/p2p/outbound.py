"""OutboundTransfers: P's transfers, from the first word of one to its blocks being freed.

A record is made by whichever comes first: D's WANT (kept for a lease while P's request has
not reached its KV: "early WANTs", capped), or P's request reaching its KV. It is sent once
both hold, on the pair group's SendLane, in the way the send mode says (send_modes.py): while
the forward computes the prompt (PUT, PUT_ASYNC) or afterwards from the held blocks or the
send pool. It ends exactly once (transfer_state.py) and its blocks are freed
(``finished_sending``) once it has ended and the scheduler has said it holds them. Ended
transfers are remembered for a while (tombstones.py): a late WANT, CANCEL or heartbeat for
one gets the right answer.

A lease bounds how long P keeps KV nobody asks for; D's heartbeats renew it, for loads D
asked for and for requests still waiting for admission on D. The other way, P's heartbeats
name the transfers D asked for whose request is still queued or in prefill here
(``heartbeats``): D's load deadline then waits for P instead of failing a request that P was
only slow to reach.

Events: ``on_arrived``, ``on_computing``, ``on_hold``, ``on_release``, ``on_departed``
(engine thread); ``on_want``,
``on_done``, ``on_cancel``, ``on_heartbeat`` (listener); ``on_job_ended`` (send lanes);
``on_group_ready``, ``on_peer_lost`` (Peers); ``on_tick`` (maintenance: expired leases). One
lock guards the tables; a lane is only ever called with it held, never the other way round.
"""

from __future__ import annotations

import logging
import threading

from pagedkv.kv_transfer.p2p.config import P2pConfig
from pagedkv.kv_transfer.p2p.connector import SendSpec
from pagedkv.kv_transfer.p2p.lanes import Job, LaneError, SendLane
from pagedkv.kv_transfer.p2p.lease import LeaseTable
from pagedkv.kv_transfer.p2p.peers import Peers
from pagedkv.kv_transfer.p2p.protocol import MAX_COMPUTING, Cancel, Done, Heartbeat, Nack, Want
from pagedkv.kv_transfer.p2p.send_modes import SendMode
from pagedkv.kv_transfer.p2p.tombstones import Tombstones
from pagedkv.kv_transfer.p2p.transfer_state import Finished, Outbound, P2pStats, TransferState
from pagedkv.kv_transfer.p2p.want_check import want_problem, want_size_problem
from pagedkv.transport.peer_addr import PeerAddr
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)

PENDING, SENDING, SENT = TransferState.PENDING, TransferState.SENDING, TransferState.SENT
DELIVERED, REFUSED = TransferState.DELIVERED, TransferState.REFUSED
FAILED, EXPIRED = TransferState.FAILED, TransferState.EXPIRED

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
        finished: Finished,
        stats: P2pStats,
    ) -> None:
        self.p2p = p2p
        self.is_producer = is_producer
        self.block_size = block_size
        self.num_groups = num_groups
        self.num_blocks = num_blocks
        self.mode = mode
        self.peers = peers
        self.finished = finished
        self.stats = stats
        self.half_block_bytes = 1
        self._lock = threading.Lock()
        self._records: dict[str, Outbound] = {}
        self._leases = LeaseTable(p2p.lease_s)
        self._ended = Tombstones(keep_s=max(60.0, 4 * p2p.lease_s))
        #: P's requests from their arrival until they end -> their transfer id (arrival order).
        self._in_progress: dict[str, str] = {}
        self._log = RateLimitedLog(logger)

    @property
    def num_records(self) -> int:
        return len(self._records)

    def ended_reason(self, transfer_id: str) -> str | None:
        """Why a transfer ended, while it is remembered."""
        return self._ended.reason(transfer_id)

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
            for spec in specs:
                if spec.transfer_id in self._ended:
                    continue
                rec = self._record(spec.transfer_id)
                rec.spec = spec
                if rec.state is not PENDING or rec.want is None or rec.peer is None:
                    continue
                lane = self.peers.send_lane(rec.peer.engine_id, rec.want.group)
                if lane is None:
                    continue  # not up yet: sent after the forward, from the held blocks
                problem = self._serve_problem(rec)
                if problem is not None:
                    self._end(rec, REFUSED, "bad_want", problem)
                    continue
                job = self.mode.stream(rec, self.mode.ids(rec), rec.want.segments)
                if job is not None:
                    rec.state, rec.job = SENDING, job
                    batches.setdefault(lane, []).append(job)
            for lane, jobs in batches.items():
                self._submit(lane, jobs)

    def on_hold(self, spec: SendSpec) -> None:
        """The scheduler holds a finished request's blocks until ``finished_sending``."""
        with self._lock:
            if spec.transfer_id in self._ended and spec.transfer_id not in self._records:
                why = self._ended.reason(spec.transfer_id)
                logger.info("transfer %s already ended (%s): freeing", spec.transfer_id, why)
                self.finished.sending(spec.request_id)
                return
            rec = self._record(spec.transfer_id)
            rec.spec, rec.held = spec, True
            if rec.state.is_terminal:
                self._retire_if_settled(rec)
                return
        problem = self.mode.prepare(rec)  # GET copies the KV: outside the lock
        with self._lock:
            if rec.state.is_terminal:  # ended meanwhile (CANCEL, lease expiry)
                self.mode.release(rec.transfer_id)
                self._retire_if_settled(rec)
            elif problem is not None:
                self._end(rec, REFUSED, "prepare", problem)
            else:
                rec.prepared = True
                if self.mode.frees_blocks_early:
                    self._release_blocks(rec)
                self._maybe_start(rec)

    def on_release(self, transfer_id: str) -> None:
        """P's request ended without KV to send (aborted, error): its blocks are not held."""
        why = "the prefill request ended without its KV"
        with self._lock:
            rec = self._records.get(transfer_id)
            if rec is None:
                self._ended.add(transfer_id, why)
                return
            rec.held = False
            if rec.state is PENDING:
                self._end(rec, REFUSED, "released", why)
            else:
                self._retire_if_settled(rec)

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
            if not self.peers.has_group(peer.engine_id, want.group):
                why = f"refused: no pair group {want.group[:8]} with {peer.engine_id}"
                self._ended.add(want.transfer_id, why)
                self.peers.control.send(peer, Nack(want.transfer_id, why, group_lost=True))
                return
            rec = self._records.get(want.transfer_id)
            if rec is None:  # before P's request got to its KV: kept for a lease, so bounded
                problem = want_size_problem(want, self.num_groups, self.block_size, self.num_blocks)
                if problem is None and self._early_wants_full():
                    problem = f"{MAX_EARLY_WANTS} transfers already wait for P's KV"
                if problem is not None:
                    why = f"refused: {problem}"
                    self._ended.add(want.transfer_id, why)
                    self.peers.control.send(peer, Nack(want.transfer_id, why))
                    return
                rec = self._record(want.transfer_id)
            if rec.want is not None:
                if rec.peer != peer:
                    self.peers.control.send(peer, Nack(want.transfer_id, "claimed by another D"))
                return
            rec.want, rec.peer = want, peer
            self._leases.renew(want.transfer_id)
            self._maybe_start(rec)

    def on_done(self, peer: PeerAddr, done: Done) -> None:
        with self._lock:
            rec = self._records.get(done.transfer_id)
            if rec is None or rec.peer != peer:
                return
            if rec.state is SENDING:
                rec.peer_result = (done.ok, done.reason or "delivered")
            else:
                state = DELIVERED if done.ok else FAILED
                self._end(rec, state, "done", done.reason or "delivered")

    def on_cancel(self, peer: PeerAddr, cancel: Cancel) -> None:
        reason = f"cancelled by D: {cancel.reason}"
        with self._lock:
            rec = self._records.get(cancel.transfer_id)
            if rec is None:
                if cancel.transfer_id not in self._ended:
                    self._ended.add(cancel.transfer_id, reason)
                return
            if rec.peer is not None and rec.peer != peer:
                return
            if rec.peer is None and not self._may_serve(rec, peer):
                return
            if rec.state is SENDING:
                rec.peer_result = (False, reason)
                lane = self.peers.send_lane(peer.engine_id, rec.want.group) if rec.want else None
                job = lane.cancel(rec.transfer_id) if lane is not None else None
                if job is not None:  # its batch had not started: it never goes out
                    job.error = LaneError(reason)
                    self._job_ended(job)
            else:
                self._end(rec, FAILED, "cancelled", reason)

    def on_heartbeat(self, peer: PeerAddr, heartbeat: Heartbeat) -> None:
        """From D: renew the leases it names; NACK the loads P does not hold for it."""
        with self._lock:
            for transfer_id in heartbeat.transfer_ids:
                rec = self._records.get(transfer_id)
                if rec is not None and rec.peer == peer:
                    self._leases.renew(transfer_id)
                else:
                    why = self.ended_reason(transfer_id) or "unknown transfer (P restarted?)"
                    self.peers.control.send(peer, Nack(transfer_id, why))
            for transfer_id in heartbeat.queued:  # not asked for yet: unknown ones are early
                rec = self._records.get(transfer_id)
                if rec is not None and rec.peer is None and self._may_serve(rec, peer):
                    self._leases.renew(transfer_id)

    def heartbeats(self) -> dict[PeerAddr, Heartbeat]:
        """Per D: the transfers it asked for (WANT here, not sent yet) whose request is still
        queued or in prefill here, oldest first, at most ``MAX_COMPUTING`` (past that, the
        newest are not named: their deadline on D runs on from their last naming)."""
        named: dict[PeerAddr, list[str]] = {}
        with self._lock:
            for transfer_id in dict.fromkeys(self._in_progress.values()):
                rec = self._records.get(transfer_id)
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
            for rec in list(self._records.values()):
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
            for rec in list(self._records.values()):
                if rec.peer is None or rec.peer.engine_id != engine_id:
                    continue
                if rec.state is SENDING:
                    rec.peer_result = (False, why)  # ended by its lane
                elif not rec.state.is_terminal:
                    self._end(rec, FAILED, "peer_lost", why)

    def on_tick(self, now: float) -> None:
        """Expired leases end their transfers; old tombstones are forgotten."""
        with self._lock:
            for transfer_id in self._leases.expired(now):
                rec = self._records.get(transfer_id)
                if rec is None:
                    self._leases.release(transfer_id)
                elif rec.state in (PENDING, SENT):
                    self._end(rec, EXPIRED, "expired", f"no word from D in {self._leases.lease_s}s")
            self._ended.forget_expired(now)

    # ------------------------------------------------------------------ internals (lock held)
    def _record(self, transfer_id: str) -> Outbound:
        """The transfer's record, created with a fresh lease."""
        rec = self._records.get(transfer_id)
        if rec is None:
            rec = self._records[transfer_id] = Outbound(transfer_id)
            self._leases.grant(transfer_id)
        return rec

    def _serve_problem(self, rec: Outbound) -> str | None:
        """Why D's WANT can't be served from this KV (None: it can)."""
        assert rec.want is not None and rec.spec is not None and rec.peer is not None
        if not self._may_serve(rec, rec.peer):
            return f"transfer is for {rec.spec.expected_peer}, not {rec.peer.engine_id}"
        return want_problem(rec.want, rec.spec, self.block_size, self.half_block_bytes)

    def _may_serve(self, rec: Outbound, peer: PeerAddr) -> bool:
        expected = rec.spec.expected_peer if rec.spec is not None else None
        return expected is None or expected == peer.engine_id

    def _maybe_start(self, rec: Outbound) -> None:
        """Send the whole transfer once D's WANT is here, the KV is prepared and the lane is
        up (else this is called again when one of them changes)."""
        if rec.state is not PENDING or rec.want is None or rec.peer is None or not rec.prepared:
            return
        lane = self.peers.send_lane(rec.peer.engine_id, rec.want.group)
        if lane is None:
            if not self.peers.has_group(rec.peer.engine_id, rec.want.group):
                self._end(rec, FAILED, "group_lost", "the pair group with D is gone")
            return  # being set up: on_group_ready
        problem = self._serve_problem(rec)
        if problem is not None:
            self._end(rec, REFUSED, "bad_want", problem)
            return
        try:
            job = self.mode.whole(rec, self.mode.ids(rec), rec.want.segments)
        except LaneError as e:
            self._end(rec, FAILED, "send", str(e))
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
        rec = self._records.get(job.transfer_id)
        if rec is None or rec.job is not job:
            return
        rec.job = None
        if job.error is not None and rec.peer_result is not None and not rec.peer_result[0]:
            # D had ended it (a CANCEL, a failed load) or the pair group was gone: that is
            # why the send broke, and D needs no NACK.
            self._end(rec, FAILED, "peer", rec.peer_result[1])
            return
        if job.error is not None:
            self._end(rec, FAILED, "send", f"send failed: {job.error}")
            assert rec.peer is not None
            self.peers.control.send(rec.peer, Nack(rec.transfer_id, f"send failed: {job.error}"))
            return
        assert rec.want is not None
        self.stats.num_bytes_sent += job.num_bytes
        self.stats.num_blocks_sent += sum(len(ix) for ix in rec.want.block_indices)
        if rec.peer_result is not None:
            ok, reason = rec.peer_result
            self._end(rec, DELIVERED if ok else FAILED, "done", reason)
        else:
            rec.state = SENT
            self._leases.renew(rec.transfer_id)

    def _early_wants_full(self) -> bool:
        """MAX_EARLY_WANTS records were made by WANTs before P's request got to its KV
        (counted only when there may be that many)."""
        return len(self._records) >= MAX_EARLY_WANTS and (
            sum(rec.spec is None for rec in self._records.values()) >= MAX_EARLY_WANTS
        )

    def _end(self, rec: Outbound, state: TransferState, cause: str, reason: str) -> None:
        """The one terminal transition of a send."""
        if rec.state.is_terminal:
            return
        rec.state = state
        self.stats.sends[state.value] += 1
        if state is DELIVERED:
            logger.debug("transfer %s to %s: delivered (%s)", rec.transfer_id, rec.peer, reason)
        else:
            self._log.warning(
                f"send:{cause}",
                "transfer %s to %s: %s (%s)",
                rec.transfer_id,
                rec.peer.engine_id if rec.peer else "no D yet",
                state.value,
                reason,
            )
        if state in (REFUSED, EXPIRED) and rec.peer is not None:
            self.peers.control.send(rec.peer, Nack(rec.transfer_id, f"{state.value}: {reason}"))
        self._ended.add(rec.transfer_id, f"{state.value}: {reason}")
        self.mode.release(rec.transfer_id)
        self._retire_if_settled(rec)

    def _retire_if_settled(self, rec: Outbound) -> None:
        """Forget a terminal transfer once the scheduler's hold decision is known; free its
        blocks if held. A record that never saw its KV has nothing held: it goes at once."""
        if not rec.state.is_terminal or (rec.spec is not None and rec.held is None):
            return
        self._release_blocks(rec)
        self._records.pop(rec.transfer_id, None)
        self._leases.release(rec.transfer_id)

    def _release_blocks(self, rec: Outbound) -> None:
        if rec.held and not rec.released:
            assert rec.spec is not None
            self.finished.sending(rec.spec.request_id)
            rec.released = True
