"""Per-transfer state on each side, and the connector's counters.

Every transfer ends in exactly one terminal state on each side, and each side can observe the
other's end: P learns it from DONE / CANCEL / its lease expiring, D from the data arriving, a
NACK, the peer going silent, or its own deadline::

    P (Outbound)  PENDING --WANT+KV--> SENDING --all sent--> SENT --DONE ok--> DELIVERED
                     |                    |                    |--DONE !ok / CANCEL--> FAILED
                     |                    |--send error, peer lost ------------------> FAILED
                     |--request ended w/o KV, pool full, bad WANT--------------------> REFUSED
                     |--CANCEL, peer lost, pair group gone --------------------------> FAILED
                     |--lease expired (PENDING or SENT) -----------------------------> EXPIRED
    D (Inbound)   PENDING --XFER_BEGIN--> RECEIVING --all scattered--> DELIVERED
                     |--NACK--> REFUSED      |--error / cancel / peer lost--> FAILED
                     |--cancel (abort, deadline) / peer lost / bad params--> FAILED

D's deadline (``kv_load_timeout``) counts from the load's start or from the last heartbeat in
which P named the transfer as still being computed, whichever is later.

A record in SENDING leaves it only through its lane (the lane may still read its memory).
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Protocol

from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_transfer.p2p.connector import LoadSpec, SendSpec
from pagedkv.kv_transfer.p2p.lanes import Job
from pagedkv.kv_transfer.p2p.protocol import Want
from pagedkv.transport.peer_addr import PeerAddr


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
    #: Whole sends may start: the request finished and the send mode prepared its KV.
    prepared: bool = False
    #: The lane job while SENDING.
    job: Job | None = None
    #: D's verdict (DONE/CANCEL), or the peer lost, while P is still sending.
    peer_result: tuple[bool, str] | None = None


@dataclass(eq=False)
class Inbound:
    """D's side of one load. ``lock`` orders writes into the paged cache against cancellation:
    once ``cancelled`` is set under it the receive lane posts nothing more into the blocks and
    scatters nothing more; the load is reported ended once ``posted`` (receives posted
    straight into its blocks, still in flight) is back to 0 (``failure`` waits till then)."""

    spec: LoadSpec
    group: str = ""
    #: How the data arrives, per KV cache group (planned at the load's start; transfer.py).
    segments: list[list[int]] = field(default_factory=list)
    state: TransferState = TransferState.PENDING
    cancelled: bool = False
    posted: int = 0
    reported: bool = False
    failure: str | None = None
    #: The WANT is queued on P's connection: from then on heartbeats name the load as awaited
    #: (before, P has never heard of it and would refuse it as unknown).
    want_sent: bool = False
    #: Its deadline counts from then (monotonic): the load's start, or the last time P named
    #: it as still being computed.
    counted_from: float = field(default_factory=time.monotonic)
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
    #: Prompt tokens whose KV arrived from P (D did not compute them).
    num_tokens_received: int = 0
    #: P's sends by when they started: with the forward computing the prompt (its WANT was
    #: there first, or joined the forward running), or after the request finished.
    num_streamed_sends: int = 0
    num_joined_sends: int = 0
    num_after_forward_sends: int = 0

    def as_dict(self) -> dict[str, int]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name.startswith("num_")}
        for state in ("delivered", "refused", "failed", "expired"):
            out[f"num_sends_{state}"] = self.sends[state]
            out[f"num_loads_{state}"] = self.loads[state]
        return out


class Reports(Protocol):
    """Where the owners report a transfer's end (``Finished``, or pieces joined first)."""

    def sending(self, request_id: str) -> None: ...

    def recving(self, request_id: str, invalid_block_ids: set[int], error: str | None) -> None: ...

    def in_progress(self, request_ids: list[str]) -> None: ...


class Finished:
    """What the worker reports up at the end of a step (``finished_sending``,
    ``finished_recving``, ``invalid_block_ids``, ``loads_in_progress``), filled by any thread;
    ``notify`` wakes an engine that waits only for transfers."""

    def __init__(self, notify: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._output = KVConnectorOutput()
        self._notify = notify

    def sending(self, request_id: str) -> None:
        """P: the request's blocks may be freed."""
        with self._lock:
            self._output.finished_sending.add(request_id)
        self._notify()

    def recving(self, request_id: str, invalid_block_ids: set[int], error: str | None) -> None:
        """D: the request's load ended (failed: its blocks are ``invalid_block_ids``, and
        ``error`` says why)."""
        with self._lock:
            self._output.finished_recving.add(request_id)
            self._output.invalid_block_ids.update(invalid_block_ids)
            if error is not None:
                self._output.load_errors[request_id] = error
        self._notify()

    def in_progress(self, request_ids: list[str]) -> None:
        """D: P still computes these requests' KV (their deadlines count from now). Nothing
        ended: the engine is not woken."""
        with self._lock:
            self._output.loads_in_progress.update(request_ids)

    def take(self) -> KVConnectorOutput:
        with self._lock:
            out, self._output = self._output, KVConnectorOutput()
        return out
