"""OutboundRecords: P's transfer records, each from its making to its retirement.

A record is made with a lease (lease.py): D's heartbeats renew it, and its expiry ends the
transfer. It ends exactly once (``end``, into one of the terminal states of
transfer_state.py), and is then remembered for a while (tombstones.py): a late WANT, CANCEL or
heartbeat for it gets the right answer. It is retired, its lease released and its blocks
freed (``finished_sending``) if held, once it has ended and the scheduler has said whether it
holds them. Used under OutboundTransfers' lock.
"""

from __future__ import annotations

import logging

from pagedkv.kv_transfer.p2p.lease import LeaseTable
from pagedkv.kv_transfer.p2p.peers import Peers
from pagedkv.kv_transfer.p2p.protocol import Nack
from pagedkv.kv_transfer.p2p.send_modes import SendMode
from pagedkv.kv_transfer.p2p.tombstones import Tombstones
from pagedkv.kv_transfer.p2p.transfer_state import Outbound, P2pStats, Reports, TransferState
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)

DELIVERED, REFUSED, EXPIRED = TransferState.DELIVERED, TransferState.REFUSED, TransferState.EXPIRED


class OutboundRecords(dict[str, Outbound]):
    """Transfer id -> record; made (``make``), ended (``end``) and retired only here."""

    def __init__(
        self, lease_s: float, mode: SendMode, peers: Peers, finished: Reports, stats: P2pStats
    ) -> None:
        super().__init__()
        self.mode = mode
        self.peers = peers
        self.finished = finished
        self.stats = stats
        self.leases = LeaseTable(lease_s)
        self.ended = Tombstones(keep_s=max(60.0, 4 * lease_s))
        self._log = RateLimitedLog(logger)

    def make(self, transfer_id: str) -> Outbound:
        """The transfer's record, created with a fresh lease."""
        rec = self.get(transfer_id)
        if rec is None:
            rec = self[transfer_id] = Outbound(transfer_id)
            self.leases.grant(transfer_id)
        return rec

    def end(self, rec: Outbound, state: TransferState, cause: str, reason: str) -> None:
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
        self.ended.add(rec.transfer_id, f"{state.value}: {reason}")
        self.mode.release(rec.transfer_id)
        self.retire_if_settled(rec)

    def retire_if_settled(self, rec: Outbound) -> None:
        """Forget a terminal transfer once the scheduler's hold decision is known; free its
        blocks if held. A record that never saw its KV has nothing held: it goes at once."""
        if not rec.state.is_terminal or (rec.spec is not None and rec.held is None):
            return
        self.release_blocks(rec)
        self.pop(rec.transfer_id, None)
        self.leases.release(rec.transfer_id)

    def release_blocks(self, rec: Outbound) -> None:
        if rec.held and not rec.released:
            assert rec.spec is not None
            self.finished.sending(rec.spec.request_id)
            rec.released = True

    def expire(self, now: float) -> None:
        """Expired leases end their transfers; old tombstones are forgotten."""
        for transfer_id in self.leases.expired(now):
            rec = self.get(transfer_id)
            if rec is None:
                self.leases.release(transfer_id)
            elif rec.state in (TransferState.PENDING, TransferState.SENT):
                self.end(rec, EXPIRED, "expired", f"no word from D in {self.leases.lease_s}s")
        self.ended.forget_expired(now)
