"""PairGroups: one 2-rank gloo process group per P/D pair, created on first contact.

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
A group is torn down (``drop``: gloo connections closed, so the peer's pending ops fail fast)
when a send or receive on it fails or the peer stops answering. At most
``MAX_PENDING_SETUPS`` groups are being set up at once (each holds a thread for up to the
setup timeout): past that a Hello is dropped and ``ensure`` raises, so a flood of Hellos or
of loads naming made-up peers costs bounded threads. NCCL groups for CUDA tensors
would be created the same way (not built: no GPU here).
"""

from __future__ import annotations

import datetime
import logging
import threading
import uuid
from collections.abc import Callable

import msgspec
from torch.distributed import PrefixStore, ProcessGroupGloo

from pagedkv.kv_transfer.p2p.protocol import Hello, PeerAddr, StoreSet
from pagedkv.kv_transfer.p2p.store import PairStore

logger = logging.getLogger(__name__)


#: Pair groups in setup at once; a setup normally takes milliseconds.
MAX_PENDING_SETUPS = 32


class PairGroupError(RuntimeError):
    pass


class PairGroup:
    """One generation of the group with one peer: pending until ``ready`` is set."""

    def __init__(self, peer: PeerAddr, name: str, rank: int, store: PairStore) -> None:
        self.peer = peer
        self.name = name
        self.rank = rank
        self.store = store
        self.pg: ProcessGroupGloo | None = None
        self.error: str | None = None
        self.ready = threading.Event()

    @property
    def peer_rank(self) -> int:
        return 1 - self.rank

    def wait(self, timeout_s: float) -> ProcessGroupGloo:
        if not self.ready.wait(timeout_s):
            raise PairGroupError(f"pair group with {self.peer.engine_id} not ready in {timeout_s}s")
        if self.pg is None:
            raise PairGroupError(f"pair group with {self.peer.engine_id} failed: {self.error}")
        return self.pg


class PairGroups:
    def __init__(
        self,
        me: PeerAddr,
        send: Callable[[PeerAddr, msgspec.Struct], bool],
        setup_timeout_s: float,
        op_timeout_s: float,
    ) -> None:
        self.me = me
        self._send = send
        self._setup_timeout_s = setup_timeout_s
        self._op_timeout_s = op_timeout_s
        self._groups: dict[str, PairGroup] = {}
        self._lock = threading.Lock()
        self._closed = False
        #: Hellos refused while MAX_PENDING_SETUPS groups were being set up.
        self.num_dropped_hellos = 0

    def _rank_with(self, peer: PeerAddr) -> int:
        return 0 if self.me.engine_id < peer.engine_id else 1

    @property
    def num_pending(self) -> int:
        """Groups still being set up."""
        return sum(not group.ready.is_set() for group in self._groups.values())

    def get(self, engine_id: str) -> PairGroup | None:
        with self._lock:
            return self._groups.get(engine_id)

    def ensure(self, peer: PeerAddr) -> PairGroup:
        """The group with ``peer`` (pending or ready); starts one if there is none."""
        with self._lock:
            group = self._groups.get(peer.engine_id)
            if group is not None and group.error is None:
                return group
            return self._start(peer, uuid.uuid4().hex, send_hello=True)

    def on_hello(self, peer: PeerAddr, hello: Hello) -> None:
        with self._lock:
            group = self._groups.get(peer.engine_id)
            if group is not None:
                if group.name == hello.group:
                    return
                if not group.ready.is_set() and group.name < hello.group:
                    return  # both started one: ours wins, the peer joins it
                self._drop_locked(group, f"superseded by generation {hello.group[:8]}")
            try:
                self._start(peer, hello.group, send_hello=False)
            except PairGroupError as e:
                self.num_dropped_hellos += 1
                if self.num_dropped_hellos & (self.num_dropped_hellos - 1) == 0:  # 1, 2, 4...
                    logger.warning(
                        "Hello from %s dropped: %s [%d so far]", peer, e, self.num_dropped_hellos
                    )

    def on_store_set(self, peer: PeerAddr, message: StoreSet) -> None:
        with self._lock:
            group = self._groups.get(peer.engine_id)
        if group is None or group.name != message.group:
            logger.warning("rendezvous key for unknown pair group %s from %s", message.group, peer)
            return
        if not group.store.deliver(message.key, message.value):
            logger.warning("rendezvous key rejected (store limits) from %s", peer)

    def _start(self, peer: PeerAddr, name: str, send_hello: bool) -> PairGroup:
        """Called with the lock held: register the generation, then set it up on a thread."""
        if self._closed:
            raise PairGroupError("pair groups are shut down")
        if self.num_pending >= MAX_PENDING_SETUPS:
            raise PairGroupError(f"{MAX_PENDING_SETUPS} pair groups are already being set up")

        def publish(key: str, value: bytes) -> None:
            self._send(peer, StoreSet(name, key, value))

        store = PairStore(publish, self._setup_timeout_s)
        group = PairGroup(peer, name, self._rank_with(peer), store)
        self._groups[peer.engine_id] = group
        if send_hello:  # before the setup thread publishes any key: the peer must know the group
            self._send(peer, Hello(name))
        threading.Thread(
            target=self._setup, args=(group,), name=f"pair-setup-{name[:8]}", daemon=True
        ).start()
        return group

    def _setup(self, group: PairGroup) -> None:
        try:
            options = ProcessGroupGloo._Options()
            options._timeout = datetime.timedelta(seconds=self._op_timeout_s)
            options._devices = [ProcessGroupGloo.create_device(hostname=self.me.host)]
            pg = ProcessGroupGloo(PrefixStore(group.name, group.store), group.rank, 2, options)
            with self._lock:
                current = self._groups.get(group.peer.engine_id) is group
                if current:
                    group.pg = pg
            if not current:  # dropped while it was being set up
                pg.abort()
                raise PairGroupError("dropped during setup")
            logger.info(
                "pair group %s with %s ready (rank %d)", group.name[:8], group.peer, group.rank
            )
        except Exception as e:
            group.error = str(e)
            logger.warning("pair group %s with %s failed: %s", group.name[:8], group.peer, e)
            with self._lock:
                if self._groups.get(group.peer.engine_id) is group:
                    del self._groups[group.peer.engine_id]
        finally:
            group.ready.set()

    def drop(self, engine_id: str, reason: str, name: str | None = None) -> None:
        """Tear down the group with a peer (only generation ``name``, when given)."""
        with self._lock:
            group = self._groups.get(engine_id)
            if group is not None and (name is None or group.name == name):
                self._drop_locked(group, reason)

    def _drop_locked(self, group: PairGroup, reason: str) -> None:
        del self._groups[group.peer.engine_id]
        logger.info("pair group %s with %s torn down: %s", group.name[:8], group.peer, reason)
        group.store.abort(reason)
        if group.pg is not None:
            group.pg.abort()  # closes the connections: the peer's pending ops fail fast

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for group in list(self._groups.values()):
                self._drop_locked(group, "shutdown")
