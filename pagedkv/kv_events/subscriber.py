"""KVEventSubscriber: follows many publishers' KV events and keeps a sink in step with each.

One thread owns every socket: per publisher ("feed") a SUB socket and, when it has a replay
endpoint, a DEALER for replay and snapshot requests. Each feed's state::

    SYNCING ──snapshot + END──▶ LIVE ──seq > expected (lost)──▶ REPLAYING ──END, filled──▶ LIVE
       ▲                         │                                  │
       └── seq < expected (restarted), a bad payload, a replay that cannot fill the gap,
           or no answer within the request timeout ◀───────────────┘

A feed starts SYNCING (a snapshot: the sink is reloaded whole); batches that arrive while a
request is answered wait in ``pending`` and are applied in seq order once it is. The SUB
socket reconnecting (the publisher restarted, or the connection broke: batches may be lost
with no later one to show the gap) resyncs too. A feed without a replay endpoint cannot
resync: on a gap its sink entries are cleared and rebuilt from the events that follow
(``synced`` False: it only under-predicts). Nothing here blocks on a peer: every request has
a deadline, after which it is asked again on a fresh socket. A feed's own state is in
feed.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from pagedkv.kv_events.feed import Feed, FeedAddress, FeedState, FeedStats
from pagedkv.kv_events.wire import (
    BATCH_DECODER,
    SNAPSHOT_DECODER,
    SNAPSHOT_REQUEST,
    KVEventBatch,
    WireEvent,
    decode_seq,
    encode_seq,
)
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)

_POLL_MS = 50
#: A replay or snapshot request unanswered for this long is asked again (fresh socket).
REQUEST_TIMEOUT_S = 5.0
#: Batches held while a request is answered; past it the feed resyncs from a snapshot.
MAX_PENDING = 10_000
#: ZMQ drops (and disconnects) larger messages; a snapshot of 1M blocks is ~20 MB.
MAX_MESSAGE_BYTES = 256 << 20


class KVEventSink(Protocol):
    """Where a feed's events land (the proxy's ``KVIndex``). Called on the subscriber thread."""

    def apply(self, name: str, events: list[WireEvent]) -> None: ...

    def load_snapshot(
        self, name: str, block_hashes: list[list[bytes]], tiers: dict[str, list[list[bytes]]]
    ) -> None: ...

    def clear(self, name: str) -> None: ...


class KVEventSubscriber:
    def __init__(self, sink: KVEventSink, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.sink = sink
        self.request_timeout_s = request_timeout_s
        self._ctx = zmq.Context()
        self._feeds: dict[str, Feed] = {}  # subscriber thread only
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        #: Each feed's stats (replaced, never mutated, from other threads' point of view).
        self.stats: dict[str, FeedStats] = {}
        self._stop = threading.Event()
        self._log = RateLimitedLog(logger)
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for feed in list(self._feeds.values()):
            feed.close()
        self._ctx.term()

    # ------------------------------------------------------------------ any thread
    def follow(self, name: str, address: FeedAddress) -> None:
        """Follow ``name``'s events at ``address`` (again from scratch if it was followed)."""
        self._commands.put(lambda: self._follow(name, address))

    def forget(self, name: str) -> None:
        """Stop following ``name`` and clear its entries in the sink."""
        self._commands.put(lambda: self._forget(name))

    # ------------------------------------------------------------------ subscriber thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._run_commands()
                poller = zmq.Poller()
                sockets: dict[zmq.Socket, tuple[Feed, Callable]] = {}
                for feed in self._feeds.values():
                    sockets[feed.sub] = (feed, self._on_published)
                    sockets[feed.monitor] = (feed, self._on_monitor)
                    if feed.dealer is not None:
                        sockets[feed.dealer] = (feed, self._on_reply)
                for socket in sockets:
                    poller.register(socket, zmq.POLLIN)
                if not sockets:
                    time.sleep(_POLL_MS / 1000)
                    continue
                for socket, _ in poller.poll(_POLL_MS):
                    feed, handle = sockets[socket]
                    if feed.name not in self._feeds:
                        continue  # dropped by an earlier socket's handling
                    self._drain(feed, socket, handle)
                self._check_deadlines()
            except zmq.ContextTerminated:
                return
            except Exception:  # the thread must outlive any bug or input
                logger.exception("KV events subscriber error (continuing)")
                time.sleep(_POLL_MS / 1000)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _drain(self, feed: Feed, socket: zmq.Socket, handle: Callable) -> None:
        """Every message queued on ``socket`` (a reply socket may be replaced meanwhile)."""
        while feed.name in self._feeds and socket in (feed.sub, feed.monitor, feed.dealer):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(feed, frames)

    def _follow(self, name: str, address: FeedAddress) -> None:
        if name in self._feeds:
            self._forget(name)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, address.topic.encode())
        try:
            sub.connect(address.endpoint)
        except zmq.ZMQError as e:
            sub.close(linger=0)
            self._log.warning("connect", "KV events of %s: cannot connect: %s", name, e)
            return
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        feed = self._feeds[name] = Feed(name, address, sub, monitor)
        self.stats[name] = feed.stats
        self.sink.clear(name)
        if address.replay_endpoint is None:
            feed.stats.state = FeedState.LIVE  # from whatever arrives first: partial
        else:
            self._request(feed, "snapshot")

    def _forget(self, name: str) -> None:
        feed = self._feeds.pop(name, None)
        self.stats.pop(name, None)
        if feed is not None:
            feed.close()
        self.sink.clear(name)

    # ------------------------------------------------------------------ requests
    def _request(self, feed: Feed, kind: str) -> None:
        """Ask for a snapshot, or a replay from ``expected_seq``, on a fresh DEALER (so no
        late answer to an earlier request can be taken for this one's)."""
        assert feed.address.replay_endpoint is not None
        if feed.dealer is not None:
            feed.dealer.close(linger=0)
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.connect(feed.address.replay_endpoint)
        feed.dealer = dealer
        feed.outstanding = kind
        feed.deadline = time.monotonic() + self.request_timeout_s
        feed.snapshot = None
        if kind == "snapshot":
            feed.stats.state = FeedState.SYNCING
            feed.stats.num_snapshots += 1
            body = SNAPSHOT_REQUEST
        else:
            assert feed.expected_seq is not None
            feed.stats.state = FeedState.REPLAYING
            feed.stats.num_replays += 1
            body = encode_seq(feed.expected_seq)
        feed.stats.synced = False
        dealer.send_multipart((b"", body), zmq.NOBLOCK)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for feed in list(self._feeds.values()):
            if feed.outstanding is not None and now > feed.deadline:
                self._log.warning(
                    "timeout",
                    "KV events of %s: no answer to a %s request in %.0fs: asking again",
                    feed.name,
                    feed.outstanding,
                    self.request_timeout_s,
                )
                self._resync(feed)

    def _resync(self, feed: Feed) -> None:
        """Reload the feed whole: a snapshot, or (no replay endpoint) clear and go on."""
        feed.pending.clear()
        if feed.address.replay_endpoint is not None:
            self._request(feed, "snapshot")
            return
        self.sink.clear(feed.name)
        feed.expected_seq = None
        feed.stats.synced = False

    # ------------------------------------------------------------------ messages
    def _on_monitor(self, feed: Feed, frames: list[bytes]) -> None:
        if parse_monitor_message(frames)["event"] != zmq.EVENT_CONNECTED:
            return
        feed.num_connects += 1
        if feed.num_connects > 1:
            feed.stats.num_reconnects += 1
            self._resync(feed)

    def _decode_batch(self, feed: Feed, seq_frame: bytes, payload: bytes):
        try:
            return decode_seq(seq_frame), BATCH_DECODER.decode(payload)
        except (ValueError, msgspec.DecodeError) as e:
            feed.stats.num_malformed += 1
            self._log.warning("malformed", "KV events of %s: a bad batch: %s", feed.name, e)
            return None

    def _on_published(self, feed: Feed, frames: list[bytes]) -> None:
        if len(frames) != 3:
            feed.stats.num_malformed += 1
            return
        decoded = self._decode_batch(feed, frames[1], frames[2])
        if decoded is None:
            self._resync(feed)
            return
        seq, batch = decoded
        if feed.outstanding is not None:
            feed.pending.append((seq, batch))
            if len(feed.pending) > MAX_PENDING:
                self._resync(feed)
            return
        expected = feed.expected_seq
        if expected is not None and seq > expected:
            feed.stats.num_gaps += 1
            if feed.address.replay_endpoint is not None:
                feed.pending.append((seq, batch))
                self._request(feed, "replay")
                return
            self.sink.clear(feed.name)  # cannot fill the gap: rebuild from here
            feed.stats.synced = False
        elif expected is not None and seq < expected:
            feed.stats.num_restarts += 1  # the publisher started over: its cache is new
            self.sink.clear(feed.name)
            if feed.address.replay_endpoint is not None:
                feed.pending.append((seq, batch))
                self._request(feed, "snapshot")
                return
        self._apply(feed, seq, batch)

    def _apply(self, feed: Feed, seq: int, batch: KVEventBatch) -> None:
        self.sink.apply(feed.name, batch.events)
        feed.expected_seq = seq + 1
        stats = feed.stats
        stats.last_seq = seq
        stats.num_batches += 1
        stats.last_lag_s = max(time.time() - batch.ts, 0.0)
        stats.last_batch_at = time.monotonic()

    def _on_reply(self, feed: Feed, frames: list[bytes]) -> None:
        if feed.outstanding is None or len(frames) != 4 or frames[0] != b"":
            feed.stats.num_malformed += 1
            return
        _, _, seq_frame, payload = frames
        try:
            seq = decode_seq(seq_frame)
        except ValueError:
            feed.stats.num_malformed += 1
            return
        if seq == -1:
            self._end_of_answer(feed)
            return
        if feed.outstanding == "snapshot":
            try:
                feed.snapshot = SNAPSHOT_DECODER.decode(payload)
            except msgspec.DecodeError as e:
                feed.stats.num_malformed += 1
                self._log.warning("malformed", "KV events of %s: a bad snapshot: %s", feed.name, e)
            return
        decoded = self._decode_batch(feed, seq_frame, payload)
        if decoded is not None and decoded[0] == feed.expected_seq:
            self._apply(feed, *decoded)

    def _end_of_answer(self, feed: Feed) -> None:
        """The request is answered: load the snapshot, then apply what waited, in order."""
        kind, feed.outstanding = feed.outstanding, None
        if kind == "snapshot":
            snapshot, feed.snapshot = feed.snapshot, None
            if snapshot is None:
                self._request(feed, "snapshot")
                return
            self.sink.load_snapshot(feed.name, snapshot.block_hashes, snapshot.tiers)
            feed.expected_seq = snapshot.next_seq
        pending, feed.pending = sorted(feed.pending, key=lambda item: item[0]), []
        for seq, batch in pending:
            if seq < feed.expected_seq:  # type: ignore[operator]
                continue  # already in the snapshot or the replay
            if seq > feed.expected_seq:  # type: ignore[operator]
                # Lost for good after a replay: only a snapshot can tell; after a snapshot,
                # the replay buffer may still have them.
                feed.pending = [(s, b) for s, b in pending if s >= seq]
                self._request(feed, "snapshot" if kind == "replay" else "replay")
                return
            self._apply(feed, seq, batch)
        feed.stats.state = FeedState.LIVE
        feed.stats.synced = True
