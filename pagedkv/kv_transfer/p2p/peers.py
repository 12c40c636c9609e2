"""Peers: who this instance talks to, and for how long.

Owns the control plane (one ROUTER, one DEALER per peer), the pair group with each peer and
its lanes, and their lifecycle. While a group exists both sides send each other a HEARTBEAT
every ``heartbeat_s`` (D's also names the transfers it awaits, renewing P's leases; P's names
those it still computes, pushing D's load deadlines forward). A group
is torn down when

  * its peer is lost: nothing heard from it for ``peer_timeout_s`` (on shared memory also
    as soon as its process exits: the wire holds a pidfd on it),
  * its peer says goodbye (BYE: shutting down, or it tore its side down),
  * it has been idle (no transfer) for ``idle_ttl_s``,
  * a lane on it broke (a wire operation failed: the pair is out of step), or
  * ``max_pair_groups`` are live and a new peer needs one (least recently used first),

and then: the peer hears BYE, the owners fail what was in flight with it
(``on_peer_lost``), its lanes stop (the process group, its sockets and thread go once they
let go of it) and its DEALER is kept ``lease_s`` more seconds, so a CANCEL queued for a peer
that was only hung still reaches it when it resumes, then closed. Nothing keyed by a peer
outlives it: a deployment whose decode instances come and go keeps a constant footprint.

A message refused as an authentication mismatch, unauthenticated or incompatible names the
peer it *claims* to come from. That claim is only used to tell that peer (a HEARTBEAT, at
most once a second per address, so it sees the mismatch too) and to fail loads from a peer
with which no pair group is up: a peer we are exchanging authenticated messages with can't
be made to fail by a forged claim.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from pagedkv.kv_transfer.p2p.config import P2pConfig
from pagedkv.kv_transfer.p2p.lanes import Job, SendLane
from pagedkv.kv_transfer.p2p.pair_group import PairGroup, PairGroups
from pagedkv.kv_transfer.p2p.protocol import (
    Bye,
    Cancel,
    Heartbeat,
    Hello,
    StoreSet,
    XferBegin,
    XferPart,
)
from pagedkv.kv_transfer.p2p.receive_lane import Target
from pagedkv.kv_transfer.p2p.shm_lanes import lane_classes
from pagedkv.kv_transfer.p2p.transfer import LayerBlocks
from pagedkv.kv_transfer.p2p.wire import ShmWire
from pagedkv.transport.codec import Codec, ProtocolError
from pagedkv.transport.control_plane import ControlPlane, Handler
from pagedkv.transport.peer_addr import PeerAddr
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)

#: Refusals worth telling the claimed sender about (it is misconfigured, not us).
_TOLD = ("auth_mismatch", "unauthenticated", "incompatible")
#: Addresses remembered for rate-limiting those replies.
_MAX_TOLD = 1024
#: Ticks (normally 0.1 s apart) further apart than this mean this process did not run.
PAUSE_S = 1.0


class PeerListener(Protocol):
    def on_group_ready(self, engine_id: str) -> None: ...

    def on_peer_lost(self, engine_id: str, reason: str, unstarted: list[Job]) -> None: ...


class Sender(PeerListener, Protocol):
    def on_job_ended(self, job: Job) -> None: ...


class Receiver(PeerListener, Protocol):
    def on_xfer_part(
        self, peer: PeerAddr, xfer: XferPart
    ) -> tuple[Target, list[LayerBlocks]] | None: ...

    def drain_layers(self, xfer: XferPart) -> list[LayerBlocks]: ...

    def on_received(self, target: Target, num_bytes: int, error: Exception | None) -> None: ...

    def check_xfer_begin(self, begin: XferBegin) -> str | None: ...

    def on_peer_refused(self, peer: PeerAddr, reason: str) -> None: ...


class Peers:
    def __init__(
        self,
        me: PeerAddr,
        codec: Codec,
        p2p: P2pConfig,
        handlers: dict[type[msgspec.Struct], Handler],
        num_layers: int,
        name: str,
    ) -> None:
        self.me = me
        self.p2p = p2p
        self._num_layers = num_layers
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None
        routes: dict[type[msgspec.Struct], Handler] = {
            Hello: self.on_hello,
            StoreSet: lambda peer, m: self.groups.on_store_set(peer, m),
            Bye: self.on_bye,
            XferBegin: self.on_xfer_begin,
            **handlers,
        }
        self.control = ControlPlane(
            codec,
            me,
            routes,
            name,
            on_heard=self.on_heard,
            on_rejected=self.on_rejected,
            first=(Cancel,),
        )
        self.groups = PairGroups(
            me,
            self.control.send,
            p2p.group_setup_timeout_s,
            p2p.transfer_timeout_s,
            on_ready=self._on_ready,
            on_dropped=self._on_dropped,
            max_groups=p2p.max_pair_groups,
            same_host_transport=p2p.same_host_transport,
            ring_capacity=max(p2p.in_flight_bytes, 2 * p2p.chunk_bytes),
        )
        self._log = RateLimitedLog(logger)
        self._told: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._told_lock = threading.Lock()
        self._last_tick: float | None = None
        self._next_heartbeat = 0.0
        #: Pair groups torn down, by why (peer_lost, goodbye, idle, broken, evicted).
        self.num_groups_torn_down: collections.Counter[str] = collections.Counter()

    def bind(self, sender: Sender | None, receiver: Receiver | None) -> None:
        """The owners whose transfers ride the lanes (P: sender, D: receiver)."""
        self._sender, self._receiver = sender, receiver

    def start(self) -> None:
        self.control.start()

    # ------------------------------------------------------------------ groups
    def ensure(self, peer: PeerAddr) -> PairGroup:
        """The group with ``peer``, set up if there is none (at ``max_pair_groups``, the
        least recently used goes); raises PairGroupError when none can be set up now."""
        self.control.revive(peer)
        group = self.groups.ensure(peer)
        group.last_active = time.monotonic()
        return group

    def send_lane(self, engine_id: str, group: str) -> SendLane | None:
        """The SendLane of generation ``group`` with a peer, if it is up."""
        g = self.groups.get(engine_id)
        if g is None or g.name != group or g.send_lane is None:
            return None
        g.last_active = time.monotonic()
        return g.send_lane

    def has_group(self, engine_id: str, group: str) -> bool:
        g = self.groups.get(engine_id)
        return g is not None and g.name == group and g.closed is None

    def lose(
        self, engine_id: str, reason: str, group: str | None = None, why: str | None = None
    ) -> None:
        """Tear down the group with a peer (only generation ``group``, when given), counted
        in ``num_groups_torn_down[why]`` when ``why`` is given."""
        if why is not None:
            self.num_groups_torn_down[why] += 1
        self.groups.drop(engine_id, reason, group)

    def _on_ready(self, group: PairGroup) -> None:
        peer, p2p, wire = group.peer, self.p2p, group.wire
        assert wire is not None
        send_lane_class, receive_lane_class = lane_classes(wire)
        tag = f"{peer.engine_id[:12]}-{group.name[:6]}"

        def broken(reason: str) -> None:
            self.lose(peer.engine_id, f"lane broken: {reason}", group.name, "broken")

        send_lane = receive_lane = None
        if self._sender is not None:
            send_lane = send_lane_class(
                wire,
                group.name,
                self._num_layers,
                lambda begin: self.control.send(peer, begin),
                self._sender.on_job_ended,
                broken,
                p2p.in_flight_bytes,
                p2p.transfer_timeout_s,
                f"p2p-send-{tag}",
            )
        if self._receiver is not None:
            receiver = self._receiver
            receive_lane = receive_lane_class(
                wire,
                lambda xfer: receiver.on_xfer_part(peer, xfer),
                receiver.drain_layers,
                receiver.on_received,
                broken,
                p2p.in_flight_bytes,
                p2p.transfer_timeout_s,
                f"p2p-recv-{tag}",
            )
        if group.attach(send_lane, receive_lane) and self._sender is not None:
            self._sender.on_group_ready(peer.engine_id)

    def _on_dropped(self, group: PairGroup, reason: str, unstarted: list[Job]) -> None:
        peer = group.peer
        for owner in (self._sender, self._receiver):  # their CANCELs go out before the BYE
            if owner is not None:
                owner.on_peer_lost(peer.engine_id, reason, unstarted)
        self.control.send(peer, Bye(group.name, reason))
        self.control.forget(peer, keep_s=self.p2p.lease_s)

    # ------------------------------------------------------------------ messages
    def on_heard(self, peer: PeerAddr) -> None:
        group = self.groups.get(peer.engine_id)
        if group is not None and group.peer == peer:
            group.last_heard = time.monotonic()

    def on_hello(self, peer: PeerAddr, hello: Hello) -> None:
        self.control.revive(peer)
        self.groups.on_hello(peer, hello)

    def on_bye(self, peer: PeerAddr, bye: Bye) -> None:
        group = self.groups.get(peer.engine_id)
        if group is not None and group.name == bye.group and group.peer == peer:
            self.lose(peer.engine_id, f"the peer said goodbye ({bye.reason})", bye.group, "goodbye")

    def on_xfer_begin(self, peer: PeerAddr, begin: XferBegin) -> None:
        group = self.groups.get(peer.engine_id)
        if group is None or group.name != begin.group or group.peer != peer:
            problem: str | None = "no such pair group"
        elif self._receiver is None:
            problem = "not a KV consumer"
        else:
            problem = self._receiver.check_xfer_begin(begin)
        if problem is None and group is not None and group.receive(begin):
            group.last_active = time.monotonic()
            return
        # The sender's lane can't be in step with ours: it must tear its group down.
        problem = problem or "the pair group is going"
        self._log.warning("xfer_begin", "XFER_BEGIN from %s refused: %s", peer, problem)
        self.control.send(peer, Bye(begin.group, f"XFER_BEGIN refused: {problem}"))
        if group is not None and group.name == begin.group:
            self.lose(peer.engine_id, f"XFER_BEGIN refused: {problem}", begin.group, "broken")

    def on_rejected(self, error: ProtocolError) -> None:
        peer = error.claimed_sender
        if error.reason not in _TOLD or peer is None:
            return  # (the control plane logged it)
        now = time.monotonic()
        with self._told_lock:
            told = self._told.get(peer.endpoint)
            tell = told is None or now - told >= 1.0  # at most once a second per address
            if tell:
                self._told[peer.endpoint] = now
                self._told.move_to_end(peer.endpoint)
                while len(self._told) > _MAX_TOLD:
                    self._told.popitem(last=False)
        if tell:
            self.control.send(peer, Heartbeat())  # it refuses this the same way: both log it
        group = self.groups.get(peer.engine_id)
        if self._receiver is not None and (group is None or not group.is_up):
            self._receiver.on_peer_refused(peer, str(error))

    # ------------------------------------------------------------------ the clock
    def on_tick(self, now: float, beats: Callable[[], dict[PeerAddr, Heartbeat]]) -> None:
        """Heartbeats (``beats()``: those naming transfers; every group peer gets one),
        liveness, idle teardown, and DEALERs whose time is up."""
        p2p = self.p2p
        gap = 0.0 if self._last_tick is None else now - self._last_tick
        self._last_tick = now
        groups = self.groups.all()
        if gap > PAUSE_S:  # this process did not run (stopped, starved): nobody was silent
            for group in groups:
                group.last_heard += gap
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + p2p.heartbeat_s
            to_send = beats()
            for group in groups:
                to_send.setdefault(group.peer, Heartbeat())
            for peer, beat in to_send.items():
                self.control.send(peer, beat)
        for group in groups:
            wire = group.wire
            if isinstance(wire, ShmWire) and wire.peer_exited():  # no need to wait for silence
                reason = f"peer lost: its process {wire.peer_pid} exited"
                self.lose(group.peer.engine_id, reason, group.name, "peer_lost")
            elif now - group.last_heard > p2p.peer_timeout_s:
                reason = f"peer lost: nothing heard for {p2p.peer_timeout_s:g}s"
                self.lose(group.peer.engine_id, reason, group.name, "peer_lost")
            elif group.is_up and now - group.last_active > p2p.idle_ttl_s:
                self.lose(group.peer.engine_id, f"idle for {p2p.idle_ttl_s:g}s", group.name, "idle")
        self.control.close_retired(now)

    def close(self) -> None:
        """Say goodbye to every peer and stop (queued goodbyes get a second to leave); the
        lanes' threads get a few seconds to let go of their process groups."""
        groups = self.groups.close("shutting down")
        self.control.close(linger_s=1.0)
        deadline = time.monotonic() + 5.0
        for group in groups:
            if not group.join(max(0.0, deadline - time.monotonic())):
                logger.warning("a lane with %s is still in a gloo wait at shutdown", group.peer)

    # ------------------------------------------------------------------ stats
    def paths(self) -> dict[str, str]:
        """Peer engine id -> the wire its pair group is up on: "shm", or "gloo" (with why not
        shared memory, when the pair could have used it), for ``/instances``."""
        out = {}
        for group in self.groups.all():
            wire = group.wire
            if wire is not None and group.closed is None:
                why = f" (not shm: {group.fallback})" if group.fallback else ""
                out[group.peer.engine_id] = f"{wire.kind}{why}"
        return out

    def stats(self) -> dict[str, int]:
        rejected = dict(self.control.rejected)
        out = {"num_rejected_messages": sum(rejected.values())}
        out.update({f"num_rejected_{reason}": n for reason, n in rejected.items()})
        out["num_evicted_peers"] = self.control.num_evicted_peers
        out["num_dropped_hellos"] = self.groups.num_dropped_hellos
        out["pair_groups"] = len(self.groups)
        kinds = [group.wire.kind for group in self.groups.all() if group.wire is not None]
        out["pair_groups_shm"] = kinds.count("shm")
        out["num_shm_fallbacks"] = self.groups.num_shm_fallbacks
        out["peer_connections"] = self.control.num_peers
        for why in ("peer_lost", "goodbye", "idle", "broken"):
            out[f"num_pair_groups_torn_down_{why}"] = self.num_groups_torn_down[why]
        out["num_pair_groups_torn_down_evicted"] = self.groups.num_evicted
        return out
