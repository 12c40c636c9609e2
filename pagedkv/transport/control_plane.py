"""ControlPlane: one ZMQ ROUTER per instance, served by a listener thread, and one DEALER per peer.

Every message is a one-way datagram: a reply, if any, goes out through the replier's own DEALER
to the address in the envelope (``sender``). The ROUTER binds ``tcp://{kv_ip}:{kv_port}`` only,
never ``*``. The listener survives any input: a message that fails ``Codec.decode`` is counted
and logged; a handler that raises is logged; the loop goes on. Handlers run on the listener
thread and must not block (no gloo, no long waits): they update state and hand work off.

The sender's address is whatever the (authenticated) envelope says, so the DEALERs are a
bounded LRU (``max_peers``): messages from many claimed addresses cost at most that many
sockets, never every file descriptor of the process. ``on_heard`` sees the sender of every
message that decoded; ``on_rejected`` every ``ProtocolError`` (its ``claimed_sender`` is a
claim, not an identity).

Answers on the same connection. A handler may return a message, and ``on_rejected`` may turn a
refused one into a message: it goes back through the ROUTER to the connection the message came
on (the sender's own DEALER reads it), never to the address an envelope claims. The proxy's
registry uses this to acknowledge or refuse registrations; P2P peers answer through DEALERs.

Messages that queued up while the listener was not running (a process SIGSTOPped, a long GC
pause) are read together, at most ``_MAX_BATCH`` at a time, and the types named in ``first``
are handled before the others of the same batch: P2P names CANCEL, so a transfer D gave up on
while P was hung ends by D's word, and the WANT queued ahead of it is refused instead of
starting a send to a D that has torn its side down.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from pagedkv.transport.codec import Codec, Envelope, ProtocolError
from pagedkv.transport.peer_addr import PeerAddr
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)

#: Handles one decoded message; what it returns (if anything) is answered on the connection.
Handler = Callable[[PeerAddr, msgspec.Struct], msgspec.Struct | None]
#: Turns a refused message into an answer on its connection (None: no answer).
RejectionHandler = Callable[[ProtocolError], msgspec.Struct | None]

_POLL_MS = 100
#: Messages read from the ROUTER before any of them is handled (those already queued).
_MAX_BATCH = 64
#: ZMQ itself drops (and disconnects) frames past this multiple of the codec's limit; smaller
#: oversized frames reach the codec, which rejects them with a log line.
_TRANSPORT_LIMIT_FACTOR = 4
#: Default bound on DEALER sockets (peers talked to recently); real deployments have tens.
MAX_PEERS = 256
#: An evicted DEALER still gets this long to flush what was queued on it.
_EVICTED_LINGER_MS = 200


class _Dealer:
    __slots__ = ("socket", "lock")

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self.lock = threading.Lock()

    def close(self, linger_ms: int = 0) -> None:
        with self.lock:
            self.socket.close(linger=linger_ms)


class ControlPlane:
    def __init__(
        self,
        codec: Codec,
        address: PeerAddr,
        handlers: dict[type[msgspec.Struct], Handler],
        name: str = "p2p",
        max_peers: int = MAX_PEERS,
        on_heard: Callable[[PeerAddr], None] | None = None,
        on_rejected: RejectionHandler | None = None,
        first: tuple[type[msgspec.Struct], ...] = (),
    ) -> None:
        self.codec = codec
        self.address = address
        self.name = name
        self.max_peers = max_peers
        self._handlers = handlers
        self._on_heard = on_heard
        self._on_rejected = on_rejected
        self._first = first
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(
            zmq.MAXMSGSIZE, codec.max_message_bytes * _TRANSPORT_LIMIT_FACTOR + 4096
        )
        self._router.bind(address.endpoint)
        #: Endpoint -> DEALER, least recently used first.
        self._dealers: collections.OrderedDict[str, _Dealer] = collections.OrderedDict()
        self._dealers_lock = threading.Lock()
        #: Forgotten DEALERs, by endpoint: (close at, DEALER), oldest first.
        self._retired: collections.OrderedDict[str, tuple[float, _Dealer]] = (
            collections.OrderedDict()
        )
        self._stop = threading.Event()
        #: Dropped messages by reason ("malformed", "oversized", "unauthenticated", ...).
        self.rejected: collections.Counter[str] = collections.Counter()
        #: DEALERs closed to stay within ``max_peers``.
        self.num_evicted_peers = 0
        self._log = RateLimitedLog(logger)
        self._thread = threading.Thread(target=self._serve, name=f"{name}-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ outbound
    def send(self, peer: PeerAddr, message: msgspec.Struct) -> bool:
        """Queue ``message`` to ``peer`` (never blocks, never raises); False if it could not
        be queued."""
        frames = self.codec.encode(message, self.address)
        try:
            dealer = self._dealer(peer.endpoint)
        except zmq.ZMQError as e:  # no socket to that endpoint (bad address, no descriptors)
            logger.warning("%s: no connection to %s for %s: %s", self.name, peer, message, e)
            return False
        if dealer is None:
            return False
        with dealer.lock:
            try:
                dealer.socket.send_multipart(frames, zmq.NOBLOCK)
                return True
            except zmq.ZMQError as e:
                logger.warning("%s: could not send %s to %s: %s", self.name, message, peer, e)
                return False

    def _dealer(self, endpoint: str) -> _Dealer | None:
        with self._dealers_lock:
            if self._stop.is_set():
                return None
            dealer = self._dealers.get(endpoint)
            if dealer is not None:
                self._dealers.move_to_end(endpoint)
                return dealer
            if endpoint in self._retired:  # a late message to a peer gone: no new socket
                return self._retired[endpoint][1]
            while len(self._dealers) >= self.max_peers:
                _, evicted = self._dealers.popitem(last=False)
                self.num_evicted_peers += 1
                evicted.close(_EVICTED_LINGER_MS)
            socket = self._ctx.socket(zmq.DEALER)
            try:
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.SNDHWM, 10_000)
                socket.connect(endpoint)
            except zmq.ZMQError:
                socket.close(linger=0)
                raise
            dealer = self._dealers[endpoint] = _Dealer(socket)
            return dealer

    def forget(self, peer: PeerAddr, keep_s: float = 0.0, now: float | None = None) -> None:
        """Retire the DEALER to a peer that went away. It is kept ``keep_s`` more seconds, so
        what is queued on it (a CANCEL to a peer that was only hung) still goes out if the
        peer comes back, and late messages to the peer reuse it instead of opening a socket;
        ``close_retired`` closes it then, ``revive`` takes it back into use."""
        with self._dealers_lock:
            dealer = self._dealers.pop(peer.endpoint, None)
            if dealer is not None and keep_s > 0:
                deadline = (time.monotonic() if now is None else now) + keep_s
                self._retired[peer.endpoint] = (deadline, dealer)
                dealer = None
                if len(self._retired) > self.max_peers:  # bounded, like the live ones
                    _, (_, dealer) = self._retired.popitem(last=False)
        if dealer is not None:
            dealer.close()

    def revive(self, peer: PeerAddr) -> None:
        """The peer is back (a new pair group): its retired DEALER, if any, is live again."""
        with self._dealers_lock:
            retired = self._retired.pop(peer.endpoint, None)
            if retired is not None and peer.endpoint not in self._dealers:
                self._dealers[peer.endpoint] = retired[1]
                retired = None
        if retired is not None:
            retired[1].close()

    def close_retired(self, now: float) -> None:
        """Close the retired DEALERs whose time is up."""
        with self._dealers_lock:
            due = [ep for ep, (deadline, _) in self._retired.items() if deadline <= now]
            dealers = [self._retired.pop(ep)[1] for ep in due]
        for dealer in dealers:
            dealer.close()

    @property
    def num_peers(self) -> int:
        """DEALERs open now (forgotten ones still flushing included)."""
        return len(self._dealers) + len(self._retired)

    # ------------------------------------------------------------------ inbound
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(_POLL_MS):
                    continue
                batch = self._read_batch()
                # Stable: the ``first`` types in arrival order, then the rest in theirs.
                batch.sort(key=lambda item: not isinstance(item[2], self._first))
                for routing_id, envelope, message in batch:
                    self._answer(routing_id, self._handle(envelope, message))
            except zmq.ContextTerminated:
                return
            except Exception:  # the listener must outlive any bug or input
                logger.exception("%s: listener error (continuing)", self.name)

    def _read_batch(self) -> list[tuple[bytes, Envelope, msgspec.Struct]]:
        """Listener thread: the messages already queued (at least one, at most _MAX_BATCH),
        decoded; a refused one is counted, logged and answered here."""
        batch: list[tuple[bytes, Envelope, msgspec.Struct]] = []
        while len(batch) < _MAX_BATCH:
            try:
                routing_id, *frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                envelope, message = self.codec.decode(frames)
            except ProtocolError as e:
                self._answer(routing_id, self._reject(e))
                continue
            batch.append((routing_id, envelope, message))
        return batch

    def _answer(self, routing_id: bytes, answer: object) -> None:
        """Listener thread: a handler's message goes back to the connection its message came
        on (dropped if it can't go); None means no answer."""
        if answer is None:
            return
        if not isinstance(answer, msgspec.Struct):
            logger.error("%s: a handler returned %r: only a message is answered", self.name, answer)
            return
        try:
            frames = self.codec.encode(answer, self.address)
            self._router.send_multipart([routing_id, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("%s: could not answer %s: %s", self.name, answer, e)

    def _reject(self, e: ProtocolError) -> msgspec.Struct | None:
        """A message that failed to decode: counted and logged; the answer to send back."""
        self.rejected[e.reason] += 1
        self._log.warning(
            e.reason,
            "%s: dropped a control message%s (%s) [%d so far]",
            self.name,
            f" from {e.claimed_sender} (claimed)" if e.claimed_sender else "",
            e,
            self.rejected[e.reason],
        )
        if self._on_rejected is None:
            return None
        try:
            return self._on_rejected(e)
        except Exception:  # the rest of the batch is still handled
            logger.exception("%s: handling a refused message failed", self.name)
            return None

    def _handle(self, envelope: Envelope, message: msgspec.Struct) -> msgspec.Struct | None:
        """Handle one decoded message; returns the answer to send back, if any."""
        sender = envelope.sender
        try:
            if self._on_heard is not None:
                self._on_heard(sender)
            handler = self._handlers.get(type(message))
            if handler is None:
                self.rejected["unexpected"] += 1
                self._log.warning(
                    "unexpected",
                    "%s: no handler for %s [%d so far]",
                    self.name,
                    envelope.kind,
                    self.rejected["unexpected"],
                )
                return None
            return handler(sender, message)
        except Exception:  # the rest of the batch is still handled
            logger.exception("%s: handling %s from %s failed", self.name, message, sender)
            return None

    def close(self, linger_s: float = 0.0) -> None:
        """Stop the listener and close every socket; what is queued (a goodbye) gets up to
        ``linger_s`` to leave."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._dealers_lock:
            dealers = list(self._dealers.values()) + [d for _, d in self._retired.values()]
            self._dealers.clear()
            self._retired.clear()
        for dealer in dealers:
            dealer.close(int(linger_s * 1000))
        self._router.close(linger=0)
        self._ctx.term()
