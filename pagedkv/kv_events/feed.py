"""One publisher a KVEventSubscriber follows ("feed"): its address, its sockets and sync
state (``Feed``, the subscriber thread's alone), and what ``/instances`` shows of it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import zmq

from pagedkv.kv_events.wire import KVCacheSnapshot, KVEventBatch


class FeedState(enum.Enum):
    SYNCING = "syncing"
    REPLAYING = "replaying"
    LIVE = "live"


@dataclass
class FeedStats:
    """What ``/instances`` shows of a feed (written by the subscriber thread only)."""

    state: FeedState = FeedState.SYNCING
    #: False while the sink may lack blocks the publisher holds (no replay endpoint, gap seen).
    synced: bool = False
    last_seq: int | None = None
    num_batches: int = 0
    num_gaps: int = 0
    num_replays: int = 0
    num_snapshots: int = 0
    num_restarts: int = 0
    num_reconnects: int = 0
    num_malformed: int = 0
    #: Seconds between a batch's publication and its arrival, for the last batch.
    last_lag_s: float | None = None
    last_batch_at: float | None = None  # time.monotonic()

    def describe(self) -> dict:
        since = None if self.last_batch_at is None else time.monotonic() - self.last_batch_at
        return {
            "state": self.state.value,
            "synced": self.synced,
            "last_seq": self.last_seq,
            "batches": self.num_batches,
            "gaps": self.num_gaps,
            "replays": self.num_replays,
            "snapshots": self.num_snapshots,
            "restarts": self.num_restarts,
            "reconnects": self.num_reconnects,
            "malformed": self.num_malformed,
            "event_lag_ms": None if self.last_lag_s is None else round(self.last_lag_s * 1e3, 2),
            "seconds_since_event": None if since is None else round(since, 3),
        }


@dataclass(frozen=True)
class FeedAddress:
    """Where a publisher's batches come from (``endpoint``, under ``topic``), and where it
    answers replay and snapshot requests (``replay_endpoint``; None: the feed can't resync)."""

    endpoint: str
    replay_endpoint: str | None
    topic: str = ""


@dataclass
class Feed:
    """A followed publisher, as the subscriber thread (its only user) sees it: its sockets,
    the seq it expects next, and the request (snapshot or replay) it awaits an answer to."""

    name: str
    address: FeedAddress
    sub: zmq.Socket
    #: Reports the SUB socket's connections (each one after the first resyncs).
    monitor: zmq.Socket
    num_connects: int = 0
    dealer: zmq.Socket | None = None
    expected_seq: int | None = None
    #: "snapshot" or "replay" while a request is out, with its deadline.
    outstanding: str | None = None
    deadline: float = 0.0
    snapshot: KVCacheSnapshot | None = None
    pending: list[tuple[int, KVEventBatch]] = field(default_factory=list)
    stats: FeedStats = field(default_factory=FeedStats)

    def close(self) -> None:
        self.sub.disable_monitor()
        self.monitor.close(linger=0)
        self.sub.close(linger=0)
        if self.dealer is not None:
            self.dealer.close(linger=0)
