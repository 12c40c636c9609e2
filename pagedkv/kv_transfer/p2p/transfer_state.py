"""Per-transfer state on each side, and the connector's counters.

Every transfer ends in exactly one terminal state on each side, and each side can observe the
other's end: P learns it from DONE / CANCEL / its lease expiring, D from the data arriving, a
NACK, the peer going silent, or its own deadline::

    P (Outbound)  PENDING --WANT+KV--> SENDING --all sent--> SENT --DONE ok--> DELIVERED
                     |                    |                    |--DONE !ok / CANCEL--> FAILED
                     |                    |--send error------------------------------> FAILED
                     |--request ended w/o KV, pool full, bad WANT--------------------> REFUSED
                     |--lease expired (PENDING or SENT) -----------------------------> EXPIRED
    D (Inbound)   PENDING --XFER_BEGIN--> RECEIVING --all scattered--> DELIVERED
                     |--NACK--> REFUSED      |--error / cancel / peer silent--> FAILED
                     |--cancel (abort, deadline) / peer silent / bad params--> FAILED
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from dataclasses import dataclass, field

from pagedkv.kv_transfer.p2p.connector import LoadSpec, SendSpec
from pagedkv.kv_transfer.p2p.protocol import PeerAddr, Want


class TransferState(enum.Enum):
    PENDING = "pending"
    SENDING = "sending"
    SENT = "sent"
    RECEIVING = "receiving"
    DELIVERED = "delivered"
    REFUSED = "refused"
    FAILED = "failed"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in (
            TransferState.DELIVERED,
            TransferState.REFUSED,
            TransferState.FAILED,
            TransferState.EXPIRED,
        )


@dataclass(eq=False)
class Outbound:
    """P's side of one transfer. Blocks are freed (``finished_sending``) only once the transfer is
    terminal *and* the scheduler has said it holds them (``held``), or, in GET mode, as soon as
    the KV is copied into the send pool."""

    transfer_id: str
    state: TransferState = TransferState.PENDING
    want: Want | None = None
    peer: PeerAddr | None = None
    #: Where the KV is (from ``computing`` or ``holds``); None until P's request gets there.
    spec: SendSpec | None = None
    #: The scheduler's decision when the request ended: None = not ended yet.
    held: bool | None = None
    released: bool = False
    pooled: bool = False
    #: D's verdict (DONE/CANCEL) when it arrives while P is still sending.
    peer_result: tuple[bool, str] | None = None


@dataclass(eq=False)
class Inbound:
    """D's side of one load. ``lock`` orders writes into the paged cache against cancellation:
    once ``cancelled`` is set under it, no receive into the blocks is posted and nothing is
    scattered; the load is reported ended once the receives already posted have completed."""

    spec: LoadSpec
    group: str = ""
    #: How the data arrives (planned in ``_start_load``; see transfer.py).
    segments: list[list[int]] = field(default_factory=list)
    direct: bool = False
    state: TransferState = TransferState.PENDING
    cancelled: bool = False
    reported: bool = False
    #: When the load started (monotonic): P has ``peer_timeout_s`` from then to be heard.
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class P2pStats:
    """Counters since start (exported as ``kv_transfer_*`` metrics by the server)."""

    sends: collections.Counter[str] = field(default_factory=collections.Counter)
    loads: collections.Counter[str] = field(default_factory=collections.Counter)
    num_blocks_sent: int = 0
    num_bytes_sent: int = 0
    num_blocks_received: int = 0
    num_bytes_received: int = 0

    def as_dict(self) -> dict[str, int]:
        out = {
            "num_blocks_sent": self.num_blocks_sent,
            "num_bytes_sent": self.num_bytes_sent,
            "num_blocks_received": self.num_blocks_received,
            "num_bytes_received": self.num_bytes_received,
        }
        for state in ("delivered", "refused", "failed", "expired"):
            out[f"num_sends_{state}"] = self.sends[state]
            out[f"num_loads_{state}"] = self.loads[state]
        return out
