"""KVEventPublisher: an instance's KV events on a ZMQ PUB socket, with a replay socket.

The engine thread only hands each step's events to a bounded queue (``publish_step``: a seq
number and ``put_nowait``, never a wait); a background thread encodes them (``wire.py``),
publishes them and keeps the last ``buffer_steps`` batches for replay::

    engine thread                          publisher thread
    -------------                          ----------------
    publish_step(events): seq = n++   ->   queue  ->  encode, PUB [topic, seq, payload], buffer
       queue full: dropped, counted (seq n is never sent: subscribers see a gap)
       a snapshot asked for: the pool's and the tiers' hashes -> queue -> to every client
                             that asked
                                           ROUTER: replay from a seq / a snapshot request

A subscriber that lost batches asks for a replay from the first seq it lacks; batches no longer
buffered (or dropped before they were sent) cannot be replayed, so it asks for a snapshot: the
engine hands over its prefix cache between two batches. A dropped batch must be seen as a gap
even when nothing follows it: after a drop the next ``publish_step`` sends a batch even if
empty. ``wake_engine`` (set by ``AsyncLLM``) makes an idle engine take that step at once, for
a snapshot request or a drop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import zmq

from pagedkv.kv_cache.block_hash import BlockHash
from pagedkv.kv_cache.kv_events import KVCacheEvent
from pagedkv.kv_events.config import KVEventsConfig
from pagedkv.kv_events.wire import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    KVCacheSnapshot,
    KVEventBatch,
    encode_seq,
    to_wire,
)
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)

_POLL_S = 0.05
#: Largest replay request accepted (a seq or the snapshot request).
_MAX_REQUEST_BYTES = 64


class _Batch(NamedTuple):
    seq: int
    ts: float
    events: list[KVCacheEvent]


class _Snapshot(NamedTuple):
    ts: float
    next_seq: int
    block_hashes: list[list[BlockHash]]
    tiers: dict[str, list[list[BlockHash]]]


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[_Batch | _Snapshot | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._next_seq = 0  # engine thread only
        self._snapshot_wanted = threading.Event()
        #: A batch was dropped and no later one has been queued (engine thread only).
        self._gap = False
        #: Replay clients waiting for a snapshot (publisher thread only).
        self._snapshot_clients: list[bytes] = []
        #: Called on the publisher thread when the engine has to take a ``publish_step``
        #: (a snapshot was asked for, or a batch was dropped) even if it is idle.
        self.wake_engine: Callable[[], None] | None = None
        self.num_published_batches = 0
        self.num_dropped_batches = 0
        self.num_dropped_events = 0
        self.num_replays = 0
        self.num_snapshots = 0
        self._log = RateLimitedLog(logger)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(config.endpoint)
            #: The addresses bound (port 0 resolved): what the instance registers.
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, 4096)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot bind: {e}") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def publish_step(
        self,
        events: list[KVCacheEvent],
        cached_block_hashes: Callable[[], list[list[BlockHash]]],
        tier_block_hashes: Callable[[], dict[str, list[list[BlockHash]]]] = dict,
    ) -> None:
        """Hand one step's events over (never waits: a full queue drops them, counted); then,
        if a subscriber asked, the prefix cache's hashes (``cached_block_hashes()``) and the
        connector tiers' (``tier_block_hashes()``, by medium), both taken after these events."""
        if events or self._gap:
            self._publish(events)
        if self._snapshot_wanted.is_set():
            self._snapshot_wanted.clear()
            snapshot = _Snapshot(
                time.time(), self._next_seq, cached_block_hashes(), tier_block_hashes()
            )
            try:
                self._queue.put_nowait(snapshot)
            except queue.Full:
                self._snapshot_wanted.set()  # the next step tries again

    def _publish(self, events: list[KVCacheEvent]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait(_Batch(seq, time.time(), events))
            self._gap = False
        except queue.Full:
            self._gap = True
            self.num_dropped_batches += 1
            self.num_dropped_events += len(events)
            self._log.warning(
                "dropped",
                "KV events: the queue is full (%d batches): dropped batch %d (%d dropped so far)",
                self.config.max_queue_size,
                seq,
                self.num_dropped_batches,
            )

    # ------------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while not self._stop.is_set():
            try:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_request()
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if self._gap:  # nothing will follow the dropped batch unless woken
                        self._wake()
                    continue
                if item is None:
                    return
                if isinstance(item, _Snapshot):
                    self._send_snapshot(item.next_seq, encoder.encode(KVCacheSnapshot(*item)))
                    continue
                events = [to_wire(event) for event in item.events]
                payload = encoder.encode(KVEventBatch(item.ts, events))
                seq = encode_seq(item.seq)
                # PUB never blocks: past a subscriber's high-water mark it drops (a gap there)
                self._pub.send_multipart((self._topic, seq, payload), zmq.NOBLOCK)
                self._buffer.append((item.seq, payload))
                self.num_published_batches += 1
            except zmq.ContextTerminated:
                return
            except Exception:  # the thread must outlive any bug or input
                logger.exception("KV events publisher error (continuing)")
                time.sleep(_POLL_S)

    def _serve_request(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) > _MAX_REQUEST_BYTES:
            self._log.warning("bad request", "KV events: a malformed replay request, dropped")
            return
        client, _, request = frames
        if request == SNAPSHOT_REQUEST:
            if client not in self._snapshot_clients:  # asked again: answered once
                self._snapshot_clients.append(client)
            self._snapshot_wanted.set()
            self._wake()
            return
        if len(request) != 8:
            self._log.warning("bad request", "KV events: a malformed replay request, dropped")
            return
        start = int.from_bytes(request, "big")
        self.num_replays += 1
        for seq, payload in self._buffer:
            if seq >= start:
                self._reply(client, encode_seq(seq), payload)
        self._reply(client, END_SEQ, b"")

    def _wake(self) -> None:
        if self.wake_engine is not None:
            self.wake_engine()

    def _send_snapshot(self, next_seq: int, payload: bytes) -> None:
        clients, self._snapshot_clients = self._snapshot_clients, []
        for client in clients:
            self.num_snapshots += 1
            self._reply(client, encode_seq(next_seq), payload)
            self._reply(client, END_SEQ, b"")

    def _reply(self, client: bytes, seq: bytes, payload: bytes) -> None:
        assert self._replay is not None
        topic = self._topic if payload else b""
        try:
            self._replay.send_multipart((client, b"", topic, seq, payload), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # gone, or not reading: it asks again
            logger.debug("KV events: could not answer a replay client: %s", e)

    def get_stats(self) -> dict[str, int]:
        """Counters for ``/metrics`` (plain ints, each with one writer)."""
        return {
            "num_published_batches": self.num_published_batches,
            "num_dropped_batches": self.num_dropped_batches,
            "num_dropped_events": self.num_dropped_events,
            "num_replays": self.num_replays,
            "num_snapshots": self.num_snapshots,
        }

    def shutdown(self) -> None:
        """Stop the thread (what is still queued is not sent) and close the sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
