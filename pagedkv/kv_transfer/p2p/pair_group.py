"""PairGroups: one wire per P/D pair, created on first contact: the pair's shared memory when
both are on one host and boot (same_host.py, shm_segment.py), else a 2-rank gloo process group.

No global world: ``torch.distributed.is_initialized()`` stays False and instances join and leave
freely. Rank 0 is the instance with the smaller engine id. A group is named by a random
generation id; its rendezvous rides our control plane (``PairStore``), and gloo's own listener
binds ``kv_ip`` only.

Setup (the side that needs the group first, normally D when it sends its first WANT)::

    A: ensure(B) -> Hello(gen) -> B          both: ProcessGroupGloo(PrefixStore(gen, PairStore))
                                                   on a setup thread, ``group_setup_timeout_s``
    A <- StoreSet(gen, key, addr) <-> B      (the rendezvous keys, both ways)

If both sides start a group at once (two kv_both instances), the smaller generation id wins:
the other side abandons its own (its PairStore raises) and joins the winner. A Hello for a new
generation from a peer we already have a group with means the peer lost it: ours is torn down.
At most ``max_groups`` live (the least recently used goes first). Once ready, a group gets
its lanes (``on_ready``; lanes.py). ``drop`` tears a group down: its
lanes stop, and the ProcessGroupGloo is released as soon as the lanes' threads end (it holds
sockets and a thread; gloo's ``abort`` closes nothing, only the last reference going does,
which also makes the peer's pending operations fail at once). All groups share one gloo
device (one listening socket on ``kv_ip``), made with the first and dropped with the last.
At most ``MAX_PENDING_SETUPS`` groups are being set up at once (each holds a thread for up to
the setup timeout): past that a Hello is dropped and ``ensure`` raises, so a flood of Hellos
or of loads naming made-up peers costs bounded threads. NCCL groups for CUDA tensors would be
created the same way (not built: no GPU here).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
from torch.distributed import PrefixStore, ProcessGroupGloo

from pagedkv.kv_transfer.p2p.lanes import Job, SendLane
from pagedkv.kv_transfer.p2p.protocol import Hello, StoreSet, XferBegin
from pagedkv.kv_transfer.p2p.receive_lane import ReceiveLane
from pagedkv.kv_transfer.p2p.rendezvous import PairStore
from pagedkv.kv_transfer.p2p.same_host import agree_on_shm
from pagedkv.kv_transfer.p2p.wire import GlooWire, ShmWire, Wire
from pagedkv.transport.peer_addr import PeerAddr

logger = logging.getLogger(__name__)


#: Pair groups in setup at once; a setup normally takes milliseconds.
MAX_PENDING_SETUPS = 32
#: Batches announced by a peer whose side of a group was ready before ours, kept at most.
MAX_EARLY_BATCHES = 64


class PairGroupError(RuntimeError):
    pass


class PairGroup:
    """One generation of the group with one peer: pending until ``ready`` is set. Its lanes
    (attached once ready) are the only holders of its process group besides itself."""

    def __init__(self, peer: PeerAddr, name: str, rank: int, store: PairStore) -> None:
        self.peer = peer
        self.name = name
        self.rank = rank
        self.store = store
        #: What the lanes move messages over, once ready: shared memory or gloo.
        self.wire: Wire | None = None
        #: Why this same-host-capable pair is not on shared memory (None: it is, or n/a).
        self.fallback: str | None = None
        self.error: str | None = None
        self.ready = threading.Event()
        self.send_lane: SendLane | None = None
        self.receive_lane: ReceiveLane | None = None
        #: Monotonic times of its last transfer (idle teardown, least recently used first)
        #: and of the last message from its peer (liveness).
        self.last_active = self.last_heard = time.monotonic()
        self.closed: str | None = None
        self._lock = threading.Lock()
        #: XFER_BEGINs that came before the lanes (the peer's side was ready first).
        self._early: list[XferBegin] | None = []
        self._stopped_lanes: list[SendLane | ReceiveLane] = []

    @property
    def peer_rank(self) -> int:
        return 1 - self.rank

    @property
    def is_up(self) -> bool:
        return self.closed is None and self.wire is not None

    def attach(self, send_lane: SendLane | None, receive_lane: ReceiveLane | None) -> bool:
        """Give the ready group its lanes (started here); False if it was torn down first."""
        with self._lock:
            if self.closed is not None:
                return False
            self.send_lane, self.receive_lane = send_lane, receive_lane
            for lane in (send_lane, receive_lane):
                if lane is not None:
                    lane.start()
            early, self._early = self._early or [], None
            for begin in early:  # in their order, before any later one
                if receive_lane is not None:
                    receive_lane.submit(begin)
        return True

    def receive(self, begin: XferBegin) -> bool:
        """Hand a batch to the receive lane (kept until the lane exists while this side is
        still being set up); False if it can't be received here."""
        with self._lock:
            if self.closed is not None:
                return False
            if self.receive_lane is None:
                if self._early is None or len(self._early) >= MAX_EARLY_BATCHES:
                    return False
                self._early.append(begin)
                return True
            return self.receive_lane.submit(begin)

    def close(self, reason: str) -> list[Job]:
        """Tear down: the lanes stop (returned: send jobs that never started), the store
        gives up, and the process group goes once the lanes' threads have let go of it."""
        with self._lock:
            if self.closed is not None:
                return []
            self.closed = reason
            send_lane, receive_lane = self.send_lane, self.receive_lane
            self.send_lane = self.receive_lane = None
        self.store.abort(reason)
        if isinstance(self.wire, ShmWire):
            self.wire.segment.close_pair()
        self.wire = None
        self._stopped_lanes = [lane for lane in (send_lane, receive_lane) if lane is not None]
        if receive_lane is not None:
            receive_lane.stop(reason)
        return send_lane.stop(reason) if send_lane is not None else []

    def join(self, timeout_s: float) -> bool:
        """After ``close``: wait for the lanes' threads to end (they hold the process group,
        which must go before the interpreter does). False if one is still in a gloo wait."""
        deadline = time.monotonic() + timeout_s
        return all(lane.join(max(0.0, deadline - time.monotonic())) for lane in self._stopped_lanes)


class PairGroups:
    """The pair group with each peer. ``on_ready(group)`` and ``on_dropped(group, reason,
    unstarted_jobs)`` are called without this object's lock held."""

    def __init__(
        self,
        me: PeerAddr,
        send: Callable[[PeerAddr, msgspec.Struct], bool],
        setup_timeout_s: float,
        op_timeout_s: float,
        on_ready: Callable[[PairGroup], None] | None = None,
        on_dropped: Callable[[PairGroup, str, list[Job]], None] | None = None,
        max_groups: int = 64,
        same_host_transport: str = "network",
        ring_capacity: int = 32 << 20,
    ) -> None:
        self.me = me
        self.same_host_transport = same_host_transport
        self.ring_capacity = ring_capacity
        self.max_groups = max_groups
        self._send = send
        self._setup_timeout_s = setup_timeout_s
        self._op_timeout_s = op_timeout_s
        self._on_ready = on_ready
        self._on_dropped = on_dropped
        self._groups: dict[str, PairGroup] = {}
        self._lock = threading.Lock()
        self._closed = False
        #: The gloo device every group uses; None while there is no group.
        self._device: object | None = None
        #: Hellos refused while MAX_PENDING_SETUPS groups were being set up.
        self.num_dropped_hellos = 0
        #: Groups torn down to stay within ``max_groups``.
        self.num_evicted = 0
        #: Groups set up over gloo although shared memory was wanted (``PairGroup.fallback``).
        self.num_shm_fallbacks = 0

    def _rank_with(self, peer: PeerAddr) -> int:
        return 0 if self.me.engine_id < peer.engine_id else 1

    @property
    def num_pending(self) -> int:
        """Groups still being set up."""
        return sum(not group.ready.is_set() for group in self._groups.values())

    def __len__(self) -> int:
        return len(self._groups)

    def all(self) -> list[PairGroup]:
        with self._lock:
            return list(self._groups.values())

    def get(self, engine_id: str) -> PairGroup | None:
        with self._lock:
            return self._groups.get(engine_id)

    def ensure(self, peer: PeerAddr) -> PairGroup:
        """The group with ``peer`` (pending or ready); starts one if there is none."""
        evicted: list[PairGroup] = []
        try:
            with self._lock:
                group = self._groups.get(peer.engine_id)
                if group is not None and group.error is None:
                    return group
                return self._start(peer, uuid.uuid4().hex, True, evicted)
        finally:
            self._close_evicted(evicted)

    def on_hello(self, peer: PeerAddr, hello: Hello) -> None:
        superseded = None
        evicted: list[PairGroup] = []
        with self._lock:
            group = self._groups.get(peer.engine_id)
            if group is not None:
                if group.name == hello.group:
                    return
                if not group.ready.is_set() and group.name < hello.group:
                    return  # both started one: ours wins, the peer joins it
                superseded = self._pop_locked(group)
            try:
                self._start(peer, hello.group, False, evicted)
            except PairGroupError as e:
                self.num_dropped_hellos += 1
                if self.num_dropped_hellos & (self.num_dropped_hellos - 1) == 0:  # 1, 2, 4...
                    logger.warning(
                        "Hello from %s dropped: %s [%d so far]", peer, e, self.num_dropped_hellos
                    )
        if superseded is not None:
            self._close(superseded, f"the peer started generation {hello.group[:8]}")
        self._close_evicted(evicted)

    def _close_evicted(self, evicted: list[PairGroup]) -> None:
        for group in evicted:
            self._close(group, f"{self.max_groups} pair groups live (least recently used)")

    def on_store_set(self, peer: PeerAddr, message: StoreSet) -> None:
        with self._lock:
            group = self._groups.get(peer.engine_id)
        if group is None or group.name != message.group:
            logger.warning("rendezvous key for unknown pair group %s from %s", message.group, peer)
            return
        if not group.store.deliver(message.key, message.value):
            logger.warning("rendezvous key rejected (store limits) from %s", peer)

    def _start(
        self, peer: PeerAddr, name: str, send_hello: bool, evicted: list[PairGroup]
    ) -> PairGroup:
        """Called with the lock held: register the generation, then set it up on a thread.
        At ``max_groups``, the least recently used group is popped into ``evicted`` (the
        caller tears it down once the lock is released)."""
        if self._closed:
            raise PairGroupError("pair groups are shut down")
        if self.num_pending >= MAX_PENDING_SETUPS:
            raise PairGroupError(f"{MAX_PENDING_SETUPS} pair groups are already being set up")
        if len(self._groups) >= self.max_groups:
            victim = min(self._groups.values(), key=lambda g: g.last_active)
            evicted.append(self._pop_locked(victim))
            self.num_evicted += 1

        def publish(key: str, value: bytes) -> None:
            self._send(peer, StoreSet(name, key, value))

        store = PairStore(publish, self._setup_timeout_s)
        group = PairGroup(peer, name, self._rank_with(peer), store)
        self._groups[peer.engine_id] = group
        if self._device is None:
            self._device = ProcessGroupGloo.create_device(hostname=self.me.host)
        if send_hello:  # before the setup thread publishes any key: the peer must know the group
            self._send(peer, Hello(name))
        threading.Thread(
            target=self._setup,
            args=(group, self._device),
            name=f"pair-setup-{name[:8]}",
            daemon=True,
        ).start()
        return group

    def _setup(self, group: PairGroup, device: object) -> None:
        try:
            wire = self._make_wire(group, device)
            with self._lock:
                current = self._groups.get(group.peer.engine_id) is group and not group.closed
                if current:
                    group.wire = wire
            del wire  # dropped during setup: released here
            if not current:
                raise PairGroupError("dropped during setup")
            assert group.wire is not None
            how = group.wire.kind
            if group.fallback is not None:
                how = f"{how}, not shared memory: {group.fallback}"
            logger.info(
                "pair group %s with %s ready (rank %d, %s)",
                group.name[:8], group.peer, group.rank, how,
            )  # fmt: skip
        except Exception as e:
            group.error = str(e)
            group.ready.set()
            with self._lock:
                popped = (
                    self._pop_locked(group)
                    if self._groups.get(group.peer.engine_id) is group
                    else None
                )
            if popped is not None:
                logger.warning("pair group %s with %s failed: %s", group.name[:8], group.peer, e)
                self._close(popped, f"setup failed: {e}")
            return
        group.ready.set()
        if self._on_ready is not None:
            self._on_ready(group)

    def _make_wire(self, group: PairGroup, device: object) -> Wire:
        """Shared memory when both ranks agree (same_host.py), else a gloo process group."""
        wanted = self.same_host_transport == "shm"
        shm, why_not = agree_on_shm(group.store, group.rank, wanted, self.ring_capacity)
        if shm is not None:
            return shm
        if wanted:
            group.fallback = why_not
            self.num_shm_fallbacks += 1
        options = ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=self._op_timeout_s)
        options._devices = [device]
        options._threads = 1  # no collectives: send/recv never use the worker threads
        pg = ProcessGroupGloo(PrefixStore(group.name, group.store), group.rank, 2, options)
        return GlooWire(pg, group.peer_rank)

    def drop(self, engine_id: str, reason: str, name: str | None = None) -> PairGroup | None:
        """Tear down the group with a peer (only generation ``name``, when given)."""
        with self._lock:
            group = self._groups.get(engine_id)
            if group is None or (name is not None and group.name != name):
                return None
            self._pop_locked(group)
        self._close(group, reason)
        return group

    def _pop_locked(self, group: PairGroup) -> PairGroup:
        del self._groups[group.peer.engine_id]
        if not self._groups:
            self._device = None  # released with the last group's process group
        return group

    def _close(self, group: PairGroup, reason: str) -> None:
        logger.info("pair group %s with %s torn down: %s", group.name[:8], group.peer, reason)
        unstarted = group.close(reason)
        if self._on_dropped is not None:
            self._on_dropped(group, reason, unstarted)

    def close(self, reason: str = "shutdown") -> list[PairGroup]:
        """Tear every group down; returns them (the peers to say goodbye to)."""
        with self._lock:
            self._closed = True
            groups = [self._pop_locked(group) for group in list(self._groups.values())]
        for group in groups:
            self._close(group, reason)
        return groups
